"""tools/inspect_checkpoint.py: describing checkpoints and detecting drift of the base vocabulary rows."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.slowness import scaled
from trainers.checkpoint import schema
from trainers.tools.inspect_checkpoint import main
from trainers.training.rng import ProcessRNG

D, NB, N = 8, 20, 26          # width, base text tokens, extended text tokens
TEXT_KEYS = ("text_embedding.weight", "text_head.weight", "text_head.bias")
OTHER_KEYS = ("gpt.h.0.attn.c_attn.weight", "gpt.h.1.ln_1.bias")


def base_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "text_embedding.weight": torch.randn(NB + 1, D, generator=g),
        "text_head.weight": torch.randn(NB + 1, D, generator=g),
        "text_head.bias": torch.randn(NB + 1, generator=g),
        "gpt.h.0.attn.c_attn.weight": torch.randn(D, 3 * D, generator=g),
        "gpt.h.1.ln_1.bias": torch.randn(D, generator=g),
    }


def extend(base: torch.Tensor) -> torch.Tensor:
    """The trainer's layout for N tokens: base rows, new rows (random here), extra row last."""
    new = torch.randn(N - NB, *base.shape[1:], generator=torch.Generator().manual_seed(1))
    return torch.cat([base[:NB], new, base[NB:]])


def trainer_ckpt(model: dict[str, torch.Tensor], micro_batch: int = 0, machine: str = "unknown",
                 amp_dtype: str = "None", **config_overrides: object) -> dict:
    """A trainer checkpoint assembled by the schema; a None override leaves the setting out, as in
    files written before that setting existed."""
    config = {"learning_rate": 2e-5, "effective_batch": 32, "batch_size": 8, "grad_accumulation": 4,
              "weight_decay": 0.01, "seed": 1234, "tokenizer": "tok/bpe.model", "base_checkpoint": "checkpoints/gpt.pth",
              "freeze_base_vocab": True, "max_steps": 0, "epochs": 10, "amp": False, **config_overrides}
    return schema.assemble({
        "model": model,
        "optim": {"optimizer": {"state": {}, "param_groups": []}, "param_shapes": [], "scaler": {},
                  "lr_schedule": {"kind": "warmup_cosine", "base_lr": 2e-5, "warmup_steps": 0, "decay_steps": 1,
                                  "min_lr_ratio": 0.0},
                  "frozen_rows": None},
        "data": {"epoch": 3, "step_in_epoch": 12, "samples_in_epoch": 384, "order_batch": 32, "order": "grouped"},
        "progress": {"step": 120, "samples_seen": 1920, "history": [
            {"kind": "train", "step": 100, "mel_loss": 2.0},
            {"kind": "val", "step": 80, "text_loss": 3.0, "mel_loss": 1.4, "mel_top1": 0.3}]},
        "rng": ProcessRNG().state_dict(),
        "run": {"run_id": "test", "config": {k: v for k, v in config.items() if v is not None},
                "model_config": {"model_dim": D, "layers": 2, "heads": 2, "number_text_tokens": N},
                "fingerprints": {"data": "d" * 8, "tokenizer": "ab" * 32, "model_config": "c" * 8},
                "vocab": {"text_tokens": N, "base_text_tokens": NB}, "versions": {"torch": "2.13.0", "python": "3.12"}},
        "hardware": {"machine": machine, "micro_batch": micro_batch, "amp_dtype": amp_dtype, "tf32": False},
    })


def trained_model(drift_rows: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Extended state where only new rows and non-text tensors changed, plus drift in `drift_rows`."""
    model = {k: extend(v) if k in TEXT_KEYS else v + 0.5 for k, v in base_state().items()}
    for row in drift_rows:
        model["text_embedding.weight"][row, 0] += 0.25
    return model


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {name: tmp_path / f"{name}.pth" for name in ("base", "clean", "drifted", "old")}
    torch.save({"model": base_state()}, paths["base"])
    torch.save(trainer_ckpt(trained_model()), paths["clean"])
    # Row N is the extra row, compared with base row NB.
    torch.save(trainer_ckpt(trained_model(drift_rows=(0, 7, N))), paths["drifted"])
    torch.save(trainer_ckpt(trained_model(), effective_batch=None, freeze_base_vocab=None), paths["old"])
    return paths


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, list[str], str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def line(lines: list[str], prefix: str) -> str:
    found = [ln for ln in lines if ln.startswith(prefix)]
    assert len(found) == 1, (prefix, lines)
    return found[0]


def test_trainer_checkpoint_unchanged_base_rows(files, capsys):
    code, lines, err = run(capsys, files["clean"], "--base", files["base"])
    assert code == 0 and not err
    assert line(lines, "file:") == f"file: {files['clean']} (trainer checkpoint, format {schema.FORMAT})"
    assert line(lines, "step:") == "step: 120 (epoch 3, step 12 of that epoch; 1920 samples seen)"
    assert line(lines, "config:") == ("config: effective batch 32 (micro-batch 8 x 4), lr 2e-05, weight decay 0.01, "
                                      "seed 1234, freeze_base_vocab True")
    assert line(lines, "vocabulary:") == f"vocabulary: {N} text tokens (base {NB}, {N - NB} new); text_embedding rows {N + 1}"
    assert line(lines, "tokenizer sha256:") == "tokenizer sha256: " + "ab" * 32
    assert line(lines, "model:") == f"model: 2 layers, dim {D}, 2 heads"
    assert line(lines, "last validation:") == "last validation: step 80 val_text_loss 3 val_mel_loss 1.4 val_mel_top1 0.3"
    for key in TEXT_KEYS:
        assert line(lines, f"drift {key}:") == (f"drift {key}: base rows max |diff| 0.000e+00, "
                                                f"0 of {NB + 1} rows changed")
        assert line(lines, f"new rows {key}:").startswith(f"new rows {key}: {N - NB}, mean |value| ")
    assert line(lines, "other tensors:").startswith("other tensors: 2 of 2 differ from base")
    assert line(lines, "base rows:") == f"base rows: unchanged (bit-identical to {files['base']})"


def test_drifted_base_rows(files, capsys):
    code, lines, _ = run(capsys, files["drifted"], "--base", files["base"])
    assert code == 0
    assert line(lines, "drift text_embedding.weight:") == ("drift text_embedding.weight: base rows max |diff| "
                                                           f"2.500e-01, 3 of {NB + 1} rows changed")
    assert line(lines, "drift text_head.weight:").endswith(f"0 of {NB + 1} rows changed")
    verdict = line(lines, "base rows:")
    assert verdict.startswith("base rows: DRIFTED (max |diff| 2.500e-01 in 3 rows): ")
    assert "freeze_base_vocab True, so freezing did not work" in verdict


def test_json_output(files, capsys):
    code, lines, _ = run(capsys, files["drifted"], "--base", files["base"], "--json")
    assert code == 0
    facts = json.loads("\n".join(lines))
    assert facts["kind"] == "trainer" and facts["file"] == str(files["drifted"])
    assert (facts["step"], facts["epoch"], facts["step_in_epoch"], facts["samples_seen"]) == (120, 3, 12, 1920)
    assert facts["config"]["effective_batch"] == 32 and facts["config"]["freeze_base_vocab"] is True
    assert facts["vocab"] == {"text_tokens": N, "base_text_tokens": NB, "new_text_tokens": N - NB, "rows": N + 1}
    assert facts["tokenizer_sha256"] == "ab" * 32
    emb = facts["drift"]["text_embedding.weight"]
    assert (emb["rows_changed"], emb["rows_compared"], emb["max_abs_diff"]) == (3, NB + 1, 0.25)
    assert facts["drift"]["text_head.bias"]["rows_changed"] == 0
    assert facts["base_rows_unchanged"] is False and facts["base_rows_changed"] == 3
    assert facts["other_tensors"]["differ"] == 2


def test_json_without_base(files, capsys):
    code, lines, _ = run(capsys, files["clean"], "--json")
    facts = json.loads("\n".join(lines))
    assert code == 0 and facts["drift"] is None and facts["base_rows_unchanged"] is None


def test_text_without_base_suggests_one(files, capsys):
    code, lines, _ = run(capsys, files["clean"])
    assert code == 0
    assert line(lines, "drift:") == "drift: not checked (pass --base checkpoints/gpt.pth to compare the base vocabulary rows)"


def test_old_trainer_checkpoint_without_newer_config_keys(files, capsys):
    code, lines, _ = run(capsys, files["old"], "--base", files["base"])
    assert code == 0
    assert line(lines, "config:") == ("config: effective batch 32 (micro-batch 8 x 4), lr 2e-05, weight decay 0.01, "
                                      "seed 1234, freeze_base_vocab unknown (not recorded)")
    assert line(lines, "base rows:").startswith("base rows: unchanged")


def test_old_drifted_checkpoint_verdict_without_freeze_setting(files, tmp_path, capsys):
    path = tmp_path / "old_drifted.pth"
    torch.save(trainer_ckpt(trained_model(drift_rows=(3,)), freeze_base_vocab=None), path)
    code, lines, _ = run(capsys, path, "--base", files["base"])
    assert code == 0
    assert line(lines, "base rows:").startswith(
        "base rows: trained (freezing off; max |diff| 2.500e-01 in 1 rows), as the run was configured (the setting is "
        "not recorded: trainers before it trained every row)")


def test_an_ordinary_fine_tune_that_trained_the_rows_is_not_called_drifted(tmp_path, capsys):
    """Not extended, freezing off: the rows were meant to train, so nothing alarming is said."""
    base = tmp_path / "base.pth"
    torch.save({"model": base_state()}, base)
    model = {k: v + 0.5 for k, v in base_state().items()}
    ckpt = trainer_ckpt(model, freeze_base_vocab=False)
    ckpt = schema.parse(ckpt, tmp_path / "x").edited("run", vocab={"text_tokens": NB, "base_text_tokens": NB}).to_file()
    path = tmp_path / "tuned.pth"
    torch.save(ckpt, path)
    code, lines, _ = run(capsys, path, "--base", base)
    assert code == 0
    verdict = line(lines, "base rows:")
    assert verdict.startswith("base rows: trained (freezing off; max |diff| 5.000e-01 in 21 rows), as the run was "
                              "configured (freeze_base_vocab False)")
    assert "DRIFTED" not in verdict and "--freeze-base-vocab" not in verdict


def test_official_raw_state_dict_with_module_prefix(files, tmp_path, capsys):
    path = tmp_path / "raw.pth"
    torch.save({f"module.{k}": v for k, v in base_state().items()}, path)
    code, lines, _ = run(capsys, path, "--base", files["base"])
    assert code == 0
    assert line(lines, "file:") == f"file: {path} (raw state dict; 'module.' key prefix stripped)"
    assert line(lines, "vocabulary:") == f"vocabulary: {NB} text tokens; text_embedding rows {NB + 1}"
    assert line(lines, "model:") == f"model: 2 layers, dim {D}"
    values = sum(v.numel() for v in base_state().values())
    assert line(lines, "tensors:") == f"tensors: 5 ({values:,} values)"
    assert not any(ln.startswith(("step:", "new rows")) for ln in lines)
    assert line(lines, "other tensors:").startswith("other tensors: 0 of 2 differ from base;")
    assert line(lines, "base rows:") == f"base rows: unchanged (bit-identical to {files['base']})"


def test_official_format_json(files, capsys):
    code, lines, _ = run(capsys, files["base"], "--json")
    facts = json.loads("\n".join(lines))
    assert code == 0 and facts["kind"] == "official" and facts["step"] is None
    assert facts["vocab"]["text_tokens"] == NB and facts["model"]["dim"] == D


def error_of(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2 and not out
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_missing_file(files, tmp_path, capsys):
    assert str(tmp_path / "nope.pth") in error_of(capsys, tmp_path / "nope.pth")
    err = error_of(capsys, files["clean"], "--base", tmp_path / "nobase.pth")
    assert "--base" in err and "not found" in err


def test_corrupt_and_non_state_dict_files(tmp_path, capsys):
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"not a checkpoint")
    assert "cannot be read" in error_of(capsys, corrupt)
    listing = tmp_path / "list.pth"
    torch.save([1, 2, 3], listing)
    assert "not a state dict" in error_of(capsys, listing)


def test_base_with_other_width(files, tmp_path, capsys):
    wide = tmp_path / "wide.pth"
    torch.save({"model": {k: torch.zeros(NB + 1, D * 2) for k in TEXT_KEYS[:2]}}, wide)
    err = error_of(capsys, files["clean"], "--base", wide)
    assert str(wide) in err and "different width" in err


def test_checkpoint_with_fewer_tokens_than_base(files, tmp_path, capsys):
    err = error_of(capsys, files["base"], "--base", files["clean"])
    assert f"has {NB} text tokens" in err and "does not match" in err


def test_runs_as_a_script_from_another_directory(files, tmp_path):
    import subprocess
    import sys
    script = Path(__file__).resolve().parents[1] / "tools" / "inspect_checkpoint.py"
    done = subprocess.run([sys.executable, str(script), str(files["clean"]), "--base", str(files["base"])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    assert "base rows: unchanged" in done.stdout


def test_split_the_checkpoint_was_written_with(tmp_path, capsys):
    ckpt = trainer_ckpt(trained_model(), micro_batch=4, machine="cuda|NVIDIA L4|22528MiB|sm89", batch_size=0,
                        grad_accumulation=0)
    path = tmp_path / "auto.pth"
    torch.save(ckpt, path)
    code, lines, _ = run(capsys, path)
    assert code == 0
    assert line(lines, "config:").startswith(
        "config: effective batch 32 (written at micro-batch 4 x 8 on cuda|NVIDIA L4|22528MiB|sm89; requested auto x auto)")


@pytest.mark.parametrize("amp, amp_dtype, shown", [
    (False, "None", "off"),
    (True, "torch.bfloat16", "bf16"),
    (True, "torch.float16", "fp16 with loss scaling"),
    (True, "None", "off (--amp auto: fp32 on the CPU)"),  # the old switch, on, in a CPU run
    ("auto", "None", "off (--amp auto: fp32 on the CPU)"),
    ("auto", "torch.float16", "fp16 with loss scaling"),
    ("bf16", "torch.bfloat16", "bf16"),  # also a CPU run's, with --amp bf16
    ("off", "None", "off"),
])
def test_amp_is_what_the_run_computed_in(tmp_path, capsys, amp, amp_dtype, shown):
    path = tmp_path / "ckpt.pth"
    torch.save(trainer_ckpt(trained_model(), amp_dtype=amp_dtype, amp=amp), path)
    code, lines, _ = run(capsys, path)
    assert code == 0
    assert line(lines, "length:") == f"length: epochs 10, max_steps 0; amp {shown}"
    code, out, _ = run(capsys, path, "--json")
    assert json.loads("\n".join(out))["mixed_precision"] == shown


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of 2 steps, resumed once to step 3 with a changed setting: model_step2.pth, model_step3.pth."""
    from tests.demo_runs import small_corpus_flags, train_here

    root = tmp_path_factory.mktemp("inspect")
    inputs = [*small_corpus_flags(root / "data"), "--effective-batch", "4", "--warmup-steps", "1",
              "--min-lr-ratio", "0.1", "--val-interval", "0"]
    run = root / "run"
    assert train_here(run, *inputs, "--max-steps", "2").returncode == 0
    assert train_here(run, "--resume", "auto", "--max-steps", "3", "--log-interval", "1").returncode == 0
    return run


def test_the_start_and_every_resume_are_listed_with_what_changed(real_run, capsys):
    """A real run, resumed once with a changed setting: inspect shows both records from the checkpoint."""
    capsys.readouterr()
    assert main([str(real_run / "latest.pth")]) == 0
    lines = capsys.readouterr().out.splitlines()
    starts = [ln for ln in lines if ln.startswith(("start:", "resume:"))]
    assert len(starts) == 2, lines
    assert starts[0].startswith("start: step 0 ") and starts[0].endswith("nothing changed")
    assert starts[1].startswith("resume: step 2 ") and "from " in starts[1] and "log_interval" in starts[1], starts[1]


def test_a_run_directory_is_read_as_export_reads_it(real_run, tmp_path, capsys):
    """The newest complete checkpoint (here model_step3.pth, newer than latest.pth after a kill between a save's two
    renames), or the one --which names; --verify too."""
    import shutil

    killed = tmp_path / "killed"
    shutil.copytree(real_run, killed)
    (killed / "latest.pth").unlink()
    os.link(killed / "model_step2.pth", killed / "latest.pth")  # the save of step 3 had not re-linked it yet
    capsys.readouterr()
    code, lines, _ = run(capsys, killed)
    assert code == 0
    assert line(lines, "file:").startswith(f"file: {killed / 'model_step3.pth'} (trainer checkpoint")
    assert line(lines, "step:").startswith("step: 3 ")
    code, lines, _ = run(capsys, killed, "--which", "2")
    assert code == 0 and line(lines, "file:").startswith(f"file: {killed / 'model_step2.pth'} ")
    code, lines, _ = run(capsys, killed, "--verify")
    assert code == 0 and lines == [f"file: {killed / 'model_step3.pth'} (format {schema.FORMAT})",
                                   "integrity: ok (every tensor and field matches the checksums written with it)"]
    assert "no model_step9.pth (steps kept: 2, 3" in error_of(capsys, killed, "--which", "9")
    code, lines, _ = run(capsys, killed, "--which", "best")
    assert code == 0 and line(lines, "file:").startswith(f"file: {killed / 'best.pth'} ")
    assert "applies to a run directory" in error_of(capsys, killed / "latest.pth", "--which", "2")
    assert "holds no checkpoint" in error_of(capsys, tmp_path / "killed" / "logs")


def test_a_run_of_each_model_family_is_inspected_and_verified(family_assets, tmp_path, capsys):
    """Each model family: the run's model (named where it is not IndexTTS2's), its base rows, --verify, --json."""
    from tests.demo_runs import train_here

    trained = tmp_path / "run"
    assert train_here(trained, *family_assets, "--max-steps", "2", "--val-interval", "0").returncode == 0
    base = family_assets[family_assets.index("--base-checkpoint") + 1]
    capsys.readouterr()
    code, lines, _ = run(capsys, trained / "latest.pth", "--base", base)
    assert code == 0
    named = "IndexTTS-2.5, " if family_assets.family == "indextts25" else ""
    assert line(lines, "model:") == f"model: {named}2 layers, dim 64, 4 heads"
    assert line(lines, "base:").startswith(f"base: {base} (")
    code, lines, _ = run(capsys, trained, "--verify")
    assert code == 0 and lines[-1].startswith("integrity: ok")
    code, out, _ = run(capsys, trained, "--json")
    assert json.loads("\n".join(out))["model"]["family"] == family_assets.family
    code, out, _ = run(capsys, base, "--json")  # an official-format file: its keys tell the family
    assert json.loads("\n".join(out))["model"]["family"] == family_assets.family
