"""Which samples make up each optimizer step, as a pure function of the run's settings.

Position is counted at optimizer-step boundaries: (epoch, step_in_epoch). The order of an
epoch depends only on (seed, epoch, dataset size); step k of an epoch takes the samples
order[k*E : (k+1)*E] for the effective batch E, and the micro-batch size only decides how
those samples are cut into pieces. Resuming at a step slices the order directly, so the
cost of skipping does not grow with the position and no skipped sample is ever loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class Position:
    """Where training stands: the next step to run is `step_in_epoch` of `epoch`."""

    epoch: int
    step_in_epoch: int

    def normalised(self, steps_per_epoch: int) -> "Position":
        """Turn 'one past the last step of an epoch' into 'step 0 of the next epoch'."""
        if self.step_in_epoch >= steps_per_epoch:
            return Position(self.epoch + 1, 0)
        return self


def steps_per_epoch(num_samples: int, effective_batch: int) -> int:
    # The last, smaller step of an epoch is kept: the loss is normalised per token, so a
    # short step is a correct step, and no sample is silently left out.
    return math.ceil(num_samples / effective_batch)


def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """Permutation of sample indices for one epoch (PCG64 keyed by seed and epoch)."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return rng.permutation(num_samples)


def step_samples(order: np.ndarray, step_in_epoch: int, effective_batch: int) -> np.ndarray:
    start = step_in_epoch * effective_batch
    return order[start : start + effective_batch]


def split_micro_batches(samples: np.ndarray, micro_batch: int) -> list[list[int]]:
    return [samples[i : i + micro_batch].tolist() for i in range(0, len(samples), micro_batch)]


@dataclass(frozen=True)
class StepPlan:
    """The samples of one optimizer step, already cut into micro-batches."""

    epoch: int
    step_in_epoch: int
    micro_batches: list[list[int]]

    @property
    def samples(self) -> list[int]:
        return [i for mb in self.micro_batches for i in mb]


@dataclass(frozen=True)
class DataOrder:
    seed: int
    num_samples: int
    effective_batch: int

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.num_samples, self.effective_batch)

    def plan_epoch(self, epoch: int, start_step: int, micro_batch: int) -> list[StepPlan]:
        """Plans for steps start_step.. of one epoch; earlier steps are never materialised."""
        order = epoch_order(self.seed, epoch, self.num_samples)
        return [
            StepPlan(epoch, k, split_micro_batches(step_samples(order, k, self.effective_batch), micro_batch))
            for k in range(start_step, self.steps_per_epoch)
        ]


class MicroBatchSampler:
    """A DataLoader batch_sampler that yields the micro-batches of a list of step plans."""

    def __init__(self, plans: list[StepPlan]) -> None:
        self.plans = plans

    def __iter__(self) -> Iterator[list[int]]:
        for plan in self.plans:
            yield from plan.micro_batches

    def __len__(self) -> int:
        return sum(len(p.micro_batches) for p in self.plans)
