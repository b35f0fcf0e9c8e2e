"""Fault injection for tests: signal this process at a named point of training.

Set INDEXTTS_TRAIN_KILL_AT to one or more (comma-separated) of
  setup               when start-up has finished, before the first step
  micro:STEP:J        after micro-batch J (0-based) of optimizer step STEP (1-based): mid accumulation
  step:STEP           after optimizer step STEP and any checkpoint it saves
  save:STEP:EVENT     during the checkpoint save of STEP, at a checkpoint file event
                      (tmp_written, renamed or linked)
  validation:STEP     when the validation after STEP optimizer steps begins
each optionally prefixed with a signal name, e.g. SIGTERM@micro:7:1 (default SIGKILL). SIGKILL is
real: nothing gets to clean up, as when a cloud machine is preempted.

Out-of-memory errors are injected the same way, so the recovery path runs on a CPU:
  INDEXTTS_TRAIN_OOM_ABOVE=N  every forward pass of more than N samples (training, validation
                              and the micro-batch probe) raises torch.OutOfMemoryError
  INDEXTTS_TRAIN_OOM_AT=STEP:J  once, at micro-batch J of optimizer step STEP, after the earlier
                              micro-batches of that step have accumulated their gradients
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

ENV_VAR = "INDEXTTS_TRAIN_KILL_AT"


@dataclass(frozen=True)
class KillPoint:
    points: tuple[tuple[str, int], ...] = ()  # (point, signal number)

    @classmethod
    def from_env(cls) -> "KillPoint":
        points = []
        for spec in filter(None, (os.environ.get(ENV_VAR) or "").split(",")):
            name, _, point = spec.rpartition("@")
            points.append((point, signal.Signals[name].value if name else signal.SIGKILL))
        return cls(tuple(points))

    def check(self, *parts: object) -> None:
        here = ":".join(str(p) for p in parts)
        for point, signum in self.points:
            if point == here:
                os.kill(os.getpid(), signum)

    def on_checkpoint_event(self, event: str, step: int) -> None:
        self.check("save", step, event)


OOM_ABOVE_VAR = "INDEXTTS_TRAIN_OOM_ABOVE"
OOM_AT_VAR = "INDEXTTS_TRAIN_OOM_AT"


@dataclass
class OomInjector:
    above: int | None = None
    at: str | None = None

    @classmethod
    def from_env(cls) -> "OomInjector":
        above = os.environ.get(OOM_ABOVE_VAR)
        return cls(int(above) if above else None, os.environ.get(OOM_AT_VAR) or None)

    @property
    def active(self) -> bool:
        return self.above is not None or self.at is not None

    def check(self, size: int, step: int | None = None, micro: int | None = None) -> None:
        """Raise the error CUDA raises, as if this forward pass of `size` samples ran out of memory."""
        if self.above is not None and size > self.above:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {size} samples > {OOM_ABOVE_VAR}={self.above})")
        if self.at is not None and f"{step}:{micro}" == self.at:
            self.at = None  # once: the redone step must succeed
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {OOM_AT_VAR}={step}:{micro})")
