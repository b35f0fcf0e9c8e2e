"""Linear warmup then cosine decay, as a pure function of the optimizer step.

The horizon (`decay_steps`) is fixed when a run starts and saved with it, so extending a
finished run with a larger --max-steps or more --epochs never makes the learning rate jump:
past the horizon it stays at the floor.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class WarmupCosine:
    base_lr: float
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float = 0.0

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based: the first update uses lr_at(0))."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.base_lr * self.min_lr_ratio
        return floor + (self.base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "warmup_cosine", **asdict(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "WarmupCosine":
        return cls(float(state["base_lr"]), int(state["warmup_steps"]), int(state["decay_steps"]),
                   float(state["min_lr_ratio"]))
