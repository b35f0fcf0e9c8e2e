"""What went wrong in this process's part of an optimizer step, held until the processes agree on it.

A failure in forward/backward or in the clipping must not leave the step at once: under torchrun
every process still takes part in the gradient sum and in the agreement on the step
(trainers/training/distributed.py), or the others would wait for it. Out of memory is recoverable
(the step is redone with a smaller micro-batch); a bad sample stops the run; any other error is
raised where it happens (as a nondeterministic-op stop where it is one).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from trainers.data.features import FeatureError
from trainers.hardware.determinism import nondeterministic_or
from trainers.hardware.oom_recovery import is_out_of_memory, oom_message


@dataclass
class StepFailures:
    step: int  # 1-based, as the messages name it
    oom: str | None = None  # the out-of-memory error's text
    bad_sample: FeatureError | None = None

    @property
    def none(self) -> bool:
        return self.oom is None and self.bad_sample is None

    @contextlib.contextmanager
    def held(self, where: str) -> Iterator[None]:
        """Around a phase of the step (`where`: "in the forward/backward pass", ...): an out-of-memory error
        or a bad sample is kept here instead of raised."""
        try:
            yield
        except FeatureError as exc:
            self.bad_sample = exc
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise nondeterministic_or(exc, f"{where} of step {self.step}")
            # Keep only the text: leaving this handler drops the failed pass's frames, graph and tensors.
            self.oom = oom_message(exc)
