"""What processes other than rank 0 hold in place of the run's writers under torchrun.

Rank 0 alone writes into the run directory: `MainRankCheckpoints` wraps the run's Checkpointer
(rank 0 writes, in the background where the save mode says so; every process learns the outcome),
`QuietLog` stands in for the TrainLog and `NoLock` for the run-directory lock on the other ranks.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from trainers.errors import (
    EXIT_DIVERGED, EXIT_HOST_MEMORY, EXIT_SAVE_FAILED, CheckpointWriteError, DistributedFailure, HostMemoryError,
    TrainingDiverged,
)
from trainers.training.train_log import StepMetrics

log = logging.getLogger("train")


class MainRankCheckpoints:
    """The run's Checkpointer under torchrun: rank 0 writes with the usual atomic protocol, in the
    background where the run's save mode says so, and every process learns the outcome at an
    agreement, so all stop together on a failure (exit 4):

    * a save: rank 0 first learns how its previous write ended (waiting for it if it is still
      going), then submits the new one; every process learns both outcomes and compares a
      fingerprint of its weights with the others' (they must be identical);
    * every step boundary (World.agree_to_stop): a background write that already failed;
    * `wait()`, before a stop's exit and before the last exit: rank 0's write has ended, and how.

    latest.pth can only name a step every process finished: the step's gradient sum needed all of
    them before rank 0 could update its weights. What this does not agree on goes to the inner
    Checkpointer as it is: the others' never writes (so wait_own, write_failed_step: nothing there)."""

    def __init__(self, inner: Any, world: Any, model: torch.nn.Module) -> None:  # world: distributed.World
        self.inner = inner
        self.world = world
        self.model = model

    def save(self, step: int) -> Any:
        return self._agreed(lambda: self.inner.save(step), step, "checkpoint")

    def save_best(self, step: int, metric: str, value: float) -> Any:
        return self._agreed(lambda: self.inner.save_best(step, metric, value), step, "best.pth")

    def wait(self) -> None:
        """Every process: until rank 0's write in flight has ended; CheckpointWriteError everywhere if it failed."""
        status, error, failed = 0, None, -1
        if self.world.is_main:
            try:
                self.inner.wait()
            except CheckpointWriteError as exc:
                status, error, failed = EXIT_SAVE_FAILED, exc, self.inner.writer.failed_step
        worst, failed_step = self.world._reduce([status, failed if failed is not None else -1], dist.ReduceOp.MAX,
                                                "the end of rank 0's checkpoint write")
        if error is not None:
            raise error
        if worst:
            self.raise_write_failure(int(failed_step))

    def raise_write_failure(self, step: int) -> None:
        """Stop with exit 4 after rank 0's write of `step` failed: rank 0 with the write's own error."""
        if self.world.is_main:
            self.inner.wait()  # raises the write's error, mapped to CheckpointWriteError with its cause
        raise CheckpointWriteError(f"rank 0 could not write the checkpoint of step {step} (see its message); the "
                                   f"previous checkpoint is intact; continue with --resume auto --output-dir "
                                   f"{self.inner.run_dir}")

    def _agreed(self, write: Any, step: int, what: str) -> Any:
        """Rank 0 writes (or submits a background write); every process learns the outcome of that and of
        the previous write, and checks that all weights agree."""
        status, error, path, failed = 0, None, None, -1
        started = time.perf_counter()
        if self.world.is_main:
            try:
                path = write()
            except CheckpointWriteError as exc:
                status, error = EXIT_SAVE_FAILED, exc
                failed = self.inner.writer.failed_step if self.inner.writer.failed_step is not None else step
            except TrainingDiverged as exc:
                status, error = EXIT_DIVERGED, exc
            except HostMemoryError as exc:  # the host copy of a background save could not be allocated
                status, error = EXIT_HOST_MEMORY, exc
        fingerprint = _weights_fingerprint(self.model)
        worst, failed_step, high, low = self.world._reduce([status, failed, fingerprint, -fingerprint],
                                                           dist.ReduceOp.MAX, f"the {what} save of step {step}")
        if error is not None:
            raise error
        if worst == EXIT_SAVE_FAILED:
            self.raise_write_failure(int(failed_step))
        if worst == EXIT_DIVERGED:
            raise TrainingDiverged(f"rank 0 did not save step {step}: it holds non-finite values")
        if worst == EXIT_HOST_MEMORY:
            raise HostMemoryError(f"rank 0 ran out of host memory (RAM) for the copy of the checkpoint of step {step} "
                                  "(see its message); nothing was saved from it, the previous checkpoint is intact")
        if high != -low:
            raise DistributedFailure(f"the processes' weights differ at step {step} (fingerprints {-low!r} to "
                                     f"{high!r}); this is a bug: step {step} was not saved")
        if self.world.is_main:
            log.info("step %d: the %s save held the %d processes for %.3f s", step, what, self.world.size,
                     time.perf_counter() - started)
        return path

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class QuietLog:
    """The training log of processes other than rank 0: the same calls, nothing written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def validation(self, step: int, by_lang: dict[str, StepMetrics], model: str = "") -> dict[str, float]:
        return StepMetrics.total(by_lang.values()).means()

    def __getattr__(self, name: str) -> Any:  # every other call of TrainLog's: nothing to write, None to return
        return lambda *args, **kwargs: None


class NoLock:
    """What processes other than rank 0 hold: rank 0 alone locks the run directory."""

    existed = True

    def release(self) -> None:
        pass

    def abandon(self) -> None:
        pass


@torch.no_grad()
def _weights_fingerprint(model: torch.nn.Module) -> float:
    """A number every process computes alike from identical weights (float64 sums, fixed order)."""
    total = 0.0
    for i, p in enumerate(model.parameters()):
        total += float(p.double().sum()) * (1.0 + (i % 7) / 8)
    return total
