"""Extending a run never trains at a learning rate of 0 without being asked to, never jumps silently,
never trains on at the floor without a warning, and resumes exactly in the middle of a re-warm."""
from __future__ import annotations

import re
import shutil

import pytest
import torch

from tests.demo_runs import final_state, train_here

PREFIX = r"\S+ \S+ INFO "  # a log line's time and level
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
    choices = ("--rewarm:", "--reconfigure-scheduler:", "--lr-decay-steps 16 --allow-config-change:",
               "--min-lr-ratio R --allow-config-change:")
    where = [refused.stderr.find(choice) for choice in choices]
    assert -1 not in where and where == sorted(where), refused.stderr  # the re-warm is offered first
    # What each choice does to the rate, with this run's figures (peak 3e-3, floor 0, new end 16).
    assert "rises from its current 0.000201 back to the peak 0.003 over 2 steps" in refused.stderr
    assert "the rate never rises above 0.000201" in refused.stderr
    assert "the next step's rate jumps from 0 to " in refused.stderr
    assert (finished_at_lr_0 / "latest.pth").read_bytes() == before


def test_rewarm_rises_back_to_the_peak_then_decays_to_the_new_end(finished_at_lr_0):
    at_8 = final_state(finished_at_lr_0)
    extended = train_here(finished_at_lr_0, "--resume", "auto", "--max-steps", "16", "--rewarm")
    assert extended.returncode == 0, extended.stderr
    rates = lrs(finished_at_lr_0)
    # Default rise: the run's 2 warmup steps; the last of them at the peak, the run's --learning-rate.
    assert rates[8] < rates[9] < rates[10] == 3e-3 and rates[9] == pytest.approx((rates[8] + 3e-3) / 2)
    assert all(rates[i] > rates[i + 1] for i in range(11, 16)) and rates[11] == 3e-3 and 0 < rates[16] < 3e-4
    at_16 = final_state(finished_at_lr_0)
    assert not torch.equal(at_16.model["mel_head.weight"], at_8.model["mel_head.weight"])
    assert at_16.lr_schedule["continuations"] == [{"kind": "rewarm", "start_step": 8, "end_step": 16,
                                                   "start_lr": rates[8], "peak_lr": 3e-3, "warmup_steps": 2,
                                                   "floor": 0.0}]
    # The start-up summary states the schedule in force, not the old horizon, in lines of at most 120 characters
    # (they were one of 208 characters), once: it came twice, around the finished cosine's line.
    assert re.search(rf"training to step 16\n{PREFIX}learning rate: from step 8 a re-warm from 0\.000201 to 0\.003 over "
                     rf"2 steps \(--rewarm\)\n{PREFIX}learning rate: then a cosine to 0 at step 16\n", extended.stderr), \
        extended.stderr
    assert extended.stderr.count("a re-warm from") == 1 and "cosine to 0 at step 8" not in extended.stderr
    assert re.search(r"learning rate: the first step after the resume trains at 0\.0016", extended.stderr)


def test_a_resume_in_the_middle_of_a_rewarm_is_bit_identical(finished_at_lr_0, tmp_path):
    extend = ["--resume", "auto", "--max-steps", "16", "--rewarm-steps", "4", "--rewarm-lr", "2e-3"]
    whole, stopped = (shutil.copytree(finished_at_lr_0, tmp_path / name) for name in ("whole", "stopped"))
    assert train_here(whole, *extend).returncode == 0
    cut = train_here(stopped, *extend, kill_at="SIGTERM@micro:10:0")  # steps 9-12 are the rise
    assert cut.returncode == 143 and final_state(stopped).step == 10, cut.stderr
    again = shutil.copytree(stopped, tmp_path / "again")
    alone = train_here(stopped, "--resume", "auto")  # the saved schedule holds the re-warm
    same = train_here(again, *extend)  # the interrupted command once more: the saved re-warm goes on
    assert alone.returncode == same.returncode == 0, (alone.stderr, same.stderr)
    assert "already holds this --rewarm continuation" in same.stderr
    reference = final_state(whole)
    for run in (stopped, again):
        state = final_state(run)
        assert state.step == 16 and state.lr_schedule == reference.lr_schedule
        for key in reference.model:
            assert torch.equal(state.model[key], reference.model[key]), (run.name, key)
        for a, b in zip(reference.optimizer["state"].values(), state.optimizer["state"].values()):
            assert all(torch.equal(a[k], b[k]) for k in a), run.name
    assert lrs(stopped) == lrs(whole)


def test_rewarm_flags_are_checked_before_anything_changes(finished_at_lr_0):
    before = (finished_at_lr_0 / "latest.pth").read_bytes()
    too_long = train_here(finished_at_lr_0, "--resume", "auto", "--max-steps", "16", "--rewarm-steps", "8")
    assert too_long.returncode == 2 and "--rewarm-steps 8: this invocation trains 8 steps" in too_long.stderr
    for bad, message in ((["--rewarm-lr", "-1e-3"], "argument --rewarm-lr: must be a finite number > 0 and <= 1"),
                         (["--rewarm", "--reconfigure-scheduler"], "pass one of them")):
        with pytest.raises(SystemExit) as stopped:
            train_here(finished_at_lr_0, "--resume", "auto", "--max-steps", "16", *bad)
        assert stopped.value.code == 2
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
    assert re.search(rf"training to step 16\n{PREFIX}learning rate: from step 8 a cosine from the last rate 0\.000201 "
                     r"\(--reconfigure-scheduler\)\n"
                     rf"{PREFIX}learning rate: the cosine reaches 0 at step 16\n", extended.stderr), extended.stderr
    assert extended.stderr.count("a cosine from") == 1 and "cosine to 0 at step 8" not in extended.stderr


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
    # Said as a warning, with the choices that would train those steps at a higher rate.
    assert "WARNING training past the end of the learning-rate schedule, step 6:" in more.stderr
    assert "WARNING steps 7 to 10 train at its floor 0.0003 (--min-lr-ratio 0.1)" in more.stderr
    assert "--rewarm: the rate rises from its current" in more.stderr
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
    assert "learning rate: warmup 10 steps to 0.003, then 0 from step 11\n" in more.stderr
    refused = train_here(out, "--resume", "auto", "--max-steps", "16")  # past the peak of step 10: 0 from step 11
    assert refused.returncode == 2 and "its learning-rate schedule ends at step 11" in refused.stderr
    assert "(no jump: the next step's rate stays 0.0027)" in refused.stderr
