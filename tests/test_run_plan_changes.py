"""Changing a run's plan on resume: more epochs, a scaled learning rate, another number of training samples; a
change killed before the continuation's first save is continued by `--resume auto` alone."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.demo_runs import assert_same_training, final_state, train, train_here
from tests.test_checkpoint_integrity import copy_run

FLAGS = ["--batch-size", "16", "--val-interval", "0", "--max-val-batches", "1", "--save-interval", "100",
         "--log-interval", "100", "--log-sample-ids", "--lr-decay-steps", "40"]


def step_ids(run: Path) -> list[tuple[int, int, list[str]]]:
    rows = [line.split("\t") for line in (run / "sample_ids.tsv").read_text().splitlines()]
    return [(int(step), int(epoch), ids.split(",")) for step, epoch, ids in rows]


def test_additional_epochs_train_that_many_epochs_of_data_from_here(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "5").returncode == 0
    more = train_here(out, "--resume", "auto", "--additional-epochs", "1")
    assert more.returncode == 0, more.stderr
    assert "--additional-epochs 1: training to step 29 (24 more steps from step 5, epoch 0)" in more.stderr
    state = final_state(out)
    assert (state.step, state.epoch, state.samples_in_epoch) == (29, 1, 5 * 16)  # one epoch of data later
    again = train_here(out, "--resume", "auto")  # the new end was saved with the run
    assert again.returncode == 0 and "nothing to do: the run is already at step 29" in again.stderr
    refused = train_here(out, "--resume", "auto", "--additional-epochs", "1", "--max-steps", "99")
    assert refused.returncode == 2 and "without --max-steps and --epochs" in refused.stderr


def test_scale_lr_follows_an_effective_batch_change(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "4").returncode == 0
    refused = train_here(out, "--resume", "auto", "--scale-lr", "linear")
    assert refused.returncode == 2 and "follows a change of the effective batch" in refused.stderr
    for how, lr in (("linear", 6e-3), ("sqrt", 3e-3 * 2 ** 0.5)):
        run = tmp_path / how
        assert train_here(run, *demo_assets, *FLAGS, "--max-steps", "4").returncode == 0
        scaled = train_here(run, "--resume", "auto", "--effective-batch", "32", "--allow-config-change",
                            "--scale-lr", how, "--max-steps", "6")
        assert scaled.returncode == 0, scaled.stderr
        assert f"--scale-lr {how}: learning rate 0.003 -> " in scaled.stderr
        assert final_state(run).settings["learning_rate"] == pytest.approx(lr)


def test_a_training_subset_change_takes_effect_at_the_next_epoch(demo_assets, tmp_path):
    out = tmp_path / "run"
    # 100 of the 384 samples: 7 steps per epoch (6 x 16 + 4).
    assert train_here(out, *demo_assets, *FLAGS, "--train-samples", "100", "--max-steps", "3").returncode == 0
    changed = train_here(out, "--resume", "auto", "--train-samples", "200", "--allow-config-change",
                         "--max-steps", "20")
    assert changed.returncode == 0, changed.stderr
    assert "training samples changed from 100 to 200: the rest of epoch 0 keeps its 100 samples" in changed.stderr
    rows = step_ids(out)
    epoch0 = [s for _, epoch, ids in rows if epoch == 0 for s in ids]
    epoch1 = [s for _, epoch, ids in rows if epoch == 1 for s in ids]
    assert len(epoch0) == len(set(epoch0)) == 100  # no sample repeated or skipped in the changed epoch
    assert len(epoch1) == len(set(epoch1)) == 200 and set(epoch0) <= set(epoch1)  # a larger subset keeps the smaller
    assert [len(ids) for _, epoch, ids in rows if epoch == 1] == [16] * 12 + [8]
    too_many = train_here(tmp_path / "x", *FLAGS, *demo_assets, "--train-samples", "385")
    assert too_many.returncode == 2 and "hold 384 samples" in too_many.stderr


# The plan: a finished 12-step run trained on to step 20 with a re-warm.
FINISHED = ["--max-steps", "12", "--save-interval", "4", "--keep-checkpoints", "2", "--val-interval", "4",
            "--batch-size", "8", "--log-sample-ids", "--log-interval", "4"]
LONGER = ["--max-steps", "20", "--rewarm", "--rewarm-steps", "4"]


@pytest.mark.parametrize("kill_at", ["setup", "micro:14:1"])
def test_a_plan_change_killed_before_its_first_save_is_continued_by_resume_auto_alone(demo_assets, tmp_path, kill_at):
    """The new end and the re-warm are durable once the command is accepted (run_config.json's plan record, before
    the first step): killed before the continuation saved anything, `--resume auto` alone trains the continuation,
    bit-identically, instead of saying "nothing to do" at the old end."""
    finished = tmp_path / "finished"
    assert train_here(finished, *demo_assets, *FINISHED).returncode == 0
    reference = copy_run(finished, tmp_path / "reference")
    done = train_here(reference, "--resume", "auto", *LONGER)
    assert done.returncode == 0, done.stderr
    out = copy_run(finished, tmp_path / "run")
    killed = train(out, "--resume", "auto", *LONGER, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert final_state(out).step == 12 and not (out / "model_step16.pth").exists()  # no save of the continuation
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing the plan the last start accepted for latest.pth" in resumed.stderr
    assert "INFO   max_steps 12 -> 20\n" in resumed.stderr  # one change a line
    assert "INFO   learning rate from step 12 a re-warm" in resumed.stderr
    assert_same_training(reference, out, 20)


def test_a_plan_record_that_fails_its_checksum_is_refused(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FINISHED).returncode == 0
    stopped = train_here(out, "--resume", "auto", *LONGER, kill_at="SIGTERM@setup")  # accepted, then stopped
    assert stopped.returncode == 143, stopped.stderr
    record = json.loads((out / "run_config.json").read_text())
    assert record["plan"]["continues"]["step"] == 12 and record["config"]["max_steps"] == 20
    record["config"]["max_steps"] = 40  # edited by hand, the sha256 left as it was
    (out / "run_config.json").write_text(json.dumps(record))
    refused = train_here(out, "--resume", "auto")
    assert refused.returncode == 2, refused.stderr
    assert f"{out / 'run_config.json'} does not match the sha256 written with it" in refused.stderr
    assert final_state(out).step == 12
