"""The length-grouped data order through the trainer: exact resume, split invariance, changes mid-epoch."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.demo_runs import assert_close_weights, final_state, train_here

FLAGS = ["--data-order", "grouped", "--effective-batch", "16", "--max-val-batches", "1", "--val-interval", "0",
         "--log-sample-ids", "--keep-checkpoints", "1", "--log-interval", "100", "--dropout", "0.1",
         "--lr-decay-steps", "30"]


def step_ids(run: Path) -> list[tuple[int, int, list[str]]]:
    rows = [line.split("\t") for line in (run / "sample_ids.tsv").read_text().splitlines()]
    return [(int(step), int(epoch), ids.split(",")) for step, epoch, ids in rows]


@pytest.fixture(scope="module")
def grouped_reference(demo_assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("grouped") / "run"
    done = train_here(out, *demo_assets, *FLAGS, "--batch-size", "8", "--max-steps", "30")
    assert done.returncode == 0, done.stderr
    assert "grouped order" in done.stderr
    return out


def test_grouped_order_resumes_bit_identically(demo_assets, grouped_reference, tmp_path):
    out = tmp_path / "run"
    stopped = train_here(out, *demo_assets, *FLAGS, "--batch-size", "8", "--max-steps", "30",
                         kill_at="SIGTERM@micro:11:1")
    assert stopped.returncode == 143, stopped.stderr
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    a, b = final_state(grouped_reference), final_state(out)
    assert a.step == b.step == 30
    assert all(a.model[k].equal(b.model[k]) for k in a.model)
    assert step_ids(out) == step_ids(grouped_reference)


def test_grouped_steps_do_not_depend_on_the_micro_batch(demo_assets, grouped_reference, tmp_path):
    out = tmp_path / "run"
    done = train_here(out, *demo_assets, *FLAGS, "--batch-size", "3", "--max-steps", "30")
    assert done.returncode == 0, done.stderr
    assert step_ids(out) == step_ids(grouped_reference)  # same samples, same order within each step
    assert_close_weights(grouped_reference, out)


def test_random_order_makes_other_steps(demo_assets, grouped_reference, tmp_path):
    out = tmp_path / "run"
    done = train_here(out, *demo_assets, *FLAGS, "--data-order", "random", "--batch-size", "8", "--max-steps", "2")
    assert done.returncode == 0, done.stderr
    assert step_ids(out)[:2] != step_ids(grouped_reference)[:2]


def test_effective_batch_change_mid_epoch_repeats_and_skips_no_sample(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "5").returncode == 0  # 80 of 384 samples
    changed = train_here(out, "--resume", "auto", "--effective-batch", "24", "--allow-config-change",
                         "--max-steps", "0", "--epochs", "1")
    assert changed.returncode == 0, changed.stderr
    assert "resuming epoch 0 at sample 80 (step 3); no sample of this epoch is repeated or skipped" in changed.stderr
    epoch0 = [sample for _, epoch, ids in step_ids(out) if epoch == 0 for sample in ids]
    assert len(epoch0) == len(set(epoch0)) == 384  # every sample of the epoch once
    assert [len(ids) for _, _, ids in step_ids(out)] == [16] * 5 + [24] * 12 + [16]  # the rest, 304, cut anew
    assert final_state(out).epoch == 1
