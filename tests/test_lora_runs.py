"""LoRA runs of the trainer (trainers/model/lora.py wired in): flags, what trains, checkpoints, resume."""
from __future__ import annotations

import argparse
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.demo_runs import assert_close_weights, assert_equal_nested, family_run, final_state, train, train_here
from trainers.checkpoint import schema
from trainers.config.flags import parse_command_line
from trainers.config.settings import lora_targets
from trainers.faults import Faults
from trainers.files import file_sha256
from trainers.main import train as train_run
from trainers.model.lora import DEFAULT_TARGETS, is_adapter_key
from trainers.model.weights import read_state_dict, split_state_dict
from trainers.run.setup import setup_run
from trainers.stop_signals import StopRequest

SHORT = ["--max-steps", "4", "--save-interval", "2", "--val-interval", "0", "--log-interval", "2"]


@pytest.mark.parametrize("flags, named", [
    (["--lora-rank", "-1"], "--lora-rank must be a whole number from 0 to 4096"),
    (["--lora-rank", "5000"], "--lora-rank must be a whole number from 0 to 4096"),
    (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha must be a finite number > 0"),
    (["--lora-rank", "8", "--lora-dropout", "1"], "--lora-dropout must be a finite number >= 0 and < 1"),
    (["--lora-alpha", "16"], "--lora-alpha configure LoRA adapters: pass --lora-rank R"),
    (["--lora-targets", "c_attn"], "--lora-targets configure LoRA adapters: pass --lora-rank R"),
    (["--lora-rank", "8", "--lora-targets", "c_attn,wte"], "argument --lora-targets: expected a comma-separated"),
])
def test_bad_lora_flags_exit_2_naming_the_flag(tmp_path: Path, demo_assets: list[str], flags: list[str],
                                               named: str) -> None:
    out = tmp_path / "run"
    try:
        result = train_here(out, *demo_assets, *SHORT, *flags)
        status, text = result.returncode, result.stderr
    except SystemExit as exc:  # argparse's own refusal of a malformed value (its message went to the lost stderr)
        status, text = exc.code, ""
        with pytest.raises(argparse.ArgumentTypeError, match="distinct names from c_attn"):
            lora_targets(flags[-1])
    assert status == 2
    assert not out.exists() or not any(out.glob("*.pth"))
    if text:
        assert named in text, text


STEPS = 12
# Micro-batches of 8, two per step (kills land mid-accumulation); adapter and model dropout both on, so the
# sample-keyed masks are part of what a resume must reproduce.
COMMON = ["--lora-rank", "4", "--lora-dropout", "0.1", "--dropout", "0.1", "--batch-size", "8",
          "--grad-accumulation", "2", "--max-steps", str(STEPS), "--save-interval", "4", "--val-interval", "0",
          "--max-val-batches", "1", "--keep-checkpoints", "2", "--log-interval", "5"]


@pytest.fixture(scope="module")
def lora_reference(demo_assets: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora_reference") / "run"
    result = train_here(out, *demo_assets, *COMMON)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def family_lora_reference(family_assets, request: pytest.FixtureRequest,
                          tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`lora_reference`, for each model family's demo."""
    return family_run(family_assets, request, "lora_reference", tmp_path_factory, *COMMON)


def test_sigkill_mid_accumulation_and_mid_write_then_resume_is_bit_identical(family_assets, family_lora_reference,
                                                                             tmp_path):
    """Each model family."""
    lora_reference = family_lora_reference
    out = tmp_path / "run"
    kills = ["micro:6:1", "save:8:tmp_written", None]  # mid gradient accumulation; inside a checkpoint write
    killed = train(out, *family_assets, *COMMON, kill_at=kills[0])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    for kill_at, resumes_from in zip(kills[1:], (4, 4)):
        resumed = train(out, "--resume", "auto", kill_at=kill_at) if kill_at else train_here(out, "--resume", "auto")
        assert resumed.returncode == (-signal.SIGKILL if kill_at else 0), resumed.stderr
        assert f"(step {resumes_from}," in resumed.stderr
    a, b = final_state(lora_reference), final_state(out)
    assert a.step == b.step == STEPS
    assert_equal_nested(a.model, b.model, "model")
    assert_equal_nested(a.optimizer, b.optimizer, "optimizer")


def test_the_checkpoint_holds_adapters_only_and_names_its_base(demo_assets, lora_reference):
    ckpt = final_state(lora_reference)
    assert ckpt.format_version == schema.LORA_VERSION
    assert ckpt.model and all(is_adapter_key(k) for k in ckpt.model)  # no base tensor (the demo vocabulary is not extended)
    assert {n for n, _ in ckpt.param_shapes} == set(ckpt.model)  # the optimizer covers exactly the adapters
    base = Path(demo_assets[demo_assets.index("--base-checkpoint") + 1])
    assert ckpt.lora == {"rank": 4, "alpha": 8.0, "targets": list(DEFAULT_TARGETS), "dropout": 0.1,
                         "base": str(base), "base_sha256": file_sha256(base)}
    # Much smaller than the base it adapts: the adapters and their moments, no model copy.
    adapter_bytes = sum(t.numel() * t.element_size() for t in ckpt.model.values())
    base_bytes = sum(t.numel() * t.element_size() for t in read_state_dict(base).values())
    assert adapter_bytes * 5 < base_bytes


def test_the_base_weights_are_bit_identical_after_training(demo_assets, tmp_path):
    """The trainer's own run, in this process: after its steps every base tensor equals the file's."""
    cmd = parse_command_line(["--output-dir", str(tmp_path / "run"), *demo_assets, *COMMON, "--max-steps", "3"])
    run = setup_run(cmd)
    try:
        assert train_run(run, StopRequest(), Faults.from_env()) == 0
    finally:
        run.close()
    base = Path(demo_assets[demo_assets.index("--base-checkpoint") + 1])
    trained, carried, _ = split_state_dict(read_state_dict(base))
    own = run.model.state_dict()
    assert set(trained) == {k for k in own if not is_adapter_key(k)}
    for key, value in trained.items():
        assert torch.equal(own[key], value), key
    assert all(torch.equal(run.weights.carried[k], v) for k, v in carried.items())
    assert any(bool(v.abs().sum() > 0) for k, v in own.items() if k.endswith(".lora_b"))  # the adapters did train


def test_a_changed_base_is_refused_by_name(demo_assets, lora_reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(lora_reference, out)
    base = Path(demo_assets[demo_assets.index("--base-checkpoint") + 1])
    other = tmp_path / "other_base.pth"
    state = read_state_dict(base)
    state["gpt.h.0.ln_1.weight"] = state["gpt.h.0.ln_1.weight"] + 1
    torch.save({"model": state}, other)
    before = {p.name: p.read_bytes() for p in out.glob("*.pth")}
    result = train_here(out, "--resume", "auto", "--base-checkpoint", str(other), "--max-steps", str(STEPS + 2))
    assert result.returncode == 2, result.stderr
    assert f"--base-checkpoint {other} is not the file this LoRA run was trained on" in result.stderr
    assert f"the run used {base}" in result.stderr
    assert {p.name: p.read_bytes() for p in out.glob("*.pth")} == before  # nothing on disk changed


@pytest.mark.parametrize("rank", ["8", "0"])
def test_a_rank_change_is_refused_even_when_allowed(demo_assets, lora_reference, tmp_path, rank):
    """Adapters of another rank do not fit, and a LoRA checkpoint holds no whole model to fine-tune: the refusal
    names --lora-rank, with --allow-config-change too (which cannot make the checkpoint hold other tensors)."""
    out = tmp_path / "run"
    shutil.copytree(lora_reference, out)
    for allow in ([], ["--allow-config-change"]):
        refused = train_here(out, "--resume", "auto", "--lora-rank", rank, *allow, "--max-steps", str(STEPS + 2))
        assert refused.returncode == 2, refused.stderr
        assert f"lora_rank: saved 4, now {rank} (changes the result)" in refused.stderr
        assert "pass --lora-rank 4 (the run's own" in refused.stderr and "missing:" not in refused.stderr
        assert final_state(out).step == STEPS


def test_a_full_fine_tuning_checkpoint_is_unchanged_by_lora(demo_assets, tmp_path):
    """Rank 0 writes format 3 with exactly the settings and fingerprints it wrote before LoRA existed."""
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *SHORT).returncode == 0
    ckpt = final_state(out)
    assert ckpt.format_version == schema.VERSION == 3 and ckpt.lora is None
    assert not {k for k in ckpt.settings if k.startswith("lora_")}
    assert set(ckpt.fingerprints) == {"data", "tokenizer", "model_config"}
    before = (out / "latest.pth").read_bytes()
    as_lora = train_here(out, "--resume", "auto", "--lora-rank", "4", "--max-steps", "6")
    assert as_lora.returncode == 2 and "lora_rank: saved 0, now 4 (changes the result)" in as_lora.stderr
    assert "a full fine-tuning checkpoint does not continue as LoRA" in as_lora.stderr
    assert "is not the file this LoRA run was trained on" not in as_lora.stderr
    assert (out / "latest.pth").read_bytes() == before


def test_the_base_is_found_again_through_data_root_after_a_move(demo_assets, tmp_path):
    """A LoRA checkpoint needs its base on resume: a moved base is found through --data-root (and checked by sha256)."""
    assets = Path(demo_assets[demo_assets.index("--base-checkpoint") + 1]).parent
    old, new = tmp_path / "data_old", tmp_path / "data_new"
    shutil.copytree(assets, old)
    flags = [str(old / Path(a).relative_to(assets)) if a.startswith(str(assets)) else a for a in demo_assets]
    out = tmp_path / "run"
    assert train_here(out, *flags, *COMMON, "--max-steps", "2").returncode == 0
    old.rename(new)
    lost = train_here(out, "--resume", "auto", "--max-steps", "4")  # without --data-root: named, not assumed carried
    assert lost.returncode == 2, lost.stderr
    assert f"--base-checkpoint {old / 'base_gpt.pth'}" in lost.stderr and "not needed" not in lost.stderr
    # --lora-rank 0 takes no fingerprint of the base: the refusal names the setting, not the (unchanged) moved file.
    as_full = train_here(out, "--resume", "auto", "--data-root", f"{old}={new}", "--lora-rank", "0", "--max-steps", "4")
    assert as_full.returncode == 2, as_full.stderr
    assert "lora_rank: saved 4, now 0" in as_full.stderr and "pass --lora-rank 4" in as_full.stderr
    assert "fingerprint differs" not in as_full.stderr
    resumed = train_here(out, "--resume", "auto", "--data-root", f"{old}={new}", "--max-steps", "4")
    assert resumed.returncode == 0, resumed.stderr
    assert f"input moved: --base-checkpoint {old / 'base_gpt.pth'} -> {new / 'base_gpt.pth'}" in resumed.stderr
    assert final_state(out).step == 4


def test_background_saves_killed_mid_write_resume_bit_identically(demo_assets, lora_reference, tmp_path):
    out = tmp_path / "run"
    kills = ["save:4:tmp_written", "step:9", None]
    killed = train(out, *demo_assets, *COMMON, "--background-saves", kill_at=kills[0])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    for kill_at in kills[1:]:
        args = ("--resume", "auto", "--background-saves")
        resumed = train(out, *args, kill_at=kill_at) if kill_at else train_here(out, *args)
        assert resumed.returncode == (-signal.SIGKILL if kill_at else 0), resumed.stderr
        assert "in the background" in resumed.stderr
    a, b = final_state(lora_reference), final_state(out)
    assert a.step == b.step == STEPS
    assert_equal_nested(a.model, b.model, "model")


def test_two_torchrun_processes_train_the_single_process_lora_steps(family_assets, family_lora_reference, tmp_path):
    """DDP over the adapters alone (the frozen base takes no part in the gradient sum): the steps of one process,
    within float rounding (another split of the same effective batch). Each model family."""
    demo_assets, lora_reference = family_assets, family_lora_reference
    from tests.test_ddp_runs import torchrun

    at = COMMON.index("--grad-accumulation")
    flags = COMMON[:at] + COMMON[at + 2:]  # 2 processes x micro-batch 8
    out = tmp_path / "two"
    result = torchrun(out, *demo_assets, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch: world 2 x (micro-batch 8 x accumulation 1) = effective batch 16" in result.stderr
    assert final_state(out).lora == final_state(lora_reference).lora
    assert_close_weights(lora_reference, out)
