"""Checkpoints written by earlier versions of the trainer still resume exactly.

tests/fixtures/v1_run holds a run made by the last version that wrote checkpoint format 1
(see its README): its step-4 checkpoint is resumed by today's trainer, and step 8 must equal
the step-8 checkpoint that old version wrote, tensor for tensor.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.demo_runs import final_state, small_corpus_flags, train_here
from trainers.checkpoint import schema

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "v1_run"


def _equal_nested(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal_nested(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_equal_nested(a, b) for a, b in zip(x, y))
    return x == y


def test_format_1_is_read_through_the_schema():
    old = schema.read(FIXTURE / "model_step4.pth")
    assert old.format_version == 1
    assert (old.step, old.epoch, old.step_in_epoch, old.samples_in_epoch) == (4, 0, 4, 16)
    assert (old.text_tokens, old.base_text_tokens) == (160, 160)
    assert old.settings["effective_batch"] == 4 and old.run_id == ""
    assert schema.parse(old.to_file(), FIXTURE / "rewritten").format_version == schema.VERSION


def test_a_checkpoint_without_the_open_log_interval_resumes_with_an_empty_one(caplog):
    """Files written before progress.interval was saved (all formats before it) load with an empty
    interval, said in one line; a malformed interval is refused by the schema, naming the field."""
    from trainers.training.progress import TrainingProgress

    old = schema.read(FIXTURE / "model_step4.pth")
    assert old.open_log_interval is None
    progress = TrainingProgress()
    progress.interval.steps = 3  # whatever was there before is dropped
    with caplog.at_level("INFO", logger="train"):
        progress.load_state_dict(old.section("progress"))
    assert progress.interval.steps == 0 and progress.interval.metrics.sums is None
    assert [r.getMessage() for r in caplog.records] == [
        "the checkpoint of step 4 holds no open log interval (written by an earlier version): the first train "
        "metrics logged after this resume average only the steps from 5 on"]
    content = old.to_file()
    content["progress"]["interval"] = {"sums": "0,0", "steps": 1, "seconds": 0.0, "lr": 0.0, "grad_norm": 0}
    with pytest.raises(schema.SchemaError, match="progress.interval.sums has type str"):
        schema.parse(content, FIXTURE / "edited", verify=False)


def test_a_format_1_checkpoint_resumes_bit_identically(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE / "model_step4.pth", run / "latest.pth")
    # The saved paths point to where the fixture was made; the same files are passed from here.
    resumed = train_here(run, "--resume", "auto", "--log-sample-ids", *small_corpus_flags(tmp_path / "data"))
    assert_resumed_to_step_8(resumed, run)


def test_a_format_1_checkpoint_resumes_with_one_data_root_for_its_saved_paths(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE / "model_step4.pth", run / "latest.pth")
    data = tmp_path / "data"
    shutil.copytree(FIXTURE / "data", data)
    # The saved manifests, tokenizer and config all lie under /tmp/fx1/data, where the fixture was made.
    resumed = train_here(run, "--resume", "auto", "--log-sample-ids", "--data-root", f"/tmp/fx1/data={data}")
    assert "input moved: --tokenizer /tmp/fx1/data/bpe.model -> " + str(data / "bpe.model") in resumed.stderr
    assert_resumed_to_step_8(resumed, run)


def assert_resumed_to_step_8(resumed, run: Path) -> None:
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "(step 4," in resumed.stderr
    assert "not verified: written before checksums existed (format 1)" in resumed.stderr
    assert "changes the result" not in resumed.stderr  # fingerprints and settings match the saved run
    assert "holds no open log interval (written by an earlier version)" in resumed.stderr
    new, old = final_state(run), schema.read(FIXTURE / "model_step8.pth")
    assert new.step == old.step == 8 and (new.epoch, new.step_in_epoch) == (old.epoch, old.step_in_epoch)
    assert new.model.keys() == old.model.keys()
    for key in old.model:
        assert torch.equal(new.model[key], old.model[key]), key
    assert _equal_nested(new.optimizer, old.optimizer)
    steps_5_to_8 = (FIXTURE / "sample_ids.tsv").read_text().splitlines()[4:]
    assert (run / "sample_ids.tsv").read_text().splitlines() == steps_5_to_8


def test_a_saved_continuation_of_the_old_kind_resumes_with_its_old_rates(tmp_path):
    """A checkpoint whose schedule holds --reconfigure-scheduler's continuation as versions before re-warms
    wrote it (no "kind"): it resumes on the rates that version gave it (see tests/test_lr_schedule.py)."""
    old_form = {"start_step": 4, "end_step": 12, "start_lr": 0.002799038105676658, "floor": 0.0}
    old_rates = [0.002799038105676658, 0.0026925060611152434, 0.0023891284655000854, 0.0019350918076388405,
                 0.001399519052838329, 0.0008639462980378179, 0.0004099096401765726, 0.00010653204456141481]
    at_4 = schema.read(FIXTURE / "model_step4.pth")
    edited = at_4.edited("optim", lr_schedule={**at_4.lr_schedule, "continuations": [old_form]})
    run = tmp_path / "run"
    run.mkdir()
    torch.save(edited.to_file(), run / "latest.pth")
    resumed = train_here(run, "--resume", "auto", "--max-steps", "12", "--log-interval", "1",
                         *small_corpus_flags(tmp_path / "data"))
    assert resumed.returncode == 0, resumed.stderr
    state = final_state(run)
    assert [h["lr"] for h in state.history if h["kind"] == "train" and h["step"] > 4] == old_rates
    assert state.lr_schedule["continuations"] == [old_form]
