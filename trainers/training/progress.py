"""How far training has come: the "progress" section of a checkpoint."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainers.training.train_log import LogInterval
from trainers.training.validation_listeners import Listeners

log = logging.getLogger("train")


@dataclass
class TrainingProgress:
    step: int = 0  # optimizer steps done
    samples_seen: int = 0
    # Oldest first, saved so a resumed run's history is whole. Entries by "kind": "train" (metrics of a
    # log interval), "val" (a validation), "start" / "resume" (an invocation began: when, where, from
    # which checkpoint, which settings differ from the saved run).
    history: list[dict[str, Any]] = field(default_factory=list)
    # The steps after the last "train" entry, summed (the run's TrainLog adds to it): saved, so the entry a
    # resumed run logs at the end of the interval covers the steps before the interruption too.
    interval: LogInterval = field(default_factory=LogInterval)
    # What acts on validations (best.pth, early stopping, the forgetting guard, ...): each saves its state in this
    # section under its own key, so a resumed run stops, and keeps best.pth, where the uninterrupted one does.
    listeners: Listeners = field(default_factory=Listeners)

    def record_start(self, resumed_from: Path | None, machine: str, changes: list[str]) -> None:
        self.history.append({"kind": "resume" if resumed_from else "start", "step": self.step,
                             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
                             "checkpoint": resumed_from.name if resumed_from else None, "changes": list(changes)})

    def step_done(self, samples: int) -> None:
        self.step += 1
        self.samples_seen += samples

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen, "history": list(self.history),
                "interval": self.interval.state_dict(), **self.listeners.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.history = list(state["history"])
        self.listeners.load_state_dict(state)
        if state.get("interval") is not None:
            self.interval.load_state_dict(state["interval"])
        else:
            self.interval.clear()
            log.info("the checkpoint of step %d holds no open log interval (written by an earlier version):",
                     self.step)
            log.info("the first train metrics logged after this resume average only the steps from %d on",
                     self.step + 1)
