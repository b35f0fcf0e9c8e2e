"""A branch (`--resume PATH --output-dir NEW`) killed before its first save: its directory holds no checkpoint, only
run_config.json, which names the checkpoint it branched from. `--resume auto` alone (what cloud scripts pass) and
the branch command typed again both continue the branch, bit-identically and under its own run id; a branched-from
file that is gone or changed is refused by name (exit 2), never a silent start from the base model."""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.demo_runs import assert_same_training, final_state, train, train_here

ORIGIN = ["--max-steps", "6", "--save-interval", "3", "--val-interval", "3", "--batch-size", "8",
          "--max-val-batches", "1", "--log-interval", "2"]
BRANCH = ["--max-steps", "10", "--log-sample-ids"]  # saves at step 9 first


@pytest.fixture(scope="module")
def origin(demo_assets: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("origin") / "run"
    result = train_here(out, *demo_assets, *ORIGIN)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def reference(origin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted branch."""
    out = tmp_path_factory.mktemp("reference") / "branch"
    result = train_here(out, "--resume", str(origin / "model_step6.pth"), *BRANCH)
    assert result.returncode == 0, result.stderr
    return out


def _killed_branch(origin: Path, out: Path, kill_at: str) -> str:
    """The branch, killed before its first save; the run id its run_config.json holds."""
    killed = train(out, "--resume", str(origin / "model_step6.pth"), *BRANCH, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not list(out.glob("model_step*.pth")) and not (out / "latest.pth").exists()  # (best.pth may be there)
    return json.loads((out / "run_config.json").read_text())["run_id"]


@pytest.mark.parametrize("kill_at", ["setup", "micro:8:0", "save:9:tmp_written"])
def test_a_branch_killed_before_its_first_save_is_continued_by_resume_auto_alone(origin, reference, tmp_path,
                                                                                   kill_at):
    out = tmp_path / "branch"
    run_id = _killed_branch(origin, out, kill_at)
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "has no checkpoint yet; continuing its branch from" in resumed.stderr
    assert "INFO (branched from run" in resumed.stderr
    assert "max_steps 6 -> 10" in resumed.stderr  # the branch's plan, not the checkpoint's
    assert "starting from step 0" not in resumed.stderr
    assert_same_training(reference, out, 10, from_step=6)
    assert final_state(out).run_id == run_id != final_state(origin).run_id  # the branch's own identity, kept


def test_the_branch_command_typed_again_continues_the_branch(origin, reference, tmp_path):
    out = tmp_path / "branch"
    run_id = _killed_branch(origin, out, "micro:8:0")
    again = train_here(out, "--resume", str(origin / "model_step6.pth"), *BRANCH)
    assert again.returncode == 0, again.stderr
    assert f"continuing the branch {run_id} in {out}" in again.stderr
    assert f"(a branch of run {final_state(origin).run_id} at step 6" in again.stderr
    assert_same_training(reference, out, 10, from_step=6)
    assert final_state(out).run_id == run_id
    other = train_here(tmp_path / "other", "--resume", str(origin / "model_step3.pth"), "--max-steps", "4")
    assert other.returncode == 0, other.stderr
    refused = train_here(tmp_path / "other", "--resume", str(origin / "model_step6.pth"), *BRANCH)
    assert refused.returncode == 2 and "already holds another run" in refused.stderr  # a branch that saved


def test_a_branched_from_checkpoint_that_is_gone_or_changed_is_refused_by_name(origin, reference, tmp_path):
    moving = tmp_path / "origin"
    shutil.copytree(origin, moving)  # latest.pth: a copy here, no longer a link of model_step6.pth
    out = tmp_path / "branch"
    killed = train(out, "--resume", str(moving / "latest.pth"), *BRANCH, kill_at="micro:8:0")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    written = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    os.rename(moving / "latest.pth", tmp_path / "aside.pth")
    os.rename(moving / "model_step6.pth", tmp_path / "aside6.pth")
    gone = train_here(out, "--resume", "auto")
    assert gone.returncode == 2, gone.stderr
    assert f"it continues {moving / 'latest.pth'}, which is gone" in gone.stderr
    assert "Put that checkpoint back and run --resume auto again" in gone.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == written  # nothing written
    shutil.copy(moving / "model_step3.pth", moving / "latest.pth")  # latest.pth now names another checkpoint
    changed = train_here(out, "--resume", "auto")
    assert changed.returncode == 2, changed.stderr
    assert f"{moving / 'latest.pth'}, which now holds another checkpoint (step 3 of run" in changed.stderr
    os.rename(tmp_path / "aside6.pth", moving / "model_step6.pth")  # the same checkpoint, under its step name
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"INFO (branched from run {final_state(origin).run_id} at step 6" in resumed.stderr
    assert_same_training(reference, out, 10, from_step=6)
