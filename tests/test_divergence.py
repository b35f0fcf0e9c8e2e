"""A diverging run never replaces good checkpoints with bad ones, and bad values are refused by name.

Divergence is injected (trainers/faults.py: INDEXTTS_TRAIN_NAN_FROM, _NAN_WEIGHTS_AT), so
the real loop, checkpointing and rotation are exercised in-process.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from tests.demo_runs import final_state, train_here
from trainers.checkpoint import schema
from trainers.model.weights import read_state_dict

FLAGS = ["--batch-size", "8", "--max-steps", "16", "--save-interval", "2", "--keep-checkpoints", "2",
         "--val-interval", "0", "--max-val-batches", "1", "--log-interval", "100"]


def all_finite(ckpt: schema.Checkpoint) -> bool:
    tensors = [*ckpt.model.values(), *(v for s in ckpt.optimizer["state"].values() for v in s.values())]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def test_a_streak_of_non_finite_steps_stops_without_saving_over_the_good_checkpoints(demo_assets, tmp_path):
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *FLAGS, env={"INDEXTTS_TRAIN_NAN_FROM": "7"})
    assert result.returncode == 3, result.stderr
    assert "5 steps in a row with non-finite gradients" in result.stderr
    assert "not saving during a streak of skipped steps" in result.stderr  # steps 8 and 10
    assert sorted(p.name for p in out.glob("model_step*.pth")) == ["model_step4.pth", "model_step6.pth"]
    latest = final_state(out)
    assert latest.step == 6 and all_finite(latest)


def test_non_finite_weights_are_never_saved(demo_assets, tmp_path):
    out = tmp_path / "run"
    # As an infinite learning rate would: a finite gradient, then non-finite weights, at a saving step.
    result = train_here(out, *demo_assets, *FLAGS, env={"INDEXTTS_TRAIN_NAN_WEIGHTS_AT": "6"})
    assert result.returncode == 3, result.stderr
    assert "holds non-finite values, so step 6 is not saved" in result.stderr
    assert "the last checkpoint (model_step4.pth) is intact" in result.stderr
    latest = final_state(out)
    assert latest.step == 4 and all_finite(latest)
    assert not (out / "model_step6.pth").exists()


def test_a_non_finite_validation_loss_is_an_error(demo_assets, tmp_path):
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *FLAGS, "--val-interval", "5", env={"INDEXTTS_TRAIN_NAN_WEIGHTS_AT": "5"})
    assert result.returncode == 3, result.stderr
    assert "validation" in result.stderr and "is nan" in result.stderr
    assert final_state(out).step == 4


def _flag(flags: list[str], name: str) -> Path:
    return Path(flags[flags.index(name) + 1])


def test_a_base_checkpoint_with_nan_or_absurd_values_is_refused_by_tensor(demo_assets, tmp_path):
    state = read_state_dict(_flag(demo_assets, "--base-checkpoint"))
    for name, value in (("nan", float("nan")), ("huge", 1e38)):
        bad = dict(state)
        bad["mel_head.weight"] = state["mel_head.weight"].clone()
        bad["mel_head.weight"][3, 1] = value
        path = tmp_path / f"{name}.pth"
        torch.save({"model": bad}, path)
        refused = train_here(tmp_path / f"run_{name}", *demo_assets, *FLAGS, "--base-checkpoint", str(path))
        assert refused.returncode == 2, refused.stderr
        assert f"--base-checkpoint {path}: tensor mel_head.weight" in refused.stderr
        assert not (tmp_path / f"run_{name}").exists()


def test_features_with_absurd_magnitudes_are_refused_with_file_and_line(demo_assets, tmp_path):
    manifest = _flag(demo_assets, "--train-manifest")
    rows = [json.loads(line) for line in manifest.read_text().splitlines()[:16]]
    rows = [{k: str(manifest.parent / v) if k.endswith("_path") else v for k, v in row.items()} for row in rows]
    condition = np.load(rows[0]["prompt_condition_path"])
    condition[0, 0] = 1e38
    np.save(tmp_path / "bad_condition.npy", condition)
    rows[0]["prompt_condition_path"] = str(tmp_path / "bad_condition.npy")
    bad = tmp_path / "train.jsonl"
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = [a if a != str(manifest) else str(bad) for a in demo_assets]
    refused = train_here(tmp_path / "run", *args, *FLAGS, "--batch-size", "16", "--effective-batch", "16")
    assert refused.returncode == 2, refused.stderr
    assert f"{bad}:1: condition file" in refused.stderr and "magnitude 1e+38" in refused.stderr


def test_fp16_loss_scaler_skips_are_counted_and_end_the_run(demo_assets, tmp_path, caplog):
    """The real loop with the loss scaler --amp uses on an fp16 GPU (on the CPU here): overflowing
    steps are skipped by the scaler, counted, and a bounded streak of them ends the run."""
    from trainers.config.flags import parse_command_line
    from trainers.faults import Faults, KillPoint, NanInjector
    from trainers.run.setup import setup_run
    from trainers.stop_signals import StopRequest
    from trainers.loop import MAX_SKIPPED_FP16
    from trainers.main import train

    caplog.set_level(logging.INFO, logger="train")
    out = tmp_path / "run"
    run = setup_run(parse_command_line(["--output-dir", str(out), *demo_assets, *FLAGS, "--max-steps", "40"]))
    run.optim.scaler = torch.amp.GradScaler("cpu", enabled=True)
    stop = StopRequest(training=True).install()
    try:
        status = train(run, stop, Faults(KillPoint(), NanInjector(loss_from=3)))
    finally:
        stop.uninstall()
    assert status == 3
    assert f"{MAX_SKIPPED_FP16} steps in a row with non-finite gradients at every loss scale" in caplog.text
    # The first skips are the scaler finding its scale (INFO); from the fifth in a row on they are warned about.
    assert "step 3: fp16 gradients overflowed, update skipped; the loss scale is lowered to 32768" in caplog.text
    assert "step 6: non-finite" not in caplog.text and "step 7: non-finite gradients" in caplog.text
    assert run.progress.step == 2 + MAX_SKIPPED_FP16 - 1 and run.optim.scaler.get_scale() < 1  # the last one ended it
    assert final_state(out).step == 2  # nothing saved during the streak


def test_a_bad_sample_mid_run_keeps_the_steps_before_it_and_their_scalars(tmp_path):
    """A codes file with an id out of range, first met at step 3: the run exits 2 after saving step 2,
    and TensorBoard holds steps 1 and 2 (their scalars are kept on the device between log lines, and
    a resume from step 2 purges nothing before it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.demo_runs import small_corpus_flags

    data = tmp_path / "data"
    flags = [*small_corpus_flags(data), "--effective-batch", "4", "--warmup-steps", "1", "--val-interval", "0",
             "--log-interval", "10", "--save-interval", "100", "--log-sample-ids"]
    probe = train_here(tmp_path / "probe", *flags, "--max-steps", "3")
    assert probe.returncode == 0, probe.stderr[-2000:]
    steps = [line.split("\t")[2].split(",") for line in (tmp_path / "probe" / "sample_ids.tsv").read_text().splitlines()]
    targets = [[sample_id.split("__")[0] for sample_id in ids] for ids in steps]
    bad_target = next(t for t in targets[2] if t not in targets[0] + targets[1])  # first met at step 3
    codes_path = data / "features" / f"{bad_target}_codes.npy"
    codes = np.load(codes_path)
    codes[0] = 10**6
    np.save(codes_path, codes)

    run = tmp_path / "run"
    stopped = train_here(run, *flags, "--max-steps", "6")
    assert stopped.returncode == 2, stopped.stderr[-2000:]
    assert f"{bad_target}_codes.npy" in stopped.stderr
    assert schema.read(run / "latest.pth").step == 2
    events = EventAccumulator(str(run / "logs"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/mel_loss")] == [1, 2]
