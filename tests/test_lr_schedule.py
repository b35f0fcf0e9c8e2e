from trainers.training.lr_schedule import WarmupCosine


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
