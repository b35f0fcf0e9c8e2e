"""trainers/data/loader.py: the run-long loader feeding the loop's micro-batches."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from tests.test_features import SPEC, make_sample
from trainers.data.data_order import DataOrder
from trainers.data.features import FeatureDataset
from trainers.data.loader import StepLoader


class _PidDataset(FeatureDataset):
    """Names each item after the process that loaded it."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "id": str(os.getpid())}


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    folder = tmp_path_factory.mktemp("features")
    padded = np.concatenate([np.arange(4), np.full(20, 7)]).astype(np.int32)  # ends like saved padding
    return [make_sample(folder, index=i, codes=padded if i == 3 else None) for i in range(24)]


def _passes(loader: StepLoader, epochs: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    order = DataOrder(seed=1, num_samples=24, effective_batch=8)
    got, expected = [], []
    for epoch in range(epochs):
        plans = order.plan_epoch(epoch, 0, 3)
        expected += [mb for p in plans for mb in p.micro_batches]
        got += [b.indices.tolist() for b in loader.batches(plans)]
    return got, expected


@pytest.mark.parametrize("workers", [0, 2])
def test_every_pass_yields_exactly_its_plans_whatever_the_worker_count(samples, workers):
    loader = StepLoader(FeatureDataset(samples, SPEC), workers, pin_memory=False, seed=0)
    got, expected = _passes(loader, epochs=3)
    assert got == expected
    # A pass cut short (an out-of-memory re-plan) leaks nothing it had prefetched into the next pass.
    plans = DataOrder(seed=1, num_samples=24, effective_batch=8).plan_epoch(3, 0, 3)
    next(iter(loader.batches(plans)))
    assert [b.indices.tolist() for b in loader.batches(plans[1:])] == [mb for p in plans[1:] for mb in p.micro_batches]


def test_loader_workers_live_across_passes(samples):
    loader = StepLoader(_PidDataset(samples, SPEC), 2, pin_memory=False, seed=0)
    plans = DataOrder(seed=1, num_samples=24, effective_batch=8).plan_epoch(0, 0, 4)
    first = {pid for b in loader.batches(plans) for pid in b.ids}
    second = {pid for b in loader.batches(plans) for pid in b.ids}
    assert len(first) == 2 and first == second and str(os.getpid()) not in first


def test_a_pass_draws_nothing_from_the_global_rng(samples):
    loader = StepLoader(FeatureDataset(samples, SPEC), 2, pin_memory=False, seed=0)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    plans = DataOrder(seed=1, num_samples=24, effective_batch=8).plan_epoch(0, 0, 8)
    next(iter(loader.batches(plans)))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_trailing_run_is_reported_once_per_sample_not_per_worker_or_epoch(samples, caplog):
    loader = StepLoader(FeatureDataset(samples, SPEC), 2, pin_memory=False, seed=0)
    with caplog.at_level(logging.WARNING, logger="train"):
        _passes(loader, epochs=3)
    warnings = [r.getMessage() for r in caplog.records if "identical codes" in r.getMessage()]
    assert len(warnings) == 1
    assert samples[3].codes_path in warnings[0] and "20 identical" in warnings[0] and "padding" in warnings[0]
