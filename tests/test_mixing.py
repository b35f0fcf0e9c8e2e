"""Replay mixing (trainers/data/mixing.py): the shares' arithmetic, the replay cycles, and which samples make each
step of TrainData, whatever the micro-batch or a resume. The runs (exit 2 for bad shares, resume, torchrun) are in
tests/test_forgetting_runs.py."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from trainers.data.features import FeatureSpec
from trainers.data.mixing import Replay, build_mixing, samples_per_step, share_problems
from trainers.data.sample_table import Sample, SampleTable
from trainers.data.train_data import TrainData
from trainers.errors import UserError

SPEC = FeatureSpec(model_dim=8, number_text_tokens=20, max_code=30)


def table(sizes: dict[str, tuple[int, str]]) -> SampleTable:
    """Samples of manifests {name: (count, language)}, in that order, with varied lengths."""
    rows = []
    for name, (count, lang) in sizes.items():
        for line in range(1, count + 1):
            i = len(rows)
            rows.append(Sample(i, f"{name}-{line}", f"{name}:{line}", "t.npy", "c.npy", "d.npy", "e.npy",
                               3 + i % 7, 5 + (i * 5) % 11, lang, None))
    return SampleTable.of(rows)


TWO = {"new.jsonl": (40, "new"), "zh.jsonl": (10, "zh"), "en.jsonl": (7, "en")}
SPECS = ("new.jsonl::new", "zh.jsonl::zh@0.25", "en.jsonl::en@0.1")


def mixed(grouped: bool = False, batch: int = 16, specs=SPECS, sizes=TWO, train_samples: int = 0) -> TrainData:
    samples = table(sizes)
    mixing = build_mixing(specs, samples, batch, ["zh", "en", "new"], 99)
    return TrainData(samples, SPEC, seed=7, effective_batch=batch, grouped=grouped, train_samples=train_samples,
                     mixing=mixing)


def manifest_of(data: TrainData, row: int) -> str:
    return data.samples.manifest_names[int(data.samples.arrays["manifest"][row])]


@pytest.mark.parametrize("specs, expected", [
    (["n.jsonl::am", "z.jsonl::zh@-0.1"], "the share -0.1 must be > 0 and < 1"),
    (["n.jsonl::am", "z.jsonl::zh@1.5"], "the share 1.5 must be > 0 and < 1"),
    (["n.jsonl::am", "z.jsonl::zh@1"], "the share 1 must be > 0 and < 1"),
    (["n.jsonl::am", "z.jsonl::zh@0"], "the share 0 must be > 0 and < 1"),
    (["n.jsonl::am", "z.jsonl::zh@much"], "the share 'much' is not a number"),
    (["n.jsonl::am", "z.jsonl::zh@0.6", "e.jsonl::en@0.4"], "the shares sum to 1, leaving no room for the target"),
    (["z.jsonl::zh@0.5"], "every manifest has a share, so none sets the epoch"),
    (["n.jsonl::am", "z.jsonl@0.2"], "a share follows the language: write PATH::LANG@SHARE"),
    (["n.jsonl::am", "z.jsonl::@0.2"], "no language before '@0.2'"),
    (["n.jsonl::am", "z.jsonl::zh@0.2", "z.jsonl::en@0.1"], "a replay manifest is given twice"),
])
def test_bad_shares_are_named_with_the_flag(specs, expected):
    problems = share_problems(specs)
    assert any(expected in p for p in problems), problems
    assert all(p.startswith("--train-manifest") for p in problems)


def test_good_shares_have_no_problem():
    assert share_problems(["n.jsonl::am", "z.jsonl::zh@0.3", "e.jsonl::en@0.1"]) == []
    assert share_problems(["n.jsonl", "m.jsonl::ja"]) == []


def test_share_times_batch_rounds_to_the_nearest_sample_halves_up_exactly():
    assert samples_per_step(Fraction("0.25"), 10) == 3  # 2.5 -> 3
    assert samples_per_step(Fraction("0.1"), 16) == 2  # 1.6 -> 2
    assert samples_per_step(Fraction("0.3"), 16) == 5  # 4.8 -> 5
    assert samples_per_step(Fraction("0.02"), 16) == 0  # 0.32 -> 0 (refused by build_mixing)
    # 0.29 x 50 is 14.5 exactly; in floats it is 14.499999999999998, which would round down.
    assert 0.29 * 50 < 14.5 and samples_per_step(Fraction("0.29"), 50) == 15


def test_a_replay_manifest_repeats_no_sample_before_all_were_drawn_and_draws_continue_where_they_stopped():
    replay = Replay(1, "zh.jsonl::zh@0.25", Fraction(1, 4), 4, ("zh",), np.arange(100, 110))
    drawn = replay.take(seed=7, position=0, count=30)
    for cycle in range(3):
        assert sorted(drawn[cycle * 10:(cycle + 1) * 10].tolist()) == list(range(100, 110))
    assert not np.array_equal(drawn[:10], drawn[10:20])  # each cycle its own permutation
    pieces = np.concatenate([replay.take(7, 0, 4), replay.take(7, 4, 9), replay.take(7, 13, 17)])
    assert np.array_equal(pieces, drawn)


def test_each_step_takes_its_share_from_each_manifest_and_the_target_sets_the_epoch():
    data = mixed()
    assert data.epoch_batch == 16 - 4 - 2 and data.steps_per_epoch == 4  # 40 target samples, 10 a step
    plans = list(data.plan_epoch(micro_batch=16))
    made = [[manifest_of(data, i) for i in plan.samples] for plan in plans]
    assert [m.count("zh.jsonl") for m in made] == [4, 4, 4, 4] and [m.count("en.jsonl") for m in made] == [2] * 4
    assert sorted(i for plan in plans for i in plan.samples if manifest_of(data, i) == "new.jsonl") == list(range(40))
    assert [plan.replayed for plan in plans] == [(4, 2)] * 4


def test_the_short_last_step_of_an_epoch_takes_the_shares_of_its_size():
    data = mixed(sizes={"new.jsonl": (35, "new"), "zh.jsonl": (10, "zh"), "en.jsonl": (7, "en")})
    plans = list(data.plan_epoch(micro_batch=16))
    assert [len(p.samples) - sum(p.replayed) for p in plans] == [10, 10, 10, 5]
    assert plans[-1].replayed == (2, 1)  # round(4 x 5/10) and round(2 x 5/10), halves up


@pytest.mark.parametrize("grouped", [False, True])
def test_a_step_has_the_same_samples_whatever_the_micro_batch(grouped):
    for a, b in zip(mixed(grouped).plan_epoch(16), mixed(grouped).plan_epoch(3)):
        assert a.samples == b.samples and a.replayed == b.replayed
        assert max(len(mb) for mb in b.micro_batches) == 3


@pytest.mark.parametrize("grouped", [False, True])
def test_a_restored_position_plans_the_steps_of_the_uninterrupted_run(grouped):
    whole, first = mixed(grouped), mixed(grouped)
    steps = []
    for _ in range(3):  # three epochs: replay manifests cycle across the target's epochs
        for plan in whole.plan_epoch(16):
            steps.append(plan.samples)
            whole.advance(plan)
    resumed = []
    for plan in first.plan_epoch(16)[:2]:
        resumed.append(plan.samples)
        first.advance(plan)
    state = first.state_dict()
    assert state["replayed"] == {"1": 8, "2": 4}
    again = mixed(grouped)
    again.load_state_dict(state)
    while len(resumed) < len(steps):
        for plan in again.plan_epoch(16):
            resumed.append(plan.samples)
            again.advance(plan)
    assert resumed == steps and again.state_dict() == whole.state_dict()


def test_train_samples_take_a_subset_of_the_target_manifests():
    data = mixed(train_samples=20)
    plans = list(data.plan_epoch(16))
    targets = [i for p in plans for i in p.samples if manifest_of(data, i) == "new.jsonl"]
    assert len(plans) == 2 and len(targets) == 20 == len(set(targets))


def test_shares_that_cannot_be_met_are_refused_with_the_numbers():
    samples = table({"new.jsonl": (40, "new"), "zh.jsonl": (3, "zh")})
    with pytest.raises(UserError) as small:
        build_mixing(["new.jsonl::new", "zh.jsonl::zh@0.25"], samples, 16, ["zh"], 48)
    assert "its share is 4 samples of each step of 16, but the manifest holds 3" in str(small.value)
    with pytest.raises(UserError) as zero:
        build_mixing(["new.jsonl::new", "zh.jsonl::zh@0.01"], samples, 16, ["zh"], 48)
    assert "rounds to 0 per step" in str(zero.value)
    with pytest.raises(UserError) as unmeasured:
        build_mixing(["new.jsonl::new", "zh.jsonl::zh@0.1"], samples, 16, ["new", ""], 48)
    assert "replays language zh, which the validation does not measure" in str(unmeasured.value)
    assert "among the 48 samples validated: new, (none)" in str(unmeasured.value)
