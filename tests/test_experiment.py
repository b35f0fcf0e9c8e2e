"""trainers/experiment.py: the Python API drives the trainer's own entry point and keeps its guarantees."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.demo_runs import family_run, final_state, train_here
from trainers.experiment import ExperimentManager

FLAGS = ["--batch-size", "16", "--val-interval", "4", "--max-val-batches", "0", "--save-interval", "4",
         "--log-interval", "1", "--log-sample-ids", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def reference(demo_assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api") / "reference"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "12").returncode == 0
    return out


@pytest.fixture(scope="module")
def family_reference(family_assets, request, tmp_path_factory) -> Path:
    """`reference`, for each model family's demo."""
    return family_run(family_assets, request, "reference", tmp_path_factory, *FLAGS, "--max-steps", "12")


def test_an_unchanged_resume_through_the_api_is_bit_identical(family_assets, family_reference, tmp_path):
    """Each model family; its model loaded through the API evaluates a manifest as validation does."""
    demo_assets, reference = family_assets, family_reference
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "12", kill_at="SIGTERM@micro:6:0").returncode == 143
    exp = ExperimentManager.load(out)
    assert exp.checkpoint.step == 6 and exp.config.max_steps == 12
    assert exp.resume_training() == 0  # the original plan, exactly
    a, b = final_state(reference), final_state(out)
    assert b.step == 12 and all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert (out / "sample_ids.tsv").read_text() == (reference / "sample_ids.tsv").read_text()
    assert exp.checkpoint.step == 12  # the manager follows the run
    resumes = exp.metadata["resumes"]
    assert [r["kind"] for r in resumes] == ["start", "resume"] and resumes[1]["step"] == 6
    loaded = ExperimentManager.load_best_model(out)
    val = demo_assets[demo_assets.index("--val-manifest") + 1]
    assert loaded.family.name == family_assets.family and loaded.evaluate(val)["samples"] == 48
    assert loaded.evaluate(val)["mel_loss"] == pytest.approx(b.history[-1]["mel_loss"], rel=1e-5)


def test_more_epochs_match_the_command_line(demo_assets, reference, tmp_path):
    api, cli = tmp_path / "api", tmp_path / "cli"
    for out in (api, cli):
        assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "4", "--lr-decay-steps", "40").returncode == 0
    assert ExperimentManager.load(api).resume_training(num_epochs=1) == 0
    assert train_here(cli, "--resume", "auto", "--additional-epochs", "1").returncode == 0
    a, b = final_state(api), final_state(cli)
    assert a.step == b.step == 4 + 24 and all(torch.equal(a.model[k], b.model[k]) for k in a.model)


def test_reconfigured_schedule_is_continuous_and_a_batch_change_scales_the_rate(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "8").returncode == 0
    exp = ExperimentManager.load(out)
    assert exp.resume_training(num_epochs=1, reconfigure_scheduler=True) == 0
    lrs = {e["step"]: e["lr"] for e in exp.history["train"]}
    assert lrs[9] == lrs[8]  # the first new rate is the last old one
    assert exp.resume_training(batch_size=32, scale_lr="linear", num_epochs=1) == 0
    assert exp.config.effective_batch == 32 and exp.config.learning_rate == pytest.approx(2 * 3e-3)
    changes = exp.history["resumes"][-1]["changes"]
    assert any(c.startswith("effective_batch: saved 16, now 32") for c in changes)


def test_train_samples_through_the_api(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "24", "--val-interval", "0").returncode == 0
    exp = ExperimentManager.load(out)
    assert exp.checkpoint.epoch == 1  # at an epoch boundary: the new subset applies at once
    assert exp.resume_training(train_samples=64, num_epochs=2) == 0  # 2 epochs of 64 samples: 8 steps
    assert exp.config.train_samples == 64 and exp.checkpoint.step == 32
    for epoch in ("1", "2"):
        rows = [line.split("\t") for line in (out / "sample_ids.tsv").read_text().splitlines()
                if line.split("\t")[1] == epoch]
        ids = [s for _, _, step_ids in rows for s in step_ids.split(",")]
        assert len(ids) == len(set(ids)) == 64, epoch  # each epoch: the whole subset, once


def test_the_best_model_evaluates_as_validation_did(reference):
    best = ExperimentManager.load_best_model(reference)
    assert not best.model.training and best.tokenizer.get_piece_size() == 160
    exp = ExperimentManager.load(reference)
    at_best = [v for v in exp.history["val"] if v["step"] == best.step][0]
    assert exp.metadata["best"]["step"] == best.step
    val_manifest = Path(exp.config.val_manifests[0])
    scores = best.evaluate(val_manifest)
    assert scores["samples"] == 48
    for key in ("text_loss", "mel_loss", "mel_top1"):
        assert scores[key] == pytest.approx(at_best[key], rel=1e-5), key
    assert set(p.name for p in exp.checkpoints) >= {"latest.pth", "best.pth"}
