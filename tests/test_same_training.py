"""tests/demo_runs.py::assert_same_training, the one bit-identity check every resume test uses, catches each
kind of difference a broken resume leaves behind, and accepts an exact copy.

There were three copies of different strength: two of them compared only the optimizer's per-parameter
state (not its param groups, where the learning rate lives), neither the logged history nor TensorBoard's
scalars, and the third not the sample counts. Each case below changes one thing in a copy of a real run.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.demo_runs import assert_same_training, final_state, small_corpus_flags, train_here
from trainers.checkpoint import schema

STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("same_training")
    out = root / "run"
    flags = [*small_corpus_flags(root / "data"), "--effective-batch", "4", "--warmup-steps", "1", "--val-interval", "0",
             "--log-interval", "1", "--log-sample-ids", "--max-steps", str(STEPS)]
    done = train_here(out, *flags)
    assert done.returncode == 0, done.stderr
    return out


def _rewrite(run: Path, section: str, change: Callable[[dict], dict]) -> None:
    """latest.pth (a hard link to the newest checkpoint) replaced by a file with one section field changed,
    checksums recomputed: only the changed value differs."""
    ckpt = final_state(run)
    field, value = next(iter(change(ckpt.sections[section]).items()))
    (run / "latest.pth").unlink()
    torch.save(ckpt.edited(section, **{field: value}).to_file(), run / "latest.pth")
    assert schema.read(run / "latest.pth").verified


def _learning_rate(optim: dict) -> dict:
    optimizer = {**optim["optimizer"], "param_groups": [dict(g) for g in optim["optimizer"]["param_groups"]]}
    optimizer["param_groups"][0]["lr"] *= 1.5
    return {"optimizer": optimizer}


def _one_ulp_in_a_moment(optim: dict) -> dict:
    state = {k: dict(v) for k, v in optim["optimizer"]["state"].items()}
    first = next(iter(state))
    moment = state[first]["exp_avg"].clone()
    moment.view(-1)[0] = torch.nextafter(moment.view(-1)[0], torch.tensor(float("inf")))
    state[first]["exp_avg"] = moment
    return {"optimizer": {**optim["optimizer"], "state": state}}


def _a_logged_loss(progress: dict) -> dict:
    history = [dict(e) for e in progress["history"]]
    entry = next(e for e in history if e["kind"] == "train")
    entry["mel_loss"] += 1e-3
    return {"history": history}


def _samples_seen(progress: dict) -> dict:
    return {"samples_seen": progress["samples_seen"] + 1}


def _numpy_rng(rng: dict) -> dict:
    keys = rng["numpy"]["keys"].clone()
    keys[0] += 1
    return {"numpy": {**rng["numpy"], "keys": keys}}


CHECKPOINT_CHANGES = {
    "the learning rate in the optimizer's param groups": ("optim", _learning_rate, r"optimizer\.param_groups\[0\]\.lr"),
    "one ulp in an AdamW moment": ("optim", _one_ulp_in_a_moment, r"optimizer\.state\.\d+\.exp_avg differs"),
    "a logged loss": ("progress", _a_logged_loss, "the logged train/val history differs"),
    "the samples seen": ("progress", _samples_seen, "samples seen\\) differ"),
    "numpy's saved random state": ("rng", _numpy_rng, r"rng\.numpy\.keys differs"),
}


def _copy(run: Path, to: Path) -> Path:
    subprocess.run(["cp", "-a", str(run), str(to)], check=True)  # -a: latest.pth stays a hard link
    return to


def test_an_exact_copy_is_the_same_training(run, tmp_path):
    assert_same_training(run, _copy(run, tmp_path / "copy"), STEPS)


@pytest.mark.parametrize("what", list(CHECKPOINT_CHANGES))
def test_a_changed_checkpoint_value_is_caught(run, tmp_path, what):
    section, change, message = CHECKPOINT_CHANGES[what]
    copy = _copy(run, tmp_path / "copy")
    _rewrite(copy, section, change)
    with pytest.raises(AssertionError, match=message):
        assert_same_training(run, copy, STEPS)


def test_changed_sample_ids_are_caught(run, tmp_path):
    copy = _copy(run, tmp_path / "copy")
    lines = (copy / "sample_ids.tsv").read_text().splitlines(keepends=True)
    (copy / "sample_ids.tsv").write_text("".join([lines[1], lines[0], *lines[2:]]))
    with pytest.raises(AssertionError, match="sample_ids.tsv differs"):
        assert_same_training(run, copy, STEPS)


def test_missing_tensorboard_scalars_are_caught(run, tmp_path):
    copy = _copy(run, tmp_path / "copy")
    shutil.rmtree(copy / "logs")
    (copy / "logs").mkdir()
    with pytest.raises(AssertionError, match="TensorBoard's train scalars differ"):
        assert_same_training(run, copy, STEPS)
