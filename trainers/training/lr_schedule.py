"""The learning rate as a pure function of the optimizer step: linear warmup, then cosine decay.

The horizon (`decay_steps`) is fixed when a run starts and saved with it, so extending a
finished run never makes the learning rate jump: past the horizon it stays at the floor. A run
extended to a later end may get a continuation, which takes over from its first step:

* `Rewarm` (--rewarm): a linear warmup from the rate of the last step back up to a peak, then a
  cosine down to the floor at the new end: the usual way to train a finished run further.
* `Continuation` (--reconfigure-scheduler): a warmup-free cosine from the rate of the last step
  down to the floor at the new end. After a finished cosine that rate is about the floor, so the
  extension trains little.

Both start where the last step left the rate, so it never jumps. Continuations are part of the
saved schedule, so a resume in the middle of one continues it exactly.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Union

import torch

from trainers.errors import UserError

REWARM = "rewarm"  # the "kind" of a saved Rewarm; a saved continuation without a kind is a Continuation


def _cosine(start_lr: float, floor: float, progress: float) -> float:
    return floor + (start_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


@dataclass(frozen=True)
class WarmupCosine:
    base_lr: float
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float = 0.0

    @property
    def floor(self) -> float:
        return self.base_lr * self.min_lr_ratio

    @property
    def end_step(self) -> int:
        """The first step at the floor: the horizon, or the step after the peak when the warmup is not shorter."""
        return self.decay_steps if self.decay_steps > self.warmup_steps else self.warmup_steps + 1

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based: the first update uses lr_at(0))."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        span = max(1, self.decay_steps - self.warmup_steps)
        return _cosine(self.base_lr, self.floor, (step - self.warmup_steps) / span)

    def describe(self) -> tuple[str, ...]:
        warmup = f"warmup {_steps(self.warmup_steps)} to {self.base_lr:.4g}, " if self.warmup_steps else \
            f"{self.base_lr:.4g}, "
        if self.decay_steps <= self.warmup_steps:
            return (f"{warmup}then {self.floor:.4g} from step {self.end_step}",)  # no cosine: the horizon is in the warmup
        return (f"{warmup}cosine to {self.floor:.4g} at step {self.decay_steps}",)


@dataclass(frozen=True)
class Continuation:
    """From `start_step` on: a cosine from `start_lr` down to `floor` at `end_step`, then the floor."""

    start_step: int
    end_step: int
    start_lr: float
    floor: float

    def lr_at(self, step: int) -> float:
        return _cosine(self.start_lr, self.floor, (step - self.start_step) / max(1, self.end_step - self.start_step))

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)  # no "kind": the form every trainer version wrote and reads

    def describe(self) -> tuple[str, ...]:
        return (f"from step {self.start_step} a cosine from the last rate {self.start_lr:.4g} (--reconfigure-scheduler)",
                f"the cosine reaches {self.floor:.4g} at step {self.end_step}")


@dataclass(frozen=True)
class Rewarm:
    """From `start_step` on: a linear rise from `start_lr` to `peak_lr` over `warmup_steps` steps (the last
    of them at the peak), then a cosine from the peak down to `floor` at `end_step`, then the floor."""

    start_step: int
    end_step: int
    start_lr: float
    peak_lr: float
    warmup_steps: int
    floor: float

    def lr_at(self, step: int) -> float:
        k = step - self.start_step
        if k < self.warmup_steps:
            return self.start_lr + (self.peak_lr - self.start_lr) * (k + 1) / self.warmup_steps
        span = max(1, self.end_step - self.start_step - self.warmup_steps)
        return _cosine(self.peak_lr, self.floor, (k - self.warmup_steps) / span)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": REWARM, **asdict(self)}

    def describe(self) -> tuple[str, ...]:
        return (f"from step {self.start_step} a re-warm from {self.start_lr:.4g} to {self.peak_lr:.4g} over "
                f"{_steps(self.warmup_steps)} (--rewarm)", f"then a cosine to {self.floor:.4g} at step {self.end_step}")


Extension = Union[Continuation, Rewarm]


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


def _extension_from_state(state: dict[str, Any]) -> Extension:
    state = dict(state)
    kind = state.pop("kind", None)
    if kind == REWARM:
        return Rewarm(int(state["start_step"]), int(state["end_step"]), float(state["start_lr"]),
                      float(state["peak_lr"]), int(state["warmup_steps"]), float(state["floor"]))
    if kind is not None:
        raise UserError(f"the saved learning-rate schedule holds a continuation of kind {kind!r}, which this version "
                        "of the trainer does not know (a newer version wrote it): update the trainer")
    return Continuation(**state)


@dataclass(frozen=True)
class LRSchedule:
    base: WarmupCosine
    continuations: tuple[Extension, ...] = ()

    @property
    def end_step(self) -> int:
        """The step from which the learning rate stays at the floor."""
        return self.continuations[-1].end_step if self.continuations else self.base.end_step

    @property
    def floor(self) -> float:
        return self.base.floor

    def lr_at(self, step: int) -> float:
        return self._in_force(step).lr_at(step)

    def _in_force(self, step: int) -> WarmupCosine | Extension:
        """The part of the schedule in force at `step`: the last continuation begun by then, or the base."""
        return next((c for c in reversed(self.continuations) if c.start_step <= step), self.base)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr  # --new-rows-lr-scale's groups
        return lr

    def continued(self, step: int, end_step: int) -> "LRSchedule":
        """A new cosine from `step` to `end_step`, starting at the rate of the step before (no jump)."""
        start_lr = self.lr_at(max(0, step - 1))
        return LRSchedule(self.base, (*self.continuations, Continuation(step, end_step, start_lr, self.floor)))

    def rewarmed(self, step: int, end_step: int, peak_lr: float, warmup_steps: int) -> "LRSchedule":
        """From `step`: up from the rate of the step before to `peak_lr`, then a cosine to the floor at `end_step`."""
        start_lr = self.lr_at(max(0, step - 1))
        rewarm = Rewarm(step, end_step, start_lr, peak_lr, warmup_steps, self.floor)
        return LRSchedule(self.base, (*self.continuations, rewarm))

    def describe(self, step: int = 0) -> tuple[str, ...]:
        """The part of the schedule in force from `step` on in words, a log line's worth each (lines of at
        most 120 characters), for the start-up summary."""
        return self._in_force(step).describe()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "warmup_cosine", **asdict(self.base),
                "continuations": [c.state_dict() for c in self.continuations]}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "LRSchedule":
        base = WarmupCosine(float(state["base_lr"]), int(state["warmup_steps"]), int(state["decay_steps"]),
                            float(state["min_lr_ratio"]))
        return cls(base, tuple(_extension_from_state(c) for c in state.get("continuations", [])))
