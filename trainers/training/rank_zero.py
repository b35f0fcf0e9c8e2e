"""What processes other than rank 0 hold in place of the run's writers under torchrun.

Rank 0 alone writes into the run directory: `MainRankCheckpoints` wraps the run's Checkpointer
(rank 0 writes, every process learns the outcome), `QuietLog` stands in for the TrainLog and
`NoLock` for the run-directory lock on the other ranks.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from trainers.errors import (
    EXIT_DIVERGED, EXIT_SAVE_FAILED, CheckpointWriteError, DistributedFailure, TrainingDiverged,
)
from trainers.training.train_log import StepMetrics

log = logging.getLogger("train")


class MainRankCheckpoints:
    """The run's Checkpointer under torchrun: rank 0 writes with the usual atomic protocol, every
    process waits until the write has ended and learns whether it worked, so all stop together
    on a failure. latest.pth can only name a step every process finished: the step's gradient sum
    needed all of them before rank 0 could update its weights. The same all-reduce compares a
    fingerprint of every process's weights, which must be identical."""

    def __init__(self, inner: Any, world: Any, model: torch.nn.Module) -> None:  # world: distributed.World
        self.inner = inner
        self.world = world
        self.model = model

    def save(self, step: int) -> Any:
        return self._agreed(lambda: self.inner.save(step), step, "checkpoint")

    def save_best(self, step: int, metric: str, value: float) -> Any:
        return self._agreed(lambda: self.inner.save_best(step, metric, value), step, "best.pth")

    def _agreed(self, write: Any, step: int, what: str) -> Any:
        """Rank 0 writes (synchronously: the run sets background saves off under torchrun); every
        process learns the outcome and checks that all weights agree."""
        import torch.distributed as dist

        status, error, path = 0, None, None
        started = time.perf_counter()
        if self.world.is_main:
            try:
                path = write()
            except CheckpointWriteError as exc:
                status, error = EXIT_SAVE_FAILED, exc
            except TrainingDiverged as exc:
                status, error = EXIT_DIVERGED, exc
        fingerprint = _weights_fingerprint(self.model)
        worst, high, low = self.world._reduce([status, fingerprint, -fingerprint], dist.ReduceOp.MAX,
                                              f"the {what} save of step {step}")
        if error is not None:
            raise error
        if worst == EXIT_SAVE_FAILED:
            raise CheckpointWriteError(f"rank 0 could not write the {what} of step {step} (see its message); the "
                                       "previous checkpoint is intact")
        if worst == EXIT_DIVERGED:
            raise TrainingDiverged(f"rank 0 did not save step {step}: it holds non-finite values")
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

    def validation(self, step: int, by_lang: dict[str, StepMetrics]) -> dict[str, float]:
        return StepMetrics.total(by_lang.values()).means()

    def train_step(self, *args: Any) -> None:
        pass

    def flush_interval(self, *args: Any) -> None:
        pass

    def write_steps(self) -> None:
        pass

    def scalar(self, *args: Any) -> None:
        pass

    def sample_ids(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


class NoLock:
    """What processes other than rank 0 hold: rank 0 alone locks the run directory."""

    def release(self) -> None:
        pass


@torch.no_grad()
def _weights_fingerprint(model: torch.nn.Module) -> float:
    """A number every process computes alike from identical weights (float64 sums, fixed order)."""
    total = 0.0
    for i, p in enumerate(model.parameters()):
        total += float(p.double().sum()) * (1.0 + (i % 7) / 8)
    return total
