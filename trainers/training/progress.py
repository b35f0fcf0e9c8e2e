"""How far training has come: the "progress" section of a checkpoint."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainingProgress:
    step: int = 0  # optimizer steps done
    samples_seen: int = 0
    # Train-interval and validation metrics, oldest first; saved so a resumed run's history is whole.
    history: list[dict[str, Any]] = field(default_factory=list)

    def step_done(self, samples: int) -> None:
        self.step += 1
        self.samples_seen += samples

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.history = list(state["history"])
