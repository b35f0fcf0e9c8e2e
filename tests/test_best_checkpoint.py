"""best.pth: the checkpoint of the best validation, kept through rotation and resumes; --resume best; branches."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.demo_runs import final_state, train_here
from trainers.checkpoint import schema
from trainers.run.lock import LOCK_NAME

FLAGS = ["--batch-size", "16", "--val-interval", "3", "--max-val-batches", "1", "--save-interval", "3",
         "--keep-checkpoints", "1", "--log-interval", "100", "--lr-decay-steps", "12"]
# On the demo, this learning rate improves the validation at step 3, then overshoots: best.pth is step 3.
OVERSHOOTING = ["--learning-rate", "0.1"]


def validations(run: Path, metric: str = "mel_loss") -> dict[int, float]:
    return {h["step"]: h[metric] for h in final_state(run).history if h["kind"] == "val"}


@pytest.fixture(scope="module")
def run9(demo_assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("best") / "run"
    done = train_here(out, *demo_assets, *FLAGS, *OVERSHOOTING, "--max-steps", "9")
    assert done.returncode == 0, done.stderr
    return out


def test_best_pth_holds_the_lowest_validation_and_survives_rotation(run9):
    vals = validations(run9)
    assert sorted(vals) == [0, 3, 6, 9] and min(vals, key=vals.get) == 3
    best = schema.read(run9 / "best.pth")
    assert best.step == 3 and best.best == {"metric": "mel_loss", "value": vals[3], "step": 3}
    assert final_state(run9).best == best.best  # the newest checkpoint knows the best too
    assert sorted(p.name for p in run9.glob("model_step*.pth")) == ["model_step9.pth"]  # step 3 was rotated away


def test_a_resume_compares_with_the_saved_best_not_with_infinity(run9, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run9, out)
    before = (out / "best.pth").read_bytes()
    more = train_here(out, "--resume", "auto", "--max-steps", "12")
    assert more.returncode == 0, more.stderr
    vals = validations(out)
    assert vals[12] > vals[3]  # worse than the best, though the first validation of this invocation
    assert (out / "best.pth").read_bytes() == before and "saved best.pth" not in more.stderr


def test_resume_best_is_refused_where_newer_steps_exist_and_branches_elsewhere(run9, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in run9.iterdir() if p.name != LOCK_NAME}  # a refusal locks first
    refused = train_here(run9, "--resume", "best")
    assert refused.returncode == 2
    assert "best.pth is step 3 but" in refused.stderr and "--output-dir NEW_DIR" in refused.stderr
    branch = tmp_path / "branch"
    started = train_here(branch, "--resume", str(run9 / "best.pth"), "--max-steps", "5")
    assert started.returncode == 0, started.stderr
    best = schema.read(run9 / "best.pth")
    assert f"starting a branch of run {best.run_id} at step 3" in started.stderr
    ours = final_state(branch)
    assert ours.step == 5 and ours.run_id != best.run_id
    assert [h for h in ours.history if h["kind"] == "resume"][-1]["changes"][0].startswith("branched from run")
    assert {p.name: p.stat().st_mtime_ns for p in run9.iterdir() if p.name != LOCK_NAME} == before  # untouched


def test_resume_best_continues_where_best_is_the_newest_checkpoint(family_assets, tmp_path):
    """Each model family."""
    out = tmp_path / "run"
    assert train_here(out, *family_assets, *FLAGS, *OVERSHOOTING, "--max-steps", "3").returncode == 0
    assert schema.read(out / "best.pth").step == 3 == final_state(out).step
    resumed = train_here(out, "--resume", "best", "--max-steps", "4")
    assert resumed.returncode == 0, resumed.stderr
    assert "best.pth (step 3," in resumed.stderr and final_state(out).step == 4


@pytest.mark.parametrize("metric, flags", [("mel_top1", []), ("ema/mel_top1", ["--ema-decay", "0.5"])])
def test_higher_is_better_for_top1(demo_assets, tmp_path, metric, flags):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, *flags, "--max-steps", "6", "--best-metric", metric).returncode == 0
    vals = validations(out, metric)
    assert len(set(vals.values())) > 1  # or any step would do
    best = schema.read(out / "best.pth")
    assert best.best == {"metric": metric, "value": max(vals.values()), "step": max(vals, key=vals.get)}
