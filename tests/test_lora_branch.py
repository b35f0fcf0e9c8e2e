"""LoRA from a full run's checkpoint (a branch into a new directory), and out-of-memory halving with LoRA."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.demo_runs import assert_close_weights, assert_equal_nested, final_state, train, train_here
from tests import test_lora_runs
from tests.test_lora_runs import COMMON, STEPS
from trainers.checkpoint import schema
from trainers.config.flags import parse_command_line
from trainers.faults import Faults
from trainers.files import file_sha256
from trainers.main import train as train_run
from trainers.model.lora import is_adapter_key
from trainers.model.weights import read_state_dict
from trainers.run.lora_branch import BRANCH_BASE_NAME
from trainers.run.setup import setup_run
from trainers.stop_signals import StopRequest

FULL = ["--batch-size", "8", "--grad-accumulation", "2", "--max-steps", "4", "--save-interval", "2",
        "--val-interval", "0", "--max-val-batches", "1", "--log-interval", "2"]
BRANCH = ["--lora-rank", "4", "--lora-dropout", "0.1", "--max-steps", "6", "--save-interval", "2"]

lora_reference = test_lora_runs.lora_reference  # the uninterrupted LoRA run, a fixture shared with that module


def _snapshot(directory: Path, lock: bool = True) -> dict[str, bytes]:
    """Every file's bytes; `lock=False` leaves out the lock file, which a refused resume in the directory itself
    takes and releases (its start time changes; trainers/run/lock.py)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and (lock or p.name != ".trainer.lock")}


@pytest.fixture(scope="module")
def full_run(demo_assets: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    result = train_here(out, *demo_assets, *FULL)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def branch_reference(full_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("branch") / "run"
    before = _snapshot(full_run)
    result = train_here(out, "--resume", str(full_run / "latest.pth"), *BRANCH)
    assert result.returncode == 0, result.stderr
    assert f"starting a LoRA branch of run {final_state(full_run).run_id} at step 4" in result.stderr
    assert "the LoRA branch starts at step 0 with a fresh optimizer" in result.stderr
    assert _snapshot(full_run) == before  # the full run's directory, byte for byte
    return out


def test_a_lora_branch_of_a_full_checkpoint_names_its_base_in_its_own_directory(full_run, branch_reference):
    ckpt, full = final_state(branch_reference), final_state(full_run)
    base = branch_reference / BRANCH_BASE_NAME
    assert ckpt.format_version == schema.LORA_VERSION and ckpt.step == 6
    assert ckpt.lora["base"] == str(base) and ckpt.lora["base_sha256"] == file_sha256(base)
    assert ckpt.run_id != full.run_id
    assert all(is_adapter_key(k) for k in ckpt.model)
    written = read_state_dict(base)
    assert written.keys() == full.model.keys()
    assert all(torch.equal(written[k], full.model[k]) for k in written)


def test_the_branch_trains_and_its_base_stays_the_full_checkpoints_model(full_run, tmp_path):
    """The trainer's own run, in this process: after its steps every base tensor equals the full checkpoint's."""
    cmd = parse_command_line(["--output-dir", str(tmp_path / "run"), "--resume", str(full_run / "latest.pth"),
                              *BRANCH, "--max-steps", "3"])
    run = setup_run(cmd)
    try:
        assert train_run(run, StopRequest(), Faults.from_env()) == 0
    finally:
        run.close()
    full = final_state(full_run).model
    own = run.model.state_dict()
    base_keys = {k for k in own if not is_adapter_key(k)}
    assert base_keys <= set(full)
    assert all(torch.equal(own[k], full[k]) for k in base_keys)
    assert all(torch.equal(run.weights.carried[k], full[k]) for k in run.weights.carried)
    assert any(bool(v.abs().sum() > 0) for k, v in own.items() if k.endswith(".lora_b"))  # the adapters did train


@pytest.mark.parametrize("kill_at, again, resumes", [
    ("micro:3:1", False, "(step 2,"), ("micro:1:0", False, "(LoRA branch from run"), ("micro:1:0", True, "")],
    ids=["mid_accumulation", "before_the_first_checkpoint", "branch_command_again"])
def test_a_killed_branch_resumes_bit_identically(full_run, branch_reference, tmp_path, kill_at, again, resumes):
    """Killed before its first checkpoint, the branch's directory holds its settings and lora_base.pth:
    --resume auto starts it again from them, and so does the branch command typed again; either keeps the
    branch's run id."""
    out = tmp_path / "run"
    killed = train(out, "--resume", str(full_run / "latest.pth"), *BRANCH, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_id = json.loads((out / "run_config.json").read_text())["run_id"]
    resumed = train_here(out, *(["--resume", str(full_run / "latest.pth"), *BRANCH] if again else ["--resume", "auto"]))
    assert resumed.returncode == 0, resumed.stderr
    assert resumes in resumed.stderr
    a, b = final_state(branch_reference), final_state(out)
    assert a.step == b.step == 6 and b.run_id == run_id
    assert_equal_nested(a.model, b.model, "model")
    assert_equal_nested(a.optimizer, b.optimizer, "optimizer")
    assert [e for e in b.history if e["kind"] in ("start", "resume")][0]["changes"][0].startswith("LoRA branch from")


def test_the_refusals_that_remain_are_clear_and_change_nothing(full_run, branch_reference, tmp_path):
    before = _snapshot(full_run, lock=False)
    here = train_here(full_run, "--resume", "auto", "--lora-rank", "4", "--max-steps", "6")
    assert here.returncode == 2, here.stderr
    assert "a full fine-tuning checkpoint does not continue as LoRA in its own directory" in here.stderr
    assert f"--resume {full_run / 'latest.pth'} --output-dir NEW_DIR --lora-rank R" in here.stderr
    assert _snapshot(full_run, lock=False) == before
    # The branch's base is its own file and moves with the run directory (here a copy); changed, it is refused by
    # name; restored, the moved run resumes.
    out = tmp_path / "run"
    shutil.copytree(branch_reference, out)
    base = out / BRANCH_BASE_NAME
    original = base.read_bytes()
    state = read_state_dict(base)
    state["gpt.h.0.ln_1.weight"] = state["gpt.h.0.ln_1.weight"] + 1
    torch.save({"model": state}, base)
    kept = {p.name: p.read_bytes() for p in out.glob("*.pth") if p.name != BRANCH_BASE_NAME}
    changed = train_here(out, "--resume", "auto", "--max-steps", "8")
    assert changed.returncode == 2, changed.stderr
    assert f"--base-checkpoint {base} (saved as {branch_reference / BRANCH_BASE_NAME}" in changed.stderr
    assert "its base_checkpoint_sha256 fingerprint differs from the one saved with the run" in changed.stderr
    assert {p.name: p.read_bytes() for p in out.glob("*.pth") if p.name != BRANCH_BASE_NAME} == kept
    base.write_bytes(original)
    moved = train_here(out, "--resume", "auto", "--max-steps", "8")
    assert moved.returncode == 0, moved.stderr
    assert f"input moved: --base-checkpoint {branch_reference / BRANCH_BASE_NAME} -> {base}" in moved.stderr
    assert final_state(out).step == 8


@pytest.mark.parametrize("fault", [{"INDEXTTS_TRAIN_OOM_ABOVE": "4"}, {"INDEXTTS_TRAIN_OOM_AT": "5:1"}],
                         ids=["above_4", "mid_accumulation"])
def test_out_of_memory_halves_a_lora_runs_micro_batch_within_rounding(demo_assets, lora_reference, tmp_path, fault):
    """As for full fine-tuning (tests/test_hardware_runs.py): the step is redone with micro-batch 4 x accumulation 4
    on the same samples, the sample-keyed adapter and model dropout masks unchanged, a partial gradient discarded."""
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *COMMON, env=fault)
    assert result.returncode == 0, result.stderr
    assert "with micro-batch 8: redone with micro-batch 4 x accumulation 4" in result.stderr
    assert result.stderr.count("out of memory at step") == 1
    assert final_state(out).step == STEPS and final_state(out).lora == final_state(lora_reference).lora
    assert_close_weights(lora_reference, out)
