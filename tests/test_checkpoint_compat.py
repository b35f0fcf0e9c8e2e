"""Checkpoints written by earlier versions of the trainer still resume exactly.

tests/fixtures/v1_run holds a run made by the last version that wrote checkpoint format 1
(see its README): its step-4 checkpoint is resumed by today's trainer to step 8. What does not depend
on the CPU (steps, data position, sample ids, settings, random-number state) must equal the step-8
checkpoint the old version wrote; its floats were computed on another CPU, so the weights are compared
with it within float rounding only, and bit for bit with other resumes of the same state made here, in
the same test (an interrupted one, one through --data-root).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.demo_runs import assert_equal_nested, final_state, logged_metrics, small_corpus_flags, train_here
from tests.test_lr_schedule import old_continuation_rates
from trainers.checkpoint import schema

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "v1_run"


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
        "the checkpoint of step 4 holds no open log interval (written by an earlier version):",
        "the first train metrics logged after this resume average only the steps from 5 on"]
    content = old.to_file()
    content["progress"]["interval"] = {"sums": "0,0", "steps": 1, "seconds": 0.0, "lr": 0.0, "grad_norm": 0}
    with pytest.raises(schema.SchemaError, match="progress.interval.sums has type str"):
        schema.parse(content, FIXTURE / "edited", verify=False)


@pytest.fixture(scope="module")
def resumed_here(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture's step-4 checkpoint resumed to step 8 by today's trainer, in one go, on this machine."""
    run = tmp_path_factory.mktemp("v1") / "run"
    run.mkdir()
    shutil.copy(FIXTURE / "model_step4.pth", run / "latest.pth")
    # The saved paths point to where the fixture was made; the same files are passed from here.
    resumed = train_here(run, "--resume", "auto", "--log-sample-ids",
                         *small_corpus_flags(run.parent / "data"))
    assert_resumed_to_step_8(resumed, run)
    return run


def test_a_format_1_checkpoint_resumes_bit_identically(resumed_here, tmp_path):
    """Stopped by SIGTERM in step 7 (the step is finished and saved in today's format) and resumed again: the
    same bits at step 8 as the resume in one go, so nothing of the old run's state is lost on the way."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE / "model_step4.pth", run / "latest.pth")
    flags = ("--log-sample-ids", *small_corpus_flags(tmp_path / "data"))
    stopped = train_here(run, "--resume", "auto", *flags, kill_at="SIGTERM@micro:7:0")
    assert stopped.returncode == 143, stopped.stderr
    assert final_state(run).step == 7 and final_state(run).format_version == schema.VERSION
    again = train_here(run, "--resume", "auto", *flags)
    assert again.returncode == 0, again.stderr
    assert_same_resumed_training(resumed_here, run)


def test_a_format_1_checkpoint_resumes_with_one_data_root_for_its_saved_paths(resumed_here, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE / "model_step4.pth", run / "latest.pth")
    data = tmp_path / "data"
    shutil.copytree(FIXTURE / "data", data)
    # The saved manifests, tokenizer and config all lie under /tmp/fx1/data, where the fixture was made.
    resumed = train_here(run, "--resume", "auto", "--log-sample-ids", "--data-root", f"/tmp/fx1/data={data}")
    assert "input moved: --tokenizer /tmp/fx1/data/bpe.model -> " + str(data / "bpe.model") in resumed.stderr
    assert_resumed_to_step_8(resumed, run)
    assert_same_resumed_training(resumed_here, run)


# The old version's step 8 was computed on another CPU: equal there, here only within float rounding. On an
# AVX2-only CPU 21 of its 25 tensors differ by up to 7.5e-8 (ATEN_CPU_CAPABILITY=avx2 reproduces it); a wrong
# setting moves them far more: a learning rate 0.3% off by 1.6e-5, v2 dropout masks by 5e-3.
ROUNDING = {"rtol": 1e-5, "atol": 1e-6}


def assert_resumed_to_step_8(resumed, run: Path) -> None:
    """What does not depend on the CPU equals the old version's step 8 exactly (steps, data position, samples,
    settings, random-number state, AdamW's step counts and groups); the floats only within rounding."""
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "(step 4," in resumed.stderr
    assert "not verified: written before checksums existed (format 1)" in resumed.stderr
    assert "changes the result" not in resumed.stderr  # fingerprints and settings match the saved run
    assert "holds no open log interval (written by an earlier version)" in resumed.stderr
    new, old = final_state(run), schema.read(FIXTURE / "model_step8.pth")
    assert (new.step, new.samples_seen) == (old.step, old.samples_seen) == (8, 32)
    assert {k: new.sections["data"][k] for k in old.sections["data"]} == old.sections["data"]
    steps_5_to_8 = (FIXTURE / "sample_ids.tsv").read_text().splitlines()[4:]
    assert (run / "sample_ids.tsv").read_text().splitlines() == steps_5_to_8
    assert new.settings["dropout_masks"] == "v1"
    old_settings = {**old.settings, "amp": "off"}  # format 1 wrote amp as a bool: False is today's "off"
    assert {k: v for k, v in new.settings.items() if k in old_settings and k not in PATHS} == \
        {k: v for k, v in old_settings.items() if k not in PATHS}
    assert_equal_nested(new.sections["rng"], old.sections["rng"], "rng")
    assert new.model.keys() == old.model.keys()
    for key in old.model:
        torch.testing.assert_close(new.model[key], old.model[key], **ROUNDING, msg=key)
    (new_state, new_groups), (old_state, old_groups) = (
        (s.optimizer["state"], s.optimizer["param_groups"]) for s in (new, old))
    assert new_state.keys() == old_state.keys()
    for i in old_state:
        assert new_state[i].keys() == old_state[i].keys()
        assert torch.equal(new_state[i]["step"], old_state[i]["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(new_state[i][name], old_state[i][name], **ROUNDING, msg=f"{i}.{name}")
    assert new_groups == [{**g, "lr": pytest.approx(g["lr"], rel=1e-12)} for g in old_groups]  # math.cos's rate
    # The logged metrics: steps 1-4 carried over as saved, steps 5-8 (losses, grad norms) within rounding; what
    # the old version did not measure (the forgetting measure, from the first validation after the resume) aside.
    added = ("forgetting", "forgetting_guard")
    assert [{k: v for k, v in e.items() if k not in added} for e in new.history if e["kind"] in ("train", "val")] == [
        {k: pytest.approx(v, rel=ROUNDING["rtol"]) if isinstance(v, float) else v for k, v in e.items()}
        for e in old.history]


PATHS = {"train_manifests", "val_manifests", "tokenizer", "config", "output_dir"}  # where each run's files lie


def assert_same_resumed_training(a: Path, b: Path) -> None:
    """Two resumes of the fixture made here: the same bits at step 8, the same samples, the same logged metrics."""
    sa, sb = final_state(a), final_state(b)
    assert sa.verified and sb.verified and sa.step == sb.step == 8
    assert (sa.epoch, sa.step_in_epoch, sa.samples_in_epoch) == (sb.epoch, sb.step_in_epoch, sb.samples_in_epoch)
    assert_equal_nested(sa.model, sb.model, "model")
    assert_equal_nested(sa.optimizer, sb.optimizer, "optimizer")
    assert_equal_nested(sa.sections["rng"], sb.sections["rng"], "rng")
    assert (a / "sample_ids.tsv").read_text() == (b / "sample_ids.tsv").read_text()
    assert logged_metrics(sa.history) == logged_metrics(sb.history)


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
    rates = [h["lr"] for h in state.history if h["kind"] == "train" and h["step"] > 4]
    assert rates == old_continuation_rates(**old_form, steps=range(4, 12))  # the old formula, computed here
    assert rates == pytest.approx(old_rates, rel=1e-12, abs=0.0)  # what that version printed, on another machine
    assert state.lr_schedule["continuations"] == [old_form]
