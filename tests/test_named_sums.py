"""The open log interval's sums are saved by name, so a version that adds a metric resumes a checkpoint saved in
the middle of an interval by an earlier one.

tests/fixtures/open_interval_run holds step 3 of a run that logs every 4 steps, written by the release that saved
the sums as a list (by position). Adding a metric to that release made its resume of such a checkpoint crash
(IndexError, exit 1). Here a metric is added the way a new one would be (the model's loss sums give one more,
the log sums it), and the fixture, and a checkpoint saved mid-interval by this version, are resumed with it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.demo_runs import assert_equal_nested, final_state, logged_metrics, train_here
from tests.fixtures.open_interval_run.make_fixture import FINAL_STEP, FLAGS, KEPT_STEP, LOG_INTERVAL, data_flags
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.training import train_log

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "open_interval_run"
V1_DATA = Path(__file__).resolve().parent / "fixtures" / "v1_run" / "data"
BASE = Path(__file__).resolve().parent / "fixtures" / "pre_seam_run" / "base_gpt.pth"


@pytest.fixture
def one_more_metric(monkeypatch: pytest.MonkeyPatch) -> None:
    """A metric added as a new one would be: the model's loss sums give it and the log sums it."""
    loss_sums = UnifiedVoiceGPT._loss_sums

    def with_extra(self, *args, **kwargs):
        sums = loss_sums(self, *args, **kwargs)
        return {**sums, "text_correct": torch.zeros((), dtype=torch.int64, device=sums["text_tokens"].device)}

    monkeypatch.setattr(UnifiedVoiceGPT, "_loss_sums", with_extra)
    monkeypatch.setattr(train_log, "SUMS", (*train_log.SUMS, "text_correct"))


def _resume(checkpoint: Path, out: Path, inputs: list[str]) -> str:
    """The checkpoint resumed to the run's end in a directory of its own; the log."""
    out.mkdir()
    shutil.copy(checkpoint, out / "latest.pth")
    done = train_here(out, "--resume", "auto", *inputs, *FLAGS)
    assert done.returncode == 0, done.stderr
    return done.stderr


def _assert_same_end(a: Path, b: Path) -> None:
    sa, sb = final_state(a), final_state(b)
    assert sa.step == sb.step == FINAL_STEP
    for name in ("model", "optim"):
        assert_equal_nested(sa.section(name), sb.section(name), name)
    assert logged_metrics(sa.history) == logged_metrics(sb.history)


def test_an_interval_saved_by_position_or_by_name_resumes_with_one_more_metric(tmp_path, request):
    data = tmp_path / "inputs"
    shutil.copytree(V1_DATA, data / "data")
    shutil.copy(BASE, data / "base_gpt.pth")
    inputs = data_flags(data / "data", data / "base_gpt.pth")
    fixture = FIXTURE / f"model_step{KEPT_STEP}.pth"
    saved = torch.load(fixture, weights_only=True)["progress"]["interval"]
    assert isinstance(saved["sums"], list) and saved["steps"] == KEPT_STEP % LOG_INTERVAL  # by position, mid-interval

    _resume(fixture, tmp_path / "plain", inputs)
    plain = tmp_path / "plain"
    assert [e["step"] for e in final_state(plain).history if e["kind"] == "train"] == [4, 8]
    assert schema_interval(plain / "model_step6.pth")["steps"] == 2  # this version's checkpoint, mid-interval too
    request.getfixturevalue("one_more_metric")
    # The release's checkpoint (sums by position), then this version's (by name): both resume with the metric
    # added, the interval open at the save logged as without it.
    log = _resume(fixture, tmp_path / "old", inputs)
    assert "the saved log interval lacks text_correct" in log
    _assert_same_end(plain, tmp_path / "old")
    _resume(plain / "model_step6.pth", tmp_path / "new", inputs)
    _assert_same_end(plain, tmp_path / "new")


def schema_interval(path: Path) -> dict:
    return torch.load(path, weights_only=True)["progress"]["interval"]
