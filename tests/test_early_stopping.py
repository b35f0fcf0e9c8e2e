"""--early-stop-patience: where a run stops, that a kill and resume stops at the same step bit-identically,
and that a resume respects the stop or extends it."""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.demo_runs import assert_equal_nested, family_run, final_state, train, train_here
from tests.test_best_checkpoint import FLAGS, OVERSHOOTING, validations
from trainers.checkpoint import schema

# On the demo the overshooting rate gives the best validation at step 3 and worse ones at 6 and 9, so a
# patience of 2 ends the run at step 9 of the 15 planned.
PLAN = [*FLAGS, *OVERSHOOTING, "--max-steps", "15", "--early-stop-patience", "2"]


@pytest.fixture(scope="module")
def stopped(demo_assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("early") / "run"
    done = train_here(out, *demo_assets, *PLAN)
    assert done.returncode == 0, done.stderr
    (out.parent / "stderr.txt").write_text(done.stderr)
    return out


def test_the_run_stops_after_patience_validations_without_a_new_best(stopped):
    vals = validations(stopped)
    assert sorted(vals) == [0, 3, 6, 9] and vals[6] > vals[3] and vals[9] > vals[3]
    state = final_state(stopped)
    assert state.step == 9 and schema.read(stopped / "best.pth").step == 3
    assert state.sections["progress"]["stale_validations"] == 2
    log = (stopped.parent / "stderr.txt").read_text()
    assert "early stop at step 9: 2 validations without a better mel_loss (--early-stop-patience 2)" in log
    assert "best.pth holds step 3, the best mel_loss: " in log


@pytest.fixture(scope="module")
def family_stopped(family_assets, request, tmp_path_factory) -> Path:
    """`stopped`, for each model family's demo (2.5's stops at the same step: best at 3, worse at 6 and 9)."""
    return family_run(family_assets, request, "stopped", tmp_path_factory, *PLAN)


def test_a_kill_at_the_stopping_validation_resumes_to_the_same_stop_bit_identically(family_stopped, family_assets,
                                                                                   tmp_path):
    """Each model family. The resume gets a SIGTERM as that validation begins: it stops there all the same, saved,
    with status 143 as a signal in any other phase (it was 0)."""
    stopped, demo_assets = family_stopped, family_assets
    out = tmp_path / "run"
    killed = train(out, *demo_assets, *PLAN, kill_at="validation:9")
    assert killed.returncode != 0 and final_state(out).step == 6  # the last save before the kill
    resumed = train(out, "--resume", "auto", kill_at="SIGTERM@validation:9")
    assert resumed.returncode == 143, resumed.stderr
    assert "early stop at step 9" in resumed.stderr
    ours, theirs = final_state(out), final_state(stopped)
    assert ours.step == theirs.step == 9
    assert_equal_nested(ours.model, theirs.model, "model")
    assert (out / "best.pth").exists() and schema.read(out / "best.pth").step == 3


def test_a_kill_between_the_stopping_saves_rename_and_link_is_repaired_by_the_resume(stopped, demo_assets, tmp_path):
    out = tmp_path / "run"
    killed = train(out, *demo_assets, *PLAN, kill_at="save:9:renamed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert final_state(out).step == 6  # model_step9.pth is complete, latest.pth still names the save before it
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "nothing to do: the run stopped early at step 9" in resumed.stderr
    assert "latest.pth named model_step6.pth, behind model_step9.pth" in resumed.stderr
    assert os.path.samefile(out / "latest.pth", out / "model_step9.pth")
    assert_equal_nested(final_state(out).model, final_state(stopped).model, "model")


def test_a_resume_respects_the_stop_and_a_larger_patience_extends_it(stopped, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    before = (out / "latest.pth").read_bytes()
    again = train_here(out, "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "nothing to do: the run stopped early at step 9" in again.stderr
    assert (out / "latest.pth").read_bytes() == before
    longer = train_here(out, "--resume", "auto", "--early-stop-patience", "3")
    assert longer.returncode == 0, longer.stderr
    assert final_state(out).step == 12  # one more validation without a new best


def test_a_larger_patience_killed_before_its_first_save_is_continued_by_resume_auto_alone(stopped, tmp_path):
    reference = tmp_path / "reference"
    shutil.copytree(stopped, reference)
    assert train_here(reference, "--resume", "auto", "--early-stop-patience", "3").returncode == 0
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    killed = train(out, "--resume", "auto", "--early-stop-patience", "3", kill_at="micro:11:0")
    assert killed.returncode == -signal.SIGKILL and final_state(out).step == 9
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "early_stop_patience 2 -> 3" in resumed.stderr and "nothing to do" not in resumed.stderr
    ours, theirs = final_state(out), final_state(reference)
    assert ours.step == theirs.step == 12
    assert_equal_nested(ours.model, theirs.model, "model")


def test_a_resume_with_another_best_metric_counts_from_zero(stopped, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    other = train_here(out, "--resume", "auto", "--best-metric", "mel_top1")
    assert other.returncode == 0, other.stderr
    assert "early stopping counts its validations from 0" in other.stderr
    assert final_state(out).step > 9
