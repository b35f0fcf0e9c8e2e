import pytest

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


def test_the_schedule_ends_after_the_peak_when_the_warmup_is_not_shorter_than_the_horizon():
    s = LRSchedule(WarmupCosine(base_lr=2e-5, warmup_steps=500, decay_steps=30))
    assert s.lr_at(30) == pytest.approx(2e-5 * 31 / 500) and s.lr_at(499) == s.lr_at(500) == 2e-5
    assert s.end_step == 501 and s.lr_at(501) == 0.0
