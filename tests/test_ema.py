"""--ema-decay: the moving average of the weights (trainers/training/ema.py), a validation listener.

* a run with it, SIGKILLed at instants drawn at random and resumed with --resume auto alone each time, ends with the
  bits of the run never killed: weights, optimizer, the averages, best.pth (chosen by ema/mel_loss), the history
  with its ema/* figures per language;
* it changes no weight of training; its validations equal the weights' up to --ema-start;
* under LoRA it averages the adapters only; `indextts-export --ema` writes the averages, merged for LoRA, alone
  as an adapter file with --adapter-only;
* under torchrun (2 CPU processes) the averages equal one process's within float rounding.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.demo_runs import (
    assert_equal_nested, assert_same_training, final_state, full_config, small_corpus_flags, train, train_here,
)
from trainers.checkpoint import schema
from trainers.tools import export_checkpoint, merge_lora

BASE = Path(__file__).resolve().parent / "fixtures" / "pre_seam_run" / "base_gpt.pth"
STEPS = 12
EMA = ["--ema-decay", "0.8", "--ema-start", "2"]
FLAGS = ["--effective-batch", "4", "--batch-size", "2", "--max-steps", str(STEPS), "--val-interval", "4",
         "--save-interval", "3", "--keep-checkpoints", "10", "--log-interval", "4", "--learning-rate", "3e-3",
         "--warmup-steps", "2", "--dropout", "0.1", "--log-sample-ids"]


def corpus(folder: Path) -> list[str]:
    """The small corpus, its validation set split into two languages (aa, bb)."""
    flags = small_corpus_flags(folder)
    val = folder / "val.jsonl"
    lines = val.read_text().splitlines(keepends=True)
    for name, part in (("aa", lines[::2]), ("bb", lines[1::2])):
        (folder / f"val_{name}.jsonl").write_text("".join(part))
    i = flags.index("--val-manifest")
    return [*flags[:i], *flags[i + 2:], "--val-manifest", f"{folder / 'val_aa.jsonl'}::aa",
            "--val-manifest", f"{folder / 'val_bb.jsonl'}::bb"]


def ema_state(run_or_file: Path) -> dict:
    path = run_or_file / "latest.pth" if run_or_file.is_dir() else run_or_file
    return schema.read(path).section("progress")["ema"]


def kill_points(rng: random.Random) -> list[str]:
    """One kill of each kind at a step drawn at random, in step order: during a checkpoint write (at an event drawn
    too), as a validation begins, mid accumulation or after the step."""
    save, validation = rng.choice((3, 6, 9)), rng.choice((4, 8))
    other = rng.choice([s for s in range(1, STEPS) if s not in (save, validation)])
    points = {save: f"save:{save}:{rng.choice(('tmp_written', 'renamed', 'linked'))}",
              validation: f"validation:{validation}",
              other: rng.choice((f"micro:{other}:0", f"micro:{other}:1", f"step:{other}"))}
    return [points[s] for s in sorted(points)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("ema")
    flags = corpus(root / "data")
    out = root / "straight"
    done = train_here(out, *flags, *FLAGS, *EMA, "--best-metric", "ema/mel_loss")
    assert done.returncode == 0, done.stderr
    assert "validation step 8 ema language aa text_loss" in done.stderr
    return out, flags


def test_a_run_with_ema_killed_at_random_instants_resumes_bit_identically(straight, tmp_path):
    reference, flags = straight
    points = kill_points(random.Random(39))
    out = tmp_path / "run"
    first = [*flags, *FLAGS, *EMA, "--best-metric", "ema/mel_loss"]
    for point in points:
        killed = train(out, *first, kill_at=point)
        assert killed.returncode == -9, f"{point}: {killed.stderr[-2000:]}"
        first = ["--resume", "auto"]
    assert train_here(out, "--resume", "auto").returncode == 0, points
    assert_same_training(reference, out, STEPS)
    assert_equal_nested(ema_state(reference), ema_state(out), f"ema after kills at {points}")
    best, theirs = schema.read(out / "best.pth"), schema.read(reference / "best.pth")
    assert best.best == theirs.best and best.best["metric"] == "ema/mel_loss"
    assert_equal_nested(best.section("progress")["ema"], theirs.section("progress")["ema"], "best.pth's ema")


def test_ema_changes_no_weight_and_is_validated_per_language(straight, tmp_path):
    reference, flags = straight
    plain = tmp_path / "plain"
    assert train_here(plain, *flags, *FLAGS).returncode == 0
    ours, theirs = final_state(reference), final_state(plain)
    assert_equal_nested(ours.model, theirs.model, "model")
    assert "ema" not in theirs.section("progress") and "ema_decay" not in theirs.settings  # saved as before EMA
    vals = [h for h in ours.history if h["kind"] == "val"]
    assert [v["step"] for v in vals] == [0, 4, 8, 12]
    assert vals[0]["ema/mel_loss"] == vals[0]["mel_loss"]  # up to --ema-start the averages are the weights
    for v in vals[1:]:
        assert v["ema/mel_loss"] != v["mel_loss"] and set(v["ema/langs"]) == {"aa", "bb"}
    averages = ema_state(reference)["weights"]
    assert {k: v.dtype for k, v in averages.items()} == {k: torch.float32 for k in ours.model}
    refused = train_here(reference, "--resume", "auto", "--max-steps", "14", "--ema-decay", "0.9")
    assert refused.returncode == 2 and "ema_decay: saved 0.8, now 0.9 (changes the result)" in refused.stderr
    assert export_checkpoint.main([str(plain), "--out", str(tmp_path / "export"), "--ema"]) == 2


def test_lora_averages_the_adapters_and_export_writes_the_averages(tmp_path):
    flags = [*small_corpus_flags(tmp_path / "data"), "--base-checkpoint", str(BASE)]
    config = full_config(tmp_path / "full.yaml", tmp_path / "data" / "tiny.yaml")
    short = [*FLAGS, *EMA, "--max-steps", "5", "--val-interval", "0"]
    for name, extra in (("full", []), ("lora", ["--lora-rank", "2"])):
        done = train_here(tmp_path / name, *flags, *short, *extra)
        assert done.returncode == 0, done.stderr
    full, lora = final_state(tmp_path / "full"), final_state(tmp_path / "lora")
    assert set(ema_state(tmp_path / "lora")["weights"]) == set(lora.model)  # the adapters and nothing else
    assert all(".lora_" in k for k in lora.model) and set(ema_state(tmp_path / "full")["weights"]) < set(full.model)

    def export(run: str, *args: str) -> Path:
        out = tmp_path / f"export_{run}_{len(args)}"
        assert export_checkpoint.main([str(tmp_path / run), "--out", str(out), "--config", str(config), *args]) == 0
        return out

    exported = torch.load(export("full", "--ema") / "gpt.pth", weights_only=True)["model"]
    averages = ema_state(tmp_path / "full")["weights"]
    assert all(torch.equal(exported[k], v) for k, v in averages.items())
    assert all(torch.equal(exported[k], v) for k, v in full.model.items() if k not in averages and k in exported)
    adapter = export("lora", "--ema", "--adapter-only") / "lora_adapter.pth"
    merged = tmp_path / "merged.pth"
    assert merge_lora.main(["--adapter", str(adapter), "--base", str(BASE), "--out", str(merged)]) == 0
    ours = torch.load(export("lora", "--ema") / "gpt.pth", weights_only=True)["model"]
    theirs = torch.load(merged, weights_only=True)["model"]
    assert all(torch.equal(v, theirs[k]) for k, v in ours.items())
    plain = torch.load(export("lora") / "gpt.pth", weights_only=True)["model"]
    assert any(not torch.equal(v, plain[k]) for k, v in ours.items())


def test_under_torchrun_the_averages_are_one_processs_within_float_rounding(straight, tmp_path):
    """2 CPU processes, each half of every step: the gradient sums differ in float rounding only, so do the averages."""
    from tests.test_ddp_runs import torchrun

    reference, flags = straight
    out = tmp_path / "ddp"
    done = torchrun(out, *flags, *FLAGS, *EMA, "--best-metric", "ema/mel_loss")
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = ema_state(out), ema_state(reference)
    assert ours["step"] == theirs["step"] == STEPS and ours["weights"].keys() == theirs["weights"].keys()
    for key, value in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][key], value, rtol=1e-4, atol=5e-5, msg=key)
    vals = [[h["ema/mel_loss"] for h in final_state(run).history if h["kind"] == "val"] for run in (out, reference)]
    assert vals[0] == pytest.approx(vals[1], rel=1e-5)
    assert schema.read(out / "best.pth").step == schema.read(reference / "best.pth").step
