"""Fault injection for tests: SIGKILL this process at a named point of training.

Set INDEXTTS_TRAIN_KILL_AT to one of
  micro:STEP:J        after micro-batch J (0-based) of optimizer step STEP (1-based) - mid accumulation
  step:STEP           after optimizer step STEP and any checkpoint it saves
  save:STEP:EVENT     during the checkpoint save of STEP, at a checkpoint_io event
                      (tmp_written, renamed or linked)
The kill is a real SIGKILL: nothing gets to clean up, as when a cloud machine is preempted.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV_VAR = "INDEXTTS_TRAIN_KILL_AT"


@dataclass(frozen=True)
class KillPoint:
    spec: str | None = None

    @classmethod
    def from_env(cls) -> "KillPoint":
        return cls(os.environ.get(ENV_VAR) or None)

    def check(self, *parts: object) -> None:
        if self.spec is not None and ":".join(str(p) for p in parts) == self.spec:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_checkpoint_event(self, event: str, step: int) -> None:
        self.check("save", step, event)
