"""The README's demo: trains the tiny config, clearly learns, writes an inference-loadable checkpoint."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import yaml

from tests.demo_runs import REPO, final_state, subprocess_env
from trainers.model.weights import CARRIED_PREFIXES, DROPPED_PREFIXES


def test_demo_learns_and_writes_a_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    # The README's command, as a user runs it (its own process), into a fresh directory.
    result = subprocess.run([sys.executable, "trainers/train_gpt_v2.py", "--demo", "--output-dir", str(out)],
                            cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    ckpt = final_state(out)
    val = [m for m in ckpt.history if m["kind"] == "val"]
    assert val[0]["step"] == 0 and val[-1]["step"] == ckpt.step == 240  # before the first step and at the end
    assert val[-1]["mel_loss"] <= 0.5 * val[0]["mel_loss"], (val[0], val[-1])

    # The file inference loads: {"model": state dict} with the carried tensors, without the dropped ones.
    raw = torch.load(out / "latest.pth", map_location="cpu", weights_only=True)
    base = torch.load(out / "demo_data" / "base_gpt.pth", map_location="cpu", weights_only=True)["model"]
    carried = [k for k in base if k.startswith(CARRIED_PREFIXES)]
    assert carried, "the demo base checkpoint should hold group-B tensors"
    for key in carried:
        assert torch.equal(raw["model"][key], base[key]), f"{key} was not carried unchanged"
    assert not any(k.startswith(DROPPED_PREFIXES) for k in raw["model"])
    assert not torch.equal(ckpt.model["mel_head.weight"], base["mel_head.weight"])  # it trained

    saved_yaml = yaml.safe_load((out / "config.yaml").read_text())
    assert saved_yaml["gpt"]["number_text_tokens"] == ckpt.model["text_embedding.weight"].shape[0] - 1
    assert (out / "logs").is_dir() and any((out / "logs").iterdir())
