"""How far training has come: the "progress" section of a checkpoint."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainers.training.forgetting import HIGHER_IS_BETTER, Forgetting
from trainers.training.train_log import LogInterval

log = logging.getLogger("train")

__all__ = ["HIGHER_IS_BETTER", "TrainingProgress"]  # HIGHER_IS_BETTER: which --best-metric values are better higher


@dataclass
class TrainingProgress:
    step: int = 0  # optimizer steps done
    samples_seen: int = 0
    # Oldest first, saved so a resumed run's history is whole. Entries by "kind": "train" (metrics of a
    # log interval), "val" (a validation), "start" / "resume" (an invocation began: when, where, from
    # which checkpoint, which settings differ from the saved run).
    history: list[dict[str, Any]] = field(default_factory=list)
    # The best validation so far, whose checkpoint is best.pth: {"metric", "value", "step"}.
    best: dict[str, Any] | None = None
    # The steps after the last "train" entry, summed (the run's TrainLog adds to it): saved, so the entry a
    # resumed run logs at the end of the interval covers the steps before the interruption too.
    interval: LogInterval = field(default_factory=LogInterval)
    # Validations in a row that did not beat the best (--early-stop-patience counts them): saved, so a
    # resumed run stops where the uninterrupted one does.
    stale_validations: int = 0
    # The base figures of each validation language and the last validation's (the forgetting measure and
    # --forgetting-limit's verdict): saved, so a resumed run measures from the same base and stops where the
    # uninterrupted one does.
    forgetting: Forgetting = field(default_factory=Forgetting)

    def improves(self, metric: str, means: dict[str, float]) -> bool:
        """Whether this validation beats the best one (a best of another metric is compared no more)."""
        if self.best is None or self.best["metric"] != metric:
            return True
        value = means[metric]
        return value > self.best["value"] if metric in HIGHER_IS_BETTER else value < self.best["value"]

    def count_validation(self, improved: bool) -> None:
        self.stale_validations = 0 if improved else self.stale_validations + 1

    def follow_best_metric(self, metric: str) -> None:
        """A resume with another --best-metric: the validations counted without a new best were of the old one."""
        if self.best is not None and self.best["metric"] != metric and self.stale_validations:
            log.info("--best-metric is now %s (was %s): early stopping counts its validations from 0", metric,
                     self.best["metric"])
            self.stale_validations = 0

    def patience_spent(self, patience: int) -> bool:
        """Whether early stopping ends the run: `patience` validations in a row without a new best (0: never)."""
        return patience > 0 and self.stale_validations >= patience

    def record_start(self, resumed_from: Path | None, machine: str, changes: list[str]) -> None:
        self.history.append({"kind": "resume" if resumed_from else "start", "step": self.step,
                             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
                             "checkpoint": resumed_from.name if resumed_from else None, "changes": list(changes)})

    def step_done(self, samples: int) -> None:
        self.step += 1
        self.samples_seen += samples

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen, "history": list(self.history),
                "best": dict(self.best) if self.best else None, "interval": self.interval.state_dict(),
                "stale_validations": self.stale_validations, "forgetting": self.forgetting.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.history = list(state["history"])
        self.best = state.get("best")  # absent in files written before best.pth existed
        self.stale_validations = int(state.get("stale_validations", 0))  # absent before early stopping: 0
        self.forgetting = Forgetting()
        if state.get("forgetting") is not None:  # absent before the forgetting measure: the next validation is the base
            self.forgetting.load_state_dict(state["forgetting"])
        if state.get("interval") is not None:
            self.interval.load_state_dict(state["interval"])
        else:
            self.interval.clear()
            log.info("the checkpoint of step %d holds no open log interval (written by an earlier version):",
                     self.step)
            log.info("the first train metrics logged after this resume average only the steps from %d on",
                     self.step + 1)
