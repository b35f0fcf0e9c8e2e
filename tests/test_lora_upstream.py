"""The merged export of a LoRA run loads strictly into upstream IndexTTS2's `UnifiedVoice`.

Upstream's code comes from a pinned wheel (tests/upstream_models.py). The base is an upstream
`UnifiedVoice` of the demo's sizes with small conditioning encoders, saved as gpt.pth: so the export must
reproduce every key upstream has, its conditioning encoders included, not only the trainer's own.
"""
from __future__ import annotations

import torch
import yaml

from tests.demo_runs import REPO, full_config, train_here
from tests.upstream_gpt import ENCODER, quiet, v2
from trainers.checkpoint import schema
from trainers.tools.export_checkpoint import main as export_main


def upstream_model(gpt: dict) -> torch.nn.Module:
    with quiet():
        return v2().UnifiedVoice(**gpt)


def test_the_merged_export_of_a_lora_run_loads_strictly_into_upstream_unified_voice(demo_assets, tmp_path, capsys):
    gpt = yaml.safe_load((REPO / "checkpoints" / "demo.yaml").read_text(encoding="utf-8"))["gpt"]
    gpt.update(condition_module=ENCODER, emo_condition_module=ENCODER)
    trimmed = tmp_path / "gpt_section.yaml"
    trimmed.write_text(yaml.safe_dump({"gpt": gpt}), encoding="utf-8")
    config = full_config(tmp_path / "config.yaml", trimmed)
    torch.manual_seed(0)
    base = tmp_path / "gpt.pth"
    torch.save({"model": upstream_model(gpt).state_dict()}, base)
    flags = list(demo_assets)
    flags[flags.index("--base-checkpoint") + 1] = str(base)
    out = tmp_path / "run"
    done = train_here(out, *flags, "--config", str(config), "--lora-rank", "4", "--max-steps", "3",
                      "--val-interval", "0", "--save-interval", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert schema.read(out / "latest.pth").lora is not None
    assert export_main([str(out), "--out", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    state = torch.load(tmp_path / "export" / "gpt.pth", weights_only=True)["model"]
    exported = yaml.safe_load((tmp_path / "export" / "config.yaml").read_text(encoding="utf-8"))["gpt"]
    model = upstream_model(exported)
    model.load_state_dict(state, strict=True)  # every upstream key, no adapter key, no other
    # The adapters were merged in (the projections moved), and nothing else changed.
    original = torch.load(base, weights_only=True)["model"]
    moved = {k for k in state if not torch.equal(state[k], original[k])}
    assert moved and all(k.startswith("gpt.h.") and k.endswith(".weight") for k in moved), sorted(moved)
