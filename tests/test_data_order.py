"""Which samples make up each optimizer step depends only on (seed, epoch, step, effective batch, dataset)."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainers.data.data_order import DataOrder, MicroBatchSampler, Position, epoch_order, steps_per_epoch


def test_epoch_order_is_a_pure_permutation_that_changes_per_epoch():
    a, b = epoch_order(7, 0, 1000), epoch_order(7, 0, 1000)
    assert np.array_equal(a, b) and sorted(a.tolist()) == list(range(1000))
    assert not np.array_equal(a, epoch_order(7, 1, 1000))
    assert not np.array_equal(a, epoch_order(8, 0, 1000))


def test_step_samples_do_not_depend_on_micro_batch():
    order = DataOrder(seed=3, num_samples=103, effective_batch=16)
    reference = [p.samples for p in order.plan_epoch(0, 0, micro_batch=16)]
    for micro in (1, 3, 5, 8):
        plans = order.plan_epoch(0, 0, micro)
        assert [p.samples for p in plans] == reference
        assert all(len(mb) <= micro for p in plans for mb in p.micro_batches)
    assert sum(len(s) for s in reference) == 103  # every sample once, the short last step kept
    assert len(reference) == steps_per_epoch(103, 16) == 7


def test_resume_slice_equals_the_uninterrupted_tail():
    order = DataOrder(seed=5, num_samples=200, effective_batch=8)
    full = order.plan_epoch(2, 0, 4)
    for start in (1, 7, 24):
        assert order.plan_epoch(2, start, 4) == full[start:]


def test_position_normalises_past_the_last_step():
    assert Position(0, 25).normalised(25) == Position(1, 0)
    assert Position(0, 24).normalised(25) == Position(0, 24)


class _Indices(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return i


def test_worker_count_does_not_change_what_the_loader_yields():
    plans = DataOrder(seed=1, num_samples=64, effective_batch=8).plan_epoch(0, 2, 3)
    expected = [mb for p in plans for mb in p.micro_batches]
    for workers in (0, 2):
        loader = DataLoader(_Indices(), batch_sampler=MicroBatchSampler(plans), num_workers=workers,
                            collate_fn=list, generator=torch.Generator().manual_seed(0))
        assert list(loader) == expected


def test_creating_a_loader_does_not_draw_from_the_global_rng():
    plans = DataOrder(seed=1, num_samples=64, effective_batch=8).plan_epoch(0, 0, 8)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = DataLoader(_Indices(), batch_sampler=MicroBatchSampler(plans), num_workers=2, collate_fn=list,
                        generator=torch.Generator().manual_seed(0))
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)
