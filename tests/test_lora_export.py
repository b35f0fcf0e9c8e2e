"""tools/export_checkpoint.py on a LoRA run: the merged model in the upstream layout (strict load, the adapted
model's logits), --adapter-only as an adapter file that indextts-merge-lora folds into the same model, and a
changed base refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.demo_runs import full_config, train_here
from tests.test_checkpoint_integrity import copy_run, data_records, flip_byte, flip_model_byte
from tests.test_gpt_model import make_batch
from trainers.checkpoint import schema
from trainers.checkpoint.lora_export import adapter_file_of
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.lora import LoraSettings, add_adapters
from trainers.model.weights import read_state_dict, split_state_dict
from trainers.tools.export_checkpoint import main as export_main
from trainers.tools.merge_lora import main as merge_main


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, demo_assets: list[str]) -> Path:
    root = tmp_path_factory.mktemp("lora_export")
    full = full_config(root / "config.yaml")
    out = root / "run"
    done = train_here(out, *demo_assets, "--config", str(full), "--lora-rank", "4", "--max-steps", "6",
                      "--val-interval", "0", "--save-interval", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def adapted_model(run: Path, name: str = "latest.pth") -> tuple[UnifiedVoiceGPT, GPTConfig]:
    """The run's model as it trained: its base with the checkpoint's adapters (and rows) loaded."""
    ckpt = schema.read(run / name)
    gpt = GPTConfig(**ckpt.model_config)
    model = UnifiedVoiceGPT(gpt)
    trained, _, _ = split_state_dict(read_state_dict(Path(ckpt.lora["base"])))
    model.load_state_dict(trained, strict=True)
    lora = ckpt.lora
    add_adapters(model, LoraSettings(lora["rank"], lora["alpha"], tuple(lora["targets"]), lora["dropout"]), 0)
    model.load_state_dict(ckpt.model, strict=False)
    return model.eval(), gpt


def test_the_merged_export_loads_strictly_and_computes_the_adapted_models_logits(lora_run, tmp_path, capsys):
    out = tmp_path / "export"
    assert export_main([str(lora_run), "--out", str(out)]) == 0
    state = torch.load(out / "gpt.pth", weights_only=True)["model"]
    model, gpt = adapted_model(lora_run)
    config = GPTConfig.from_yaml_section(yaml.safe_load((out / "config.yaml").read_text())["gpt"])
    plain = UnifiedVoiceGPT(config).eval()
    trained, carried, _ = split_state_dict(state)
    plain.load_state_dict(trained, strict=True)  # exactly the upstream training-path keys, no adapter key
    assert carried and not any(k.endswith((".lora_a", ".lora_b")) for k in state)
    batch = make_batch([5, 9, 3], [7, 12, 4], cfg=gpt, seed=3)
    with torch.no_grad():
        worst = max(float((want - got).abs().max()) for want, got in zip(model(**batch), plain(**batch)))
    print(f"merged vs adapted logits: max abs difference {worst:.3g}")
    assert worst < 2e-5, worst


def test_adapter_only_writes_an_adapter_file_that_merges_into_the_same_model(lora_run, tmp_path, capsys):
    out = tmp_path / "adapter"
    assert export_main([str(lora_run), "--out", str(out), "--adapter-only"]) == 0
    assert "indextts-merge-lora --adapter" in capsys.readouterr().out
    ckpt = schema.read(lora_run / "latest.pth")
    merged = tmp_path / "merged.pth"
    assert merge_main(["--adapter", str(out / "lora_adapter.pth"), "--base", ckpt.lora["base"],
                       "--out", str(merged)]) == 0
    full = tmp_path / "full"
    assert export_main([str(lora_run), "--out", str(full)]) == 0
    exported = torch.load(full / "gpt.pth", weights_only=True)["model"]
    folded = torch.load(merged, weights_only=True)["model"]
    assert {"gpt.wte.weight", "inference_model.lm_head.weight"} <= set(read_state_dict(Path(ckpt.lora["base"])))
    assert folded.keys() == exported.keys()  # the same tensors: none that upstream's strict load does not expect
    assert all(torch.equal(exported[k], v) for k, v in folded.items())


def test_a_damaged_adapter_file_is_refused_by_the_merge_naming_the_file_and_tensor(lora_run, tmp_path, capsys):
    """Adapter files carry checksums as checkpoints do: a flipped byte in an exported adapter file is refused."""
    out = tmp_path / "adapter"
    assert export_main([str(lora_run), "--out", str(out), "--adapter-only"]) == 0
    adapter = out / "lora_adapter.pth"
    offset, size = data_records(adapter)[0]  # the largest tensor's bytes
    flip_byte(adapter, offset + size // 2)
    merged = tmp_path / "merged.pth"
    base = schema.read(lora_run / "latest.pth").lora["base"]
    assert merge_main(["--adapter", str(adapter), "--base", base, "--out", str(merged)]) == 2
    err = capsys.readouterr().err
    assert f"--adapter {adapter}: damaged adapter file" in err and "differs from what was written" in err, err
    assert "tensor adapters/" in err or "tensor replaced/" in err
    assert "Traceback" not in err and not merged.exists()


def test_an_adapter_file_from_before_checksums_merges_with_a_warning(lora_run, tmp_path, capsys):
    ckpt = schema.read(lora_run / "latest.pth")
    old = tmp_path / "old.lora.pth"
    torch.save(adapter_file_of(ckpt).to_dict(), old)  # what exports wrote before adapter files carried checksums
    merged = tmp_path / "merged.pth"
    assert merge_main(["--adapter", str(old), "--base", ckpt.lora["base"], "--out", str(merged)]) == 0
    assert f"warning: --adapter {old} was written before adapter files carried checksums" in capsys.readouterr().err
    assert merged.is_file()


@pytest.mark.parametrize("adapter_only", [False, True], ids=["merged", "adapter_only"])
def test_a_damaged_lora_checkpoint_is_refused_and_a_run_directory_exports_its_newest_intact_one(
        lora_run, tmp_path, capsys, adapter_only):
    damaged = copy_run(lora_run, tmp_path / "run")
    flip_model_byte(damaged / "model_step6.pth")  # latest.pth is the same file
    only = ["--adapter-only"] if adapter_only else []
    assert export_main([str(damaged / "latest.pth"), "--out", str(tmp_path / "a"), *only]) == 2
    assert "does not match the checksums" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert export_main([str(damaged), "--out", str(tmp_path / "b"), *only]) == 0
    assert "exported model_step3.pth, the newest intact checkpoint" in capsys.readouterr().out
    assert json.loads((tmp_path / "b" / "export.json").read_text())["step"] == 3


def test_a_changed_base_is_refused_by_name_and_nothing_written(lora_run, tmp_path, capsys):
    ckpt = schema.read(lora_run / "latest.pth")
    other = tmp_path / "other.pth"
    state = read_state_dict(Path(ckpt.lora["base"]))
    state["final_norm.weight"] = state["final_norm.weight"] * 2
    torch.save({"model": state}, other)
    out = tmp_path / "export"
    assert export_main([str(lora_run), "--out", str(out), "--base", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"is a LoRA checkpoint trained on {ckpt.lora['base']}" in err and "--base has sha256" in err, err
    assert not out.exists()


def test_inspect_shows_the_adapter_settings_and_the_base(lora_run, capsys):
    from trainers.tools.inspect_checkpoint import main as inspect_main

    assert inspect_main([str(lora_run / "latest.pth")]) == 0
    out = capsys.readouterr().out
    ckpt = schema.read(lora_run / "latest.pth")
    assert (f"lora: rank 4, alpha 8 (scale 2), targets c_attn,attn_c_proj,c_fc,mlp_c_proj, adapter dropout 0; the "
            f"checkpoint holds the adapters and trained rows only, on base {ckpt.lora['base']}") in out
    assert "drift: none possible" in out


def test_the_experiment_api_shows_the_adapters_and_loads_the_adapted_model(lora_run):
    from trainers.experiment import ExperimentManager

    assert ExperimentManager.load(lora_run).metadata["lora"]["rank"] == 4
    loaded = ExperimentManager.load_best_model(lora_run)
    model, gpt = adapted_model(lora_run, "best.pth")
    batch = make_batch([5, 9, 3], [7, 12, 4], cfg=gpt, seed=3)
    with torch.no_grad():
        assert max(float((a - b).abs().max()) for a, b in zip(model(**batch), loaded.model(**batch))) < 2e-5
