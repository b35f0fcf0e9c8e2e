"""Which samples make up each optimizer step depends only on (seed, epoch, step, effective batch, dataset)."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from trainers.data import data_order
from trainers.data.features import FeatureSpec
from trainers.data.manifest import Sample
from trainers.data.train_data import TrainData
from trainers.data.data_order import (DataOrder, epoch_order,
                                      grouped_epoch_order, packed_lengths, steps_per_epoch)


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


def _samples(n: int) -> list[Sample]:
    return [Sample(index=i, id=f"s{i}", source=f"m.jsonl:{i + 1}", text_ids_path="", codes_path="", condition_path="",
                   emo_vec_path="", text_len=1 + i % 7, code_len=5 + i % 11, lang=None, speaker=None) for i in range(n)]


@pytest.mark.parametrize("grouped", [False, True])
def test_train_data_moves_to_the_next_epoch_after_its_last_step(grouped):
    data = TrainData(_samples(50), FeatureSpec(4, 10, 8), seed=1, effective_batch=16, grouped=grouped)
    plans = data.plan_epoch(micro_batch=5)
    assert [len(p.samples) for p in plans] == [16, 16, 16, 2]
    assert data.steps_left(epochs=2) == 8
    for plan in plans[:3]:
        data.advance(plan)
    assert (data.epoch, data.step_in_epoch, data.samples_in_epoch) == (0, 3, 48)
    restored = TrainData(_samples(50), FeatureSpec(4, 10, 8), seed=1, effective_batch=16, grouped=grouped)
    restored.load_state_dict(data.state_dict())
    assert restored.plan_epoch(micro_batch=5) == plans[3:]  # the rest of the epoch, never its start
    data.advance(plans[3])  # one past the last step of an epoch is step 0 of the next
    assert (data.epoch, data.step_in_epoch, data.samples_in_epoch) == (1, 0, 0)
    assert data.steps_left(epochs=2) == 4 and data.steps_left(epochs=1) == 0


# --- plain order: exactly the order of runs made before length grouping existed ----------------

# sha256 of json.dumps([p.micro_batches for p in plans]) for the cases below, taken with the
# data_order.py of commit 7957162 (before length grouping).
PLAIN_ORDER_DIGEST = "504eaa9dff6052e1cc1b03016732825f2d4ad43d498485e33c3e9eeb1d593840"
PLAIN_CASES = ((1234, 1000, 32, 4, 0), (1234, 1000, 32, 5, 3), (7, 103, 16, 3, 1))


def _plain_digest(make) -> str:
    h = hashlib.sha256()
    for seed, n, batch, micro, epoch in PLAIN_CASES:
        h.update(json.dumps([p.micro_batches for p in make(seed, n, batch).plan_epoch(epoch, 0, micro)]).encode())
    return h.hexdigest()


def test_plain_order_is_byte_identical_to_the_order_before_grouping():
    assert _plain_digest(lambda seed, n, batch: DataOrder(seed, n, batch)) == PLAIN_ORDER_DIGEST
    # Lengths are ignored unless grouped=True, so wiring them in cannot change an old run.
    lengths = _lengths(1000, seed=3)
    assert _plain_digest(lambda seed, n, batch: DataOrder(seed, n, batch, lengths=lengths[:n])) == PLAIN_ORDER_DIGEST
    # And the same thing spelled out: a PCG64 permutation keyed by (seed, epoch), cut in order.
    for seed, n, batch, micro, epoch in PLAIN_CASES:
        perm = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n).tolist()
        steps = [perm[k:k + batch] for k in range(0, n, batch)]
        expected = [[step[i:i + micro] for i in range(0, len(step), micro)] for step in steps]
        plans = DataOrder(seed, n, batch, grouped=False).plan_epoch(epoch, 0, micro)
        assert [p.micro_batches for p in plans] == expected


# --- grouped order ------------------------------------------------------------------------------


def _lengths(n: int, seed: int) -> np.ndarray:
    """Packed lengths shaped like TTS data: text 10-200 tokens, codes ~6.5 per text token."""
    rng = np.random.Generator(np.random.PCG64(seed))
    text = np.clip(np.round(np.exp(rng.normal(np.log(60), 0.6, n))), 10, 200)
    codes = np.clip(np.round(text * np.exp(rng.normal(np.log(6.5), 0.25, n))), 50, 1500)
    return packed_lengths(text, codes)


def _grouped(seed: int, n: int, batch: int) -> DataOrder:
    return DataOrder(seed, n, batch, lengths=_lengths(n, seed=n), grouped=True)


def _padding_efficiency(order: DataOrder, epoch: int, micro: int) -> float:
    real = padded = 0
    for plan in order.plan_epoch(epoch, 0, micro):
        for mb in plan.micro_batches:
            lens = order.lengths[mb]
            real += int(lens.sum())
            padded += len(mb) * int(lens.max())
    return real / padded


@pytest.mark.parametrize("n,batch", [(1000, 32), (103, 16), (5000, 32), (64, 8), (5, 8)])
def test_grouped_order_is_deterministic_and_each_sample_comes_once(n, batch):
    order = _grouped(11, n, batch)
    flat = order.flat_order(2)
    assert np.array_equal(flat, _grouped(11, n, batch).flat_order(2))
    assert sorted(flat.tolist()) == list(range(n))
    plans = order.plan_epoch(2, 0, 4)
    assert len(plans) == order.steps_per_epoch
    assert sorted(i for p in plans for i in p.samples) == list(range(n))


def _step_mates(order: DataOrder, epoch: int) -> set[tuple[int, int]]:
    """Pairs of samples that share a step."""
    pairs = set()
    for plan in order.plan_epoch(epoch, 0, order.effective_batch):
        s = sorted(plan.samples)
        pairs.update((a, b) for i, a in enumerate(s) for b in s[i + 1:])
    return pairs


def test_grouped_order_changes_with_epoch_and_seed():
    a = _grouped(11, 4000, 32)
    flat = a.flat_order(0)
    assert not np.array_equal(flat, a.flat_order(1))
    assert not np.array_equal(flat, _grouped(12, 4000, 32).flat_order(0))
    # Not only the order of the steps: which samples share a step changes from epoch to epoch
    # (about 8% of step-mates meet again here; sorting whole epochs would keep about 90%).
    before, after = _step_mates(a, 0), _step_mates(a, 1)
    assert len(before & after) < 0.2 * len(before)


@pytest.mark.parametrize("n,batch", [(1000, 32), (103, 16), (5000, 32)])
def test_grouped_step_k_is_the_flat_slice_k(n, batch):
    order = _grouped(5, n, batch)
    flat = order.flat_order(1)
    plans = order.plan_epoch(1, 0, 4)
    for k, plan in enumerate(plans):
        assert plan.step_in_epoch == k
        assert sorted(plan.samples) == sorted(flat[k * batch:(k + 1) * batch].tolist())
    for start in (1, 7, len(plans) - 1):
        assert order.plan_epoch(1, start, 4) == plans[start:]


def test_rest_of_a_grouped_epoch_can_be_recut_with_another_effective_batch():
    """After k steps exactly flat[:k*E] has been seen, so the rest is flat[k*E:], cut at any size."""
    order = _grouped(5, 1000, 32)
    flat = order.flat_order(3)
    plans = order.plan_epoch(3, 0, 8)
    for k in (0, 1, 13, 31):
        seen = [i for p in plans[:k] for i in p.samples]
        assert sorted(seen) == sorted(flat[:k * 32].tolist())
        for other in (1, 24, 48):
            rest = [flat[s:s + other].tolist() for s in range(k * 32, len(flat), other)]
            assert sorted(seen + [i for step in rest for i in step]) == list(range(1000))


@pytest.mark.parametrize("seed,epoch", [(s, e) for s in range(4) for e in range(3)])
def test_grouped_short_step_is_the_last_and_a_random_set(seed, epoch):
    n, batch = 1000, 32  # 31 full steps and one of 8
    order = _grouped(seed, n, batch)
    sizes = [len(p.samples) for p in order.plan_epoch(epoch, 0, 4)]
    assert sizes == [batch] * (n // batch) + [n % batch]
    flat = order.flat_order(epoch)
    # Its samples are the last n mod E of the epoch's shuffle, not the longest of a sorted window.
    assert np.array_equal(flat[-(n % batch):], epoch_order(seed, epoch, n)[-(n % batch):])


def test_grouped_steps_do_not_depend_on_micro_batch():
    order = _grouped(3, 1003, 32)
    reference = [p.samples for p in order.plan_epoch(0, 0, 32)]
    for micro in (1, 3, 4, 5, 8, 13):
        plans = order.plan_epoch(0, 0, micro)
        assert [p.samples for p in plans] == reference  # same sets and the same concatenation
        assert all(len(mb) <= micro for p in plans for mb in p.micro_batches)
        assert all(len(mb) == micro for p in plans for mb in p.micro_batches[:-1])
    assert np.array_equal(order.flat_order(0), grouped_epoch_order(3, 0, order.lengths, 32))


def test_grouped_step_is_cut_longest_first_ties_by_index():
    lengths = np.array([5, 9, 5, 7, 9, 1, 5, 7] * 4)
    order = DataOrder(0, 32, 8, lengths=lengths, grouped=True)
    for plan in order.plan_epoch(0, 0, 3):
        keys = [(-int(lengths[i]), i) for i in plan.samples]
        assert keys == sorted(keys)


def test_grouping_pads_much_less_than_the_plain_order():
    lengths = _lengths(6000, seed=0)
    grouped = DataOrder(9, 6000, 32, lengths=lengths, grouped=True)
    plain = DataOrder(9, 6000, 32, lengths=lengths)
    for micro, bound in ((4, 0.95), (8, 0.95), (32, 0.9)):
        plain_eff, grouped_eff = _padding_efficiency(plain, 0, micro), _padding_efficiency(grouped, 0, micro)
        assert plain_eff < 0.7 and grouped_eff > bound, (micro, plain_eff, grouped_eff)


def test_planning_from_a_step_never_touches_earlier_steps(monkeypatch):
    cut = []
    real = data_order.split_micro_batches
    monkeypatch.setattr(data_order, "split_micro_batches", lambda s, m: cut.append(list(s)) or real(s, m))
    for order in (_grouped(1, 2000, 32), DataOrder(1, 2000, 32)):
        cut.clear()
        plans = list(order.plan_epoch(0, 50, 4))  # steps are cut when they are reached
        assert len(cut) == len(plans) == order.steps_per_epoch - 50
        assert sorted(i for s in cut for i in s) == sorted(order.flat_order(0)[50 * 32:].tolist())


def test_grouped_needs_one_positive_length_per_sample():
    with pytest.raises(ValueError, match="needs the packed length"):
        DataOrder(0, 10, 4, grouped=True)
    with pytest.raises(ValueError, match="one length per sample"):
        DataOrder(0, 10, 4, lengths=np.ones(9), grouped=True)
    with pytest.raises(ValueError, match="positive"):
        DataOrder(0, 3, 4, lengths=[3, 0, 2], grouped=True)


def test_orders_compare_by_their_lengths():
    a = DataOrder(0, 4, 2, lengths=[1, 2, 3, 4], grouped=True)
    assert a == DataOrder(0, 4, 2, lengths=np.array([1, 2, 3, 4]), grouped=True)
    assert a != DataOrder(0, 4, 2, lengths=[1, 2, 4, 3], grouped=True)
    assert a != DataOrder(0, 4, 2, lengths=[1, 2, 3, 4])
    assert hash(a) == hash(DataOrder(0, 4, 2, lengths=[1, 2, 3, 4], grouped=True))
    assert not a.lengths.flags.writeable


def test_packed_lengths_match_the_model_and_the_manifest_check():
    from trainers.data.manifest import DataLimits
    from trainers.model.layout import PREFIX_LEN

    limits = DataLimits(max_text_tokens=200, max_mel_tokens=1500)
    assert PREFIX_LEN == limits.prefix_len == 34
    assert packed_lengths([10, 200], [50, 1500]).tolist() == [limits.positions(10, 50), limits.positions(200, 1500)]
