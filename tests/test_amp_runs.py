"""Mixed precision through the real trainer on the CPU: torch's CPU autocast runs bf16 and fp16, so the
paths a GPU takes (autocast, fp16's loss scaler, the dtype recorded in the checkpoint) run here for real."""
from __future__ import annotations

import signal

import torch

from tests.demo_runs import final_state, train, train_here

STEPS = 12
FLAGS = ["--batch-size", "8", "--grad-accumulation", "2", "--max-steps", str(STEPS), "--save-interval", "4",
         "--val-interval", "0", "--max-val-batches", "1", "--dropout", "0.1", "--log-interval", "100"]


def test_bf16_run_killed_by_sigkill_resumes_bit_identically(family_assets, tmp_path):
    """A bf16 autocast run SIGKILLed mid-accumulation of step 7 (last checkpoint: step 4) and resumed with
    --resume auto alone ends with every model and optimizer tensor equal to the uninterrupted bf16 run's. Each
    model family."""
    demo_assets = family_assets
    reference = tmp_path / "reference"
    done = train_here(reference, *demo_assets, *FLAGS, "--amp", "bf16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "amp bf16 (--amp bf16, CPU autocast)" in done.stderr

    out = tmp_path / "run"
    killed = train(out, *demo_assets, *FLAGS, "--amp", "bf16", kill_at="micro:7:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = train_here(out, "--resume", "auto")  # keeps the run's --amp bf16
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 4," in resumed.stderr and "amp bf16" in resumed.stderr

    a, b = final_state(reference), final_state(out)
    assert a.step == b.step == STEPS and a.amp_dtype == b.amp_dtype == "torch.bfloat16"
    for key in a.model:
        assert torch.equal(a.model[key], b.model[key]), key
    for (i, sa), sb in zip(a.optimizer["state"].items(), b.optimizer["state"].values()):
        for name in sa:
            assert torch.equal(sa[name], sb[name]), f"optimizer state {i}.{name}"


def test_fp16_runs_with_its_loss_scaler_and_the_choice_is_kept_on_resume(demo_assets, tmp_path):
    out = tmp_path / "run"
    flags = [*demo_assets, *FLAGS, "--max-steps", "2"]
    first = train_here(out, *flags, "--amp", "fp16")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "amp fp16 (--amp fp16, with a loss scaler, CPU autocast)" in first.stderr
    state = final_state(out)
    assert state.amp_dtype == "torch.float16" and state.section("optim")["scaler"]["scale"] > 0
    kept = train_here(out, "--resume", "auto", "--max-steps", "3")
    assert kept.returncode == 0 and "amp fp16" in kept.stderr and final_state(out).amp_dtype == "torch.float16"
    told = train_here(out, "--resume", "auto", "--max-steps", "4", "--amp", "off")
    assert told.returncode == 0, told.stderr[-3000:]
    assert "amp: saved 'fp16', now 'off' (ok)" in told.stderr
    assert "mixed precision changed from torch.float16 to None" in told.stderr
    assert final_state(out).amp_dtype == "None"


def test_default_is_auto_and_fp32_on_the_cpu(demo_assets, tmp_path):
    done = train_here(tmp_path / "run", *demo_assets, *FLAGS, "--max-steps", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "amp off (auto: fp32 on the CPU; --amp bf16 for bf16 autocast)" in done.stderr
    assert final_state(tmp_path / "run").settings["amp"] == "auto"
