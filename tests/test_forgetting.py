"""The forgetting measure and guard on figures alone (trainers/training/forgetting.py); the runs that use them are
in tests/test_forgetting_runs.py."""
from __future__ import annotations

import math

import pytest

from trainers.training.forgetting import Forgetting, Guard, language_figures, worse_by

GUARD = Guard(limit=0.1, metric="mel_loss", languages=("zh",), stop=True)


def figures(zh_mel: float, am_mel: float = 3.0, top1: float = 0.5) -> dict[str, dict[str, float]]:
    return {"zh": {"text_loss": 2.0, "mel_loss": zh_mel, "mel_top1": top1},
            "am": {"text_loss": 2.5, "mel_loss": am_mel, "mel_top1": 0.1}}


def test_per_language_figures_take_their_generation_metrics_and_leave_the_counts_out():
    means = {"zh": {"mel_loss": 2.0}, "": {"mel_loss": 3.0}}
    got = language_figures(means, {"gen/stop_rate": 0.5, "gen/zh/stop_rate": 1.0, "gen/unknown/stop_rate": 0.0,
                                   "gen/zh/samples": 2.0, "gen/samples": 4.0})
    assert got == {"zh": {"mel_loss": 2.0, "gen/stop_rate": 1.0}, "unknown": {"mel_loss": 3.0, "gen/stop_rate": 0.0}}
    one = language_figures({"zh": {"mel_loss": 2.0}}, {"gen/stop_rate": 0.5, "gen/samples": 4.0})
    assert one == {"zh": {"mel_loss": 2.0, "gen/stop_rate": 0.5}}


def test_worse_is_higher_for_losses_and_lower_for_accuracy():
    assert worse_by("mel_loss", 2.0, 2.2) == pytest.approx(0.1)
    assert worse_by("mel_top1", 0.5, 0.4) == pytest.approx(0.2) == worse_by("ema/mel_top1", 0.5, 0.4)
    assert worse_by("ema/mel_loss", 2.0, 2.2) == pytest.approx(0.1)
    assert worse_by("gen/stop_rate", 1.0, 1.0) == 0.0
    assert worse_by("gen/repeated_ngram_share", 0.0, 0.1) == math.inf


def test_the_base_is_the_first_validation_of_each_language_and_changes_are_measured_from_it():
    state = Forgetting()
    first = state.measure(0, figures(2.0), GUARD)
    assert first.first == ["zh", "am"] and first.changes["zh"]["mel_loss"] == 0.0 and first.within is True
    later = state.measure(10, {**figures(2.1, 2.5), "ja": {"mel_loss": 4.0}}, GUARD)
    assert later.first == ["ja"] and later.changes["ja"] == {"base_step": 10, "mel_loss": 0.0, "mel_loss_rel": 0.0}
    assert later.changes["zh"]["mel_loss"] == pytest.approx(0.1)
    assert later.changes["zh"]["mel_loss_rel"] == pytest.approx(0.05)
    assert later.changes["am"]["mel_loss_rel"] == pytest.approx(-1 / 6)
    assert later.scalars()["val/zh/mel_loss_change_rel"] == pytest.approx(0.05)
    lines = later.lines()
    assert lines[0].startswith("forgetting step 10: base figures of ja recorded") and len(lines) == 3
    assert lines[2].startswith("forgetting step 10 zh [base] vs step 0: text_loss +0.0% mel_loss +5.0%")


def test_a_validation_past_the_limit_is_a_warning_not_within_and_stops_with_the_stop_flag():
    state = Forgetting()
    state.measure(0, figures(2.0), GUARD)
    state.measure(5, figures(2.1), GUARD)
    assert state.within_step == 5
    past = state.measure(10, figures(2.3, 1.0), GUARD)  # zh 15% worse; am much better but not a base language
    assert past.within is False and state.within_step == 5 and state.stops(GUARD)
    breach, verdict, advice = past.warnings()
    assert breach == "forgetting at step 10: zh mel_loss 2.3000, +15.0% worse than 2.0000 at step 0"
    assert verdict == "step 10 is past --forgetting-limit 0.1 (10.0%) on mel_loss: best.pth is not taken from it"
    assert "--train-manifest F::LANG@SHARE" in advice
    assert not state.stops(Guard(0.1, "mel_loss", ("zh",), stop=False))
    assert not state.stops(Guard(0.2, "mel_loss", ("zh",), stop=True))  # a larger limit: within again
    assert past.fields()["forgetting_guard"] == {"metric": "mel_loss", "limit": 0.1, "languages": ["zh"],
                                                 "within": False, "past": ["zh"]}


def test_a_validation_the_guard_cannot_judge_is_not_within():
    state = Forgetting()
    gen = Guard(0.1, "gen/stop_rate", ("zh",), stop=True)
    state.measure(0, {"zh": {"mel_loss": 2.0, "gen/stop_rate": 1.0}}, gen)
    unjudged = state.measure(3, {"zh": {"mel_loss": 2.0}}, gen)  # no generation at this validation
    assert unjudged.breaches is None and unjudged.within is False and not state.stops(gen)
    assert Forgetting().measure(0, figures(2.0), Guard()).within is None  # no guard


def test_the_state_round_trips_and_a_restored_state_gives_the_same_verdict():
    state = Forgetting()
    state.measure(0, figures(2.0), GUARD)
    state.measure(10, figures(2.3), GUARD)
    again = Forgetting()
    again.load_state_dict(state.state_dict())
    assert again == state and again.breaches(GUARD) == state.breaches(GUARD)
    assert again.measure(20, figures(2.1), GUARD).changes == state.measure(20, figures(2.1), GUARD).changes
