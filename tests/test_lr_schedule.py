import math

import pytest

from trainers.errors import UserError
from trainers.training.lr_schedule import LRSchedule, WarmupCosine


def test_warmup_then_cosine_to_the_floor():
    s = WarmupCosine(base_lr=1e-3, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1)
    assert s.lr_at(0) == 1e-4 and s.lr_at(9) == 1e-3
    assert abs(s.lr_at(60) - (1e-4 + 0.9e-3 * 0.5)) < 1e-12  # half-way through the cosine
    values = [s.lr_at(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert abs(s.lr_at(110) - 1e-4) < 1e-15


def test_extending_past_the_horizon_never_jumps():
    s = WarmupCosine(base_lr=1e-3, warmup_steps=0, decay_steps=100, min_lr_ratio=0.05)
    assert s.lr_at(100) == s.lr_at(150) == s.lr_at(10_000) == 1e-3 * 0.05


def test_a_continuation_starts_at_the_last_rate_and_ends_at_the_floor():
    s = LRSchedule(WarmupCosine(base_lr=1e-3, warmup_steps=2, decay_steps=8, min_lr_ratio=0.0))
    longer = s.continued(step=6, end_step=16)
    assert [longer.lr_at(i) for i in range(6)] == [s.lr_at(i) for i in range(6)]  # the past is unchanged
    assert longer.lr_at(6) == s.lr_at(5) > 0  # no jump: step 6 uses step 5's rate
    values = [longer.lr_at(i) for i in range(6, 17)]
    assert all(a > b for a, b in zip(values, values[1:])) and longer.lr_at(16) == 0.0 == longer.lr_at(30)
    assert (s.end_step, longer.end_step) == (8, 16)
    assert LRSchedule.from_state_dict(longer.state_dict()) == longer


def test_a_rewarm_rises_from_the_last_rate_to_the_peak_then_decays_to_the_new_end():
    s = LRSchedule(WarmupCosine(base_lr=1e-3, warmup_steps=2, decay_steps=8, min_lr_ratio=0.1))
    longer = s.rewarmed(step=8, end_step=20, peak_lr=2e-3, warmup_steps=4)
    assert [longer.lr_at(i) for i in range(8)] == [s.lr_at(i) for i in range(8)]  # the past is unchanged
    last = s.lr_at(7)
    rising = [last + (2e-3 - last) * k / 4 for k in (1, 2, 3, 4)]
    assert [longer.lr_at(i) for i in range(8, 12)] == pytest.approx(rising)
    assert longer.lr_at(11) == longer.lr_at(12) == 2e-3  # the last rising step and the first decaying one: the peak
    values = [longer.lr_at(i) for i in range(12, 21)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert longer.lr_at(20) == pytest.approx(1e-4) == longer.lr_at(50)
    assert (s.end_step, longer.end_step) == (8, 20)
    assert LRSchedule.from_state_dict(longer.state_dict()) == longer


def old_continuation_rates(start_step: int, end_step: int, start_lr: float, floor: float,
                           steps: range) -> list[float]:
    """The rates of --reconfigure-scheduler's continuation as the version before re-warms computed them
    (trainers/training/lr_schedule.py of commit f4580aa: Continuation.lr_at)."""
    def cosine(progress: float) -> float:
        return floor + (start_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return [cosine((step - start_step) / max(1, end_step - start_step)) for step in steps]


def test_a_continuation_saved_before_rewarms_existed_loads_with_its_old_rates():
    """The saved form of --reconfigure-scheduler's continuation (no "kind") and the rates the trainer
    gave it before re-warms existed (computed with that version: commit f4580aa)."""
    saved = {"kind": "warmup_cosine", "base_lr": 0.003, "warmup_steps": 2, "decay_steps": 8, "min_lr_ratio": 0.0,
             "continuations": [{"start_step": 4, "end_step": 12, "start_lr": 0.002799038105676658, "floor": 0.0}]}
    old_rates = [0.002799038105676658, 0.0026925060611152434, 0.0023891284655000854, 0.0019350918076388405,
                 0.001399519052838329, 0.0008639462980378179, 0.0004099096401765726, 0.00010653204456141481, 0.0]
    schedule = LRSchedule.from_state_dict(saved)
    rates = [schedule.lr_at(i) for i in range(4, 13)]
    # Exactly the old formula, evaluated here; the figures that version printed only within rounding (they
    # come from another machine's libm).
    assert rates == old_continuation_rates(**saved["continuations"][0], steps=range(4, 13))
    assert rates == pytest.approx(old_rates, rel=1e-12, abs=0.0)
    assert schedule.state_dict() == saved  # written back in the same form, readable by older versions


def test_the_schedule_ends_after_the_peak_when_the_warmup_is_not_shorter_than_the_horizon():
    s = LRSchedule(WarmupCosine(base_lr=2e-5, warmup_steps=500, decay_steps=30))
    assert s.lr_at(30) == pytest.approx(2e-5 * 31 / 500) and s.lr_at(499) == s.lr_at(500) == 2e-5
    assert s.end_step == 501 and s.lr_at(501) == 0.0


def test_a_continuation_of_an_unknown_kind_is_refused_by_name():
    saved = {"kind": "warmup_cosine", "base_lr": 1e-3, "warmup_steps": 0, "decay_steps": 8, "min_lr_ratio": 0.0,
             "continuations": [{"kind": "cyclic", "start_step": 8, "end_step": 16}]}
    with pytest.raises(UserError, match="continuation of kind 'cyclic'.*update the trainer"):
        LRSchedule.from_state_dict(saved)
