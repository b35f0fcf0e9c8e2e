"""Fault injection for tests: signal this process at a named point of training.

Set INDEXTTS_TRAIN_KILL_AT to one of
  micro:STEP:J        after micro-batch J (0-based) of optimizer step STEP (1-based): mid accumulation
  step:STEP           after optimizer step STEP and any checkpoint it saves
  save:STEP:EVENT     during the checkpoint save of STEP, at a checkpoint_io event
                      (tmp_written, renamed or linked)
optionally prefixed with a signal name, e.g. SIGTERM@micro:7:1 (default SIGKILL). SIGKILL is
real: nothing gets to clean up, as when a cloud machine is preempted.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV_VAR = "INDEXTTS_TRAIN_KILL_AT"


@dataclass(frozen=True)
class KillPoint:
    point: str | None = None
    signum: int = signal.SIGKILL

    @classmethod
    def from_env(cls) -> "KillPoint":
        spec = os.environ.get(ENV_VAR) or None
        if spec and "@" in spec:
            name, point = spec.split("@", 1)
            return cls(point, signal.Signals[name].value)
        return cls(spec)

    def check(self, *parts: object) -> None:
        if self.point is not None and ":".join(str(p) for p in parts) == self.point:
            os.kill(os.getpid(), self.signum)

    def on_checkpoint_event(self, event: str, step: int) -> None:
        self.check("save", step, event)
