"""Feeding micro-batches to the loop: one DataLoader per dataset for the whole run.

Its loader processes live as long as the run (persistent workers), so an epoch or a validation
does not pay their start-up again. Each pass sets the plans to read and starts a new iteration;
PyTorch drains whatever the workers prefetched for the previous pass before the new one begins,
so a pass cut short (an out-of-memory re-plan) never leaks a batch into the next. Checks that
should speak once per sample (not once per worker) run here, in the main process.
"""
from __future__ import annotations

import logging
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainers.data.data_order import StepPlan
from trainers.data.features import TRAILING_RUN_WARN, Batch, FeatureDataset, collate_batch, trailing_run_length
from trainers.stop_signals import ignore_stop_signals

log = logging.getLogger("train")


class _PlanSampler:
    """A batch_sampler yielding the micro-batches of the plans it currently holds."""

    def __init__(self) -> None:
        self.plans: Sequence[StepPlan] = []

    def __iter__(self) -> Iterator[list[int]]:
        for plan in self.plans:
            yield from plan.micro_batches


class StepLoader:
    def __init__(self, dataset: FeatureDataset, workers: int, pin_memory: bool, seed: int) -> None:
        self.dataset = dataset
        self._sampler = _PlanSampler()
        # A private generator keeps DataLoader's worker seeding off the global RNG, so starting a
        # pass mid-epoch on resume draws nothing the uninterrupted run would not have drawn.
        self._loader: DataLoader | None = DataLoader(
            dataset, batch_sampler=self._sampler, num_workers=workers, collate_fn=collate_batch, pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(seed), persistent_workers=workers > 0,
            worker_init_fn=ignore_stop_signals if workers else None)
        self._checked = np.zeros(len(dataset), dtype=bool)  # one byte per sample, not a set of Python ints

    def close(self) -> None:
        """Shut the worker processes down (dropping the loader drops its iterator, which stops them)."""
        self._loader = None

    def batches(self, plans: Sequence[StepPlan]) -> Iterator[Batch]:
        assert self._loader is not None, "the loader was closed"
        self._sampler.plans = plans
        for batch in self._loader:
            self._warn_about_trailing_runs(batch)
            yield batch

    def _warn_about_trailing_runs(self, batch: Batch) -> None:
        for row, index in enumerate(batch.indices.tolist()):
            if self._checked[index]:
                continue
            self._checked[index] = True
            codes = batch.codes[row, : int(batch.code_lens[row])].numpy()
            run = trailing_run_length(codes)
            if run >= TRAILING_RUN_WARN:
                sample = self.dataset.samples[index]
                log.warning("%s: codes file %s ends in %d identical codes (value %d); this may be padding saved as "
                            "data by the preprocessing tool; trim it or re-extract the codes", sample.source,
                            sample.codes_path, run, int(codes[-1]))
