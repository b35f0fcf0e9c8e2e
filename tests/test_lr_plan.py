"""Extending a run never trains at a learning rate of 0 without being asked to, and never jumps silently."""
from __future__ import annotations

import pytest
import torch

from tests.demo_runs import final_state, train_here

FLAGS = ["--batch-size", "16", "--val-interval", "0", "--max-val-batches", "1", "--log-interval", "1",
         "--keep-checkpoints", "1", "--save-interval", "100"]


def lrs(run) -> dict[int, float]:
    return {h["step"]: h["lr"] for h in final_state(run).history if h["kind"] == "train"}


@pytest.fixture()
def finished_at_lr_0(demo_assets, tmp_path):
    """The reviewer's reproduction: a run that reached the end of its cosine with a floor of 0."""
    out = tmp_path / "run"
    done = train_here(out, *demo_assets, *FLAGS, "--min-lr-ratio", "0", "--warmup-steps", "2", "--max-steps", "8")
    assert done.returncode == 0, done.stderr
    return out


def test_extending_past_a_zero_floor_is_refused_with_the_choices(finished_at_lr_0):
    before = (finished_at_lr_0 / "latest.pth").read_bytes()
    refused = train_here(finished_at_lr_0, "--resume", "auto", "--max-steps", "16")
    assert refused.returncode == 2
    for choice in ("--reconfigure-scheduler", "--min-lr-ratio R --allow-config-change",
                   "--lr-decay-steps 16 --allow-config-change"):
        assert choice in refused.stderr
    assert (finished_at_lr_0 / "latest.pth").read_bytes() == before


def test_reconfigure_scheduler_continues_from_the_last_rate_and_trains(finished_at_lr_0):
    at_8 = final_state(finished_at_lr_0)
    extended = train_here(finished_at_lr_0, "--resume", "auto", "--max-steps", "16", "--reconfigure-scheduler")
    assert extended.returncode == 0, extended.stderr
    rates = lrs(finished_at_lr_0)
    assert rates[9] == rates[8] > 0  # step 9's rate is step 8's: no jump
    assert all(rates[i] > rates[i + 1] for i in range(9, 16)) and rates[16] >= 0
    at_16 = final_state(finished_at_lr_0)
    assert at_16.step == 16 and not torch.equal(at_16.model["mel_head.weight"], at_8.model["mel_head.weight"])
    # The continuation is part of the saved schedule: a later resume keeps it without the flag.
    assert at_16.lr_schedule["continuations"][0]["start_step"] == 8
    # The start-up summary states the schedule in force, not the old horizon.
    assert ("training to step 16; learning rate: warmup 2 steps to 0.003, cosine to 0 at step 8; from step 8 a "
            "cosine from the last rate 0.000201 to 0 at step 16 (--reconfigure-scheduler)") in extended.stderr


def test_a_changed_horizon_says_how_far_the_rate_jumps(finished_at_lr_0):
    changed = train_here(finished_at_lr_0, "--resume", "auto", "--max-steps", "12", "--lr-decay-steps", "16",
                         "--allow-config-change")
    assert changed.returncode == 0, changed.stderr
    assert "the learning-rate schedule differs from the saved one" in changed.stderr
    assert "the learning rate of the next step is" in changed.stderr and "instead of 0 (xinf)" in changed.stderr


def test_the_saved_horizon_is_kept_on_resume_and_the_floor_holds_past_it(demo_assets, tmp_path):
    out = tmp_path / "run"
    first = train_here(out, *demo_assets, *FLAGS, "--min-lr-ratio", "0.1", "--warmup-steps", "2", "--max-steps", "6")
    assert first.returncode == 0, first.stderr
    more = train_here(out, "--resume", "auto", "--max-steps", "10")
    assert more.returncode == 0, more.stderr
    assert "training past the end of the learning-rate schedule (step 6)" in more.stderr
    state = final_state(out)
    assert state.settings["lr_decay_steps"] == 6 and state.lr_schedule["decay_steps"] == 6
    rates = lrs(out)  # by the 1-based step that used the rate: step 7 is the first past the horizon
    assert rates[6] > rates[7] and rates[7] == rates[8] == rates[10] == pytest.approx(3e-3 * 0.1)


def test_a_warmup_longer_than_the_horizon_is_no_end_of_the_schedule(demo_assets, tmp_path):
    """Issue 19.7: with --warmup-steps 10 and a horizon of 4, the rate is still rising at step 4; extending
    it was refused as if it stood at 0, offering a "jump" between two equal rates."""
    out = tmp_path / "run"
    first = train_here(out, *demo_assets, *FLAGS, "--min-lr-ratio", "0", "--warmup-steps", "10", "--max-steps", "4")
    assert first.returncode == 0, first.stderr
    more = train_here(out, "--resume", "auto", "--max-steps", "8")
    assert more.returncode == 0, more.stderr
    rates = lrs(out)
    assert [rates[i] for i in range(1, 9)] == pytest.approx([3e-3 * i / 10 for i in range(1, 9)])
    assert "then 0 from step 11 (the warmup is not shorter than the horizon 4)" in more.stderr
    refused = train_here(out, "--resume", "auto", "--max-steps", "16")  # past the peak of step 10: 0 from step 11
    assert refused.returncode == 2 and "its learning-rate schedule ends at step 11" in refused.stderr
    assert "(no jump: the next step's rate stays 0.0027)" in refused.stderr
