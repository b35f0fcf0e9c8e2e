"""How far training has come: the "progress" section of a checkpoint."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainingProgress:
    step: int = 0  # optimizer steps done
    samples_seen: int = 0
    # Oldest first, saved so a resumed run's history is whole. Entries by "kind": "train" (metrics of a
    # log interval), "val" (a validation), "start" / "resume" (an invocation began: when, where, from
    # which checkpoint, which settings differ from the saved run).
    history: list[dict[str, Any]] = field(default_factory=list)

    def record_start(self, resumed_from: Path | None, machine: str, changes: list[str]) -> None:
        self.history.append({"kind": "resume" if resumed_from else "start", "step": self.step,
                             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine,
                             "checkpoint": resumed_from.name if resumed_from else None, "changes": list(changes)})

    def step_done(self, samples: int) -> None:
        self.step += 1
        self.samples_seen += samples

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.history = list(state["history"])
