"""LoRA runs of the trainer (trainers/model/lora.py wired in): flags, what trains, checkpoints, resume."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from trainers.config.flags import lora_targets
from tests.demo_runs import train_here

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
