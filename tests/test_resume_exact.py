"""Stopping and resuming never changes the result.

Each test runs the real entry point on the demo config and compares the final checkpoint of an
interrupted-and-resumed run with one uninterrupted run, tensor by tensor. Kills are real
SIGKILLs of a trainer process at exact points (trainers/faults.py); signals the
trainer handles (SIGTERM, SIGINT) and refusals run in this process (tests/demo_runs.py).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.demo_runs import (REPO, assert_close_weights, assert_same_training, family_run, final_state, subprocess_env,
                             train, train_here, train_scalars)
from tests.test_best_checkpoint import FLAGS as BEST_FLAGS, OVERSHOOTING
from tests.trainer_process import TrainerProcess
from trainers.run.lock import LOCK_NAME

STEPS = 40  # the demo corpus has 384 samples: 24 steps per epoch at effective batch 16
# Log interval 10: most resumes below land mid-interval, and the logged history must match too.
COMMON = ["--batch-size", "8", "--grad-accumulation", "2", "--max-steps", str(STEPS), "--save-interval", "6",
          "--val-interval", "0", "--max-val-batches", "1", "--log-sample-ids", "--dropout", "0.1",
          "--keep-checkpoints", "2", "--log-interval", "10"]


@pytest.fixture(scope="module")
def reference(demo_assets: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    result = train_here(out, *demo_assets, *COMMON)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def family_reference(family_assets, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`reference`, for each model family's demo (tests taking `family_assets` run over both families)."""
    return family_run(family_assets, request, "reference", tmp_path_factory, *COMMON)


# Kill points in run order, each with the checkpoint the next invocation must resume from.
KILLS = [
    ("micro:3:1", None),                          # before the first checkpoint: restarts from the saved settings
    ("step:10", "model_step6.pth"),               # mid-epoch, between checkpoints
    ("micro:15:0", "model_step12.pth"),           # mid gradient accumulation
    ("save:18:tmp_written", "model_step12.pth"),  # during a checkpoint write
    ("step:24", "model_step24.pth"),              # right after the epoch boundary (epoch 0 has 24 steps)
    ("save:30:renamed", "model_step30.pth"),      # checkpoint complete, latest.pth not yet updated
]


def test_sigkill_again_and_again_then_resume_auto_is_bit_identical(family_assets, family_reference, tmp_path):
    """One run killed at every point above in turn, each resumed run killed at the next one (each model family)."""
    out = tmp_path / "run"
    killed = train(out, *family_assets, *COMMON, kill_at=KILLS[0][0])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    next_kills = [k for k, _ in KILLS[1:]] + [None]
    for (kill_at, resumes_from), next_kill in zip(KILLS, next_kills):
        if kill_at == "save:18:tmp_written":
            assert_killed_write_never_became_latest(out)
        # The run directory alone is enough; the last resume runs to the end in this process.
        resumed = train(out, "--resume", "auto", kill_at=next_kill) if next_kill else train_here(out, "--resume", "auto")
        where = f"resuming after the kill at {kill_at}"
        assert resumed.returncode == (-signal.SIGKILL if next_kill else 0), f"{where}:\n{resumed.stderr}"
        if resumes_from is None:
            assert "no checkpoint yet" in resumed.stderr, where
        else:
            step = int(resumes_from.removeprefix("model_step").removesuffix(".pth"))
            assert f"(step {step}," in resumed.stderr, where
        assert " WARNING " not in resumed.stderr, f"{where}: a healthy resume printed a warning"
        if kill_at == "save:18:tmp_written":  # the resumed trainer removed the killed save's partial file
            assert not any(".tmp" in p.name for p in out.iterdir()), where
    assert_same_training(family_reference, out, STEPS)


def assert_killed_write_never_became_latest(out: Path) -> None:
    assert final_state(out).step == 12  # the older complete checkpoint is still the one latest.pth names
    assert not (out / "model_step18.pth").exists()
    assert any(p.name.startswith(".model_step18.pth.tmp") for p in out.iterdir())  # the partial file
    assert (out / "model_step6.pth").exists() and (out / "model_step12.pth").exists()


def test_a_kill_between_the_final_saves_rename_and_link_is_repaired_by_the_resume(demo_assets, tmp_path):
    """Killed after the last model_step file is in place, before latest.pth names it: the resume has nothing to
    train, and still leaves latest.pth naming the newest checkpoint, for every tool that reads it. (The overshooting
    rate keeps best.pth at step 3, so the kill lands in the final model_step12.pth save, not in a best.pth save.)"""
    out = tmp_path / "run"
    plan = [*BEST_FLAGS, *OVERSHOOTING, "--max-steps", "12"]
    killed = train(out, *demo_assets, *plan, kill_at="save:12:renamed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "model_step12.pth").is_file() and final_state(out).step == 9
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "nothing to do: the run is already at step 12" in resumed.stderr
    assert "latest.pth named model_step9.pth, behind model_step12.pth" in resumed.stderr
    assert os.path.samefile(out / "latest.pth", out / "model_step12.pth") and final_state(out).step == 12
    again = train_here(out, "--resume", "auto")  # a healthy directory: nothing to repair, nothing said
    assert again.returncode == 0 and "behind" not in again.stderr


def test_a_finished_run_resumed_with_fewer_checkpoints_kept_keeps_that_many(demo_assets, tmp_path):
    """`--resume auto --keep-checkpoints 1` on a run already at --max-steps ("nothing to do") left its three
    model_step files: only a save rotated them. The run directory ends as a run with that setting leaves it,
    latest.pth (the newest checkpoint) untouched; with 0, latest.pth alone."""
    out = tmp_path / "run"
    done = train_here(out, *demo_assets, "--max-steps", "3", "--save-interval", "1", "--keep-checkpoints", "3",
                      "--val-interval", "0")
    assert done.returncode == 0, done.stderr
    steps = lambda: sorted(p.name for p in out.glob("model_step*.pth"))  # noqa: E731
    assert steps() == ["model_step1.pth", "model_step2.pth", "model_step3.pth"]
    for keep, left in (("1", ["model_step3.pth"]), ("0", [])):
        resumed = train_here(out, "--resume", "auto", "--keep-checkpoints", keep)
        assert resumed.returncode == 0 and "nothing to do: the run is already at step 3" in resumed.stderr, \
            resumed.stderr
        assert steps() == left and final_state(out).step == 3, resumed.stderr
    again = train_here(out, "--resume", "auto", "--max-steps", "4")  # and it goes on from there
    assert again.returncode == 0 and final_state(out).step == 4, again.stderr


def scramble_global_generators(seed: int) -> None:
    """The global generators as another process would start them (numpy, Python and torch seed from the OS):
    the states a checkpoint saves must be the run's all the same (assert_same_training compares them)."""
    np.random.seed(seed)
    random.seed(seed)
    torch.manual_seed(seed)


def test_sigterm_saves_at_the_step_boundary_and_resumes_exactly(demo_assets, reference, tmp_path):
    out = tmp_path / "run"
    scramble_global_generators(1)
    stopped = train_here(out, *demo_assets, *COMMON, kill_at="SIGTERM@micro:9:0")
    assert stopped.returncode == 143, stopped.stderr
    assert final_state(out).step == 9  # the step in progress was finished, then saved
    scramble_global_generators(2)
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_training(reference, out, STEPS)


def test_other_micro_batch_same_effective_batch(demo_assets, reference, tmp_path):
    out = tmp_path / "run"
    first = train_here(out, *demo_assets, *COMMON, "--max-steps", "12", "--lr-decay-steps", str(STEPS))
    assert first.returncode == 0, first.stderr
    # Another micro-batch and data workers: only the split and the loading change.
    resumed = train_here(out, "--resume", "auto", "--batch-size", "4", "--num-workers", "2", "--max-steps", str(STEPS))
    assert resumed.returncode == 0, resumed.stderr
    assert "grad_accumulation" in resumed.stderr  # the changed split is listed
    assert (out / "sample_ids.tsv").read_text() == (reference / "sample_ids.tsv").read_text()
    assert_close_weights(reference, out)


def test_exactness_breaking_change_is_refused(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *COMMON, "--max-steps", "6").returncode == 0
    refused = train_here(out, "--resume", "auto", "--seed", "7")
    assert refused.returncode == 2
    assert "seed" in refused.stderr and "--allow-config-change" in refused.stderr
    refused = train_here(out, "--resume", "auto", "--effective-batch", "32")
    assert refused.returncode == 2 and "effective_batch" in refused.stderr
    allowed = train_here(out, "--resume", "auto", "--seed", "7", "--allow-config-change", "--max-steps", "8")
    assert allowed.returncode == 0, allowed.stderr
    assert final_state(out).step == 8


def test_two_starts_without_a_base_checkpoint_begin_from_the_same_weights(demo_assets, tmp_path):
    """Random initial weights come from --seed: they used to come from the process's global generator, so the same
    command gave another model each time (and another after anything else had drawn from it)."""
    flags = [*demo_assets[1:demo_assets.index("--base-checkpoint")], "--config", str(REPO / "checkpoints" / "demo.yaml"),
             "--max-steps", "1", "--val-interval", "0", "--effective-batch", "8"]
    first, second = tmp_path / "a", tmp_path / "b"
    assert train_here(first, *flags).returncode == 0
    torch.rand(3)  # anything else drawing from the global generator in between
    assert train_here(second, *flags).returncode == 0
    a, b = final_state(first).model, final_state(second).model
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_accepted_optimizer_change_is_what_the_continuation_trains_with(demo_assets, tmp_path):
    """AdamW's load_state_dict puts the saved weight decay back: the change was recorded and logged, never used."""
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *COMMON, "--max-steps", "4").returncode == 0
    allowed = train_here(out, "--resume", "auto", "--weight-decay", "0.05", "--allow-config-change", "--max-steps", "5")
    assert allowed.returncode == 0, allowed.stderr
    decay, no_decay = final_state(out).section("optim")["optimizer"]["param_groups"]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert final_state(out).section("run")["config"]["weight_decay"] == 0.05


def test_max_steps_end_saves_true_position_and_extends(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *COMMON, "--max-steps", "20", "--lr-decay-steps", str(STEPS)).returncode == 0
    state = final_state(out)
    assert (state.step, state.epoch, state.step_in_epoch) == (20, 0, 20)
    again = train_here(out, "--resume", "auto")
    assert again.returncode == 0 and "nothing to do" in again.stderr
    extended = train_here(out, "--resume", "auto", "--max-steps", str(STEPS))
    assert extended.returncode == 0, extended.stderr
    assert final_state(out).step == STEPS


def test_fresh_start_refuses_to_overwrite_an_existing_run(demo_assets, reference):
    before = (reference / "latest.pth").read_bytes()
    refused = train_here(reference, *demo_assets, *COMMON)
    assert refused.returncode == 2 and "--resume auto" in refused.stderr
    assert (reference / "latest.pth").read_bytes() == before


def test_resume_from_an_explicit_older_checkpoint(demo_assets, reference, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *COMMON, "--max-steps", "10", "--lr-decay-steps", str(STEPS)).returncode == 0
    resumed = train_here(out, "--resume", str(out / "model_step6.pth"), "--max-steps", str(STEPS))
    assert resumed.returncode == 0, resumed.stderr
    assert "(step 6," in resumed.stderr
    assert_same_training(reference, out, STEPS)


def test_more_epochs_continue_where_the_last_epoch_ended(demo_assets, tmp_path):
    out = tmp_path / "run"
    first = train_here(out, *demo_assets, *COMMON, "--max-steps", "0", "--epochs", "1", "--lr-decay-steps", "48")
    assert first.returncode == 0, first.stderr
    state = final_state(out)
    assert (state.step, state.epoch, state.step_in_epoch) == (24, 1, 0)
    more = train_here(out, "--resume", "auto", "--epochs", "2")
    assert more.returncode == 0, more.stderr
    state = final_state(out)
    assert (state.step, state.epoch, state.step_in_epoch) == (48, 2, 0)
    steps = [int(line.split("\t")[0]) for line in (out / "sample_ids.tsv").read_text().splitlines()]
    assert steps == list(range(1, 49))


def test_failed_resume_check_stops_unless_forced(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *COMMON, "--max-steps", "6").returncode == 0
    ckpt = final_state(out)
    shapes = ckpt.param_shapes
    shapes[0][1] = [1, 2, 3]  # as if the optimizer covered a differently shaped tensor
    (out / "latest.pth").unlink()
    (out / "model_step6.pth").unlink()
    torch.save(ckpt.edited("optim", param_shapes=shapes).to_file(), out / "latest.pth")
    refused = train_here(out, "--resume", "auto", "--max-steps", "8")
    assert refused.returncode == 2
    assert "resume checks" in refused.stderr and "--force-resume" in refused.stderr
    forced = train_here(out, "--resume", "auto", "--max-steps", "8", "--force-resume")
    assert forced.returncode == 0, forced.stderr
    assert final_state(out).step == 8


def test_sigint_finishes_the_step_saves_and_exits_130(demo_assets, tmp_path):
    out = tmp_path / "run"
    stopped = train_here(out, *demo_assets, *COMMON, kill_at="SIGINT@micro:3:0")
    assert stopped.returncode == 130, stopped.stderr
    assert final_state(out).step == 3
    assert "--resume auto" in stopped.stderr


def test_ctrl_c_to_the_process_group_with_data_workers(demo_assets, reference, tmp_path):
    """A terminal's Ctrl-C reaches the workers too; the main process alone must handle it."""
    out = tmp_path / "run"
    proc = TrainerProcess(["--output-dir", str(out), *demo_assets, *COMMON, "--num-workers", "2"], subprocess_env(),
                          new_session=True)
    before = proc.wait_for(" step 10/", timeout=120)  # the first log line (--log-interval 10)
    os.killpg(proc.pid, signal.SIGINT)
    status = proc.wait(timeout=120)
    rest = proc.stderr_text()[len(before):]
    assert status == 130, rest
    assert rest.count("received SIGINT") == 1, rest
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_training(reference, out, STEPS)


def test_effective_batch_change_when_allowed_resumes_at_the_sample_offset(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *COMMON, "--max-steps", "6").returncode == 0  # 6 steps x 16 = sample 96
    changed = train_here(out, "--resume", "auto", "--effective-batch", "32", "--allow-config-change", "--max-steps", "7")
    assert changed.returncode == 0, changed.stderr
    assert "resuming epoch 0 at sample 96 (step 3)" in changed.stderr
    state = final_state(out)
    assert (state.step, state.epoch, state.step_in_epoch) == (7, 0, 4)


def test_sighup_from_a_closing_terminal_saves_and_exits_129(demo_assets, tmp_path):
    out = tmp_path / "run"
    stopped = train_here(out, *demo_assets, *COMMON, kill_at="SIGHUP@micro:4:1")
    assert stopped.returncode == 129, stopped.stderr
    assert "received SIGHUP" in stopped.stderr
    assert final_state(out).step == 4


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_second_signal_abandons_the_step_without_saving(demo_assets, tmp_path, signal_name, status):
    out = tmp_path / "run"
    kills = f"{signal_name}@micro:8:0,{signal_name}@micro:8:1"  # the second arrives before step 8 is done
    stopped = train_here(out, *demo_assets, *COMMON, kill_at=kills)
    assert stopped.returncode == status, stopped.stderr
    assert "second stop signal" in stopped.stderr and "Traceback" not in stopped.stderr
    assert final_state(out).step == 6  # the last checkpoint before the signals; step 8 was not saved
    assert not (out / "model_step8.pth").exists()


def test_a_signal_during_the_final_validation_still_saves_then_exits_with_its_status(demo_assets, tmp_path):
    out = tmp_path / "run"
    stopped = train_here(out, *demo_assets, *COMMON, "--max-steps", "5", "--lr-decay-steps", str(STEPS),
                         kill_at="SIGTERM@validation:5")
    assert stopped.returncode == 143, stopped.stderr
    assert final_state(out).step == 5


def test_a_signal_during_start_up_stops_at_once_without_a_traceback(demo_assets, tmp_path):
    out = tmp_path / "run"
    stopped = train_here(out, *demo_assets, *COMMON, kill_at="SIGINT@setup")
    assert stopped.returncode == 130, stopped.stderr
    assert "stopped by SIGINT during start-up" in stopped.stderr and "Traceback" not in stopped.stderr
    assert not (out / "latest.pth").exists()
    resumed = train_here(out, "--resume", "auto", "--max-steps", "2")  # the run's settings were kept
    assert resumed.returncode == 0, resumed.stderr


def test_a_checkpoint_of_another_run_is_refused_in_a_directory_that_holds_a_run(demo_assets, reference, tmp_path):
    other = tmp_path / "other"
    assert train_here(other, *demo_assets, *COMMON, "--max-steps", "6", "--seed", "5").returncode == 0
    before = sorted(p.name for p in reference.iterdir())
    refused = train_here(reference, "--resume", str(other / "latest.pth"))
    assert refused.returncode == 2 and "already holds another run" in refused.stderr
    assert sorted(p.name for p in reference.iterdir()) == before
    # Its own older checkpoint, or a copy of one kept elsewhere, is the same run: accepted.
    copy = tmp_path / "kept" / "model_step6.pth"
    copy.parent.mkdir()
    copy.write_bytes((other / "model_step6.pth").read_bytes())
    resumed = train_here(other, "--resume", str(copy), "--max-steps", "7")
    assert resumed.returncode == 0, resumed.stderr
    assert final_state(other).step == 7
    # ... and a branch into a new directory starts there, leaving the original run alone.
    branch = train_here(tmp_path / "branch", "--resume", str(other / "model_step6.pth"), "--max-steps", "8")
    assert branch.returncode == 0, branch.stderr
    assert final_state(other).step == 7 and final_state(tmp_path / "branch").step == 8


def _files(folder: Path) -> dict[str, bytes]:
    """The files' bytes, but the lock file's: a refused start takes and releases it (trainers/run/lock.py)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != LOCK_NAME}


def test_a_checkpoint_copied_in_from_another_run_is_refused(demo_assets, reference, tmp_path):
    other = tmp_path / "other"
    assert train_here(other, *demo_assets, *COMMON, "--max-steps", "6", "--seed", "5").returncode == 0
    ours, theirs = final_state(reference).run_id, final_state(other).run_id
    for name, keep_run_config in (("latest.pth", True), ("model_step99.pth", True), ("latest.pth", False)):
        run = tmp_path / f"copy_{name}_{keep_run_config}"
        subprocess.run(["cp", "-a", str(reference), str(run)], check=True)  # -a: latest.pth stays a hard link
        # latest.pth replaced, or the other run's file dropped in as the newest step
        (run / name).unlink(missing_ok=True)
        shutil.copyfile(other / "model_step6.pth", run / name)
        if not keep_run_config:  # then the directory's own checkpoints name its run
            (run / "run_config.json").unlink()
        before = _files(run)
        refused = train_here(run, "--resume", "auto", "--max-steps", str(STEPS + 2))
        assert refused.returncode == 2, refused.stderr
        assert f"is a checkpoint of run {theirs}, but {run} holds run {ours}" in refused.stderr
        assert _files(run) == before  # nothing renamed, rewritten or set aside


def test_background_saves_killed_mid_write_resume_bit_identically(family_assets, family_reference, tmp_path):
    """The background writer (the default on CUDA): kills inside its writes, from its own thread (each family)."""
    out = tmp_path / "run"
    kills = ["save:6:tmp_written", "save:12:renamed", "step:18", None]
    killed = train(out, *family_assets, *COMMON, "--background-saves", kill_at=kills[0])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "latest.pth").exists()  # killed inside the first write: no checkpoint yet
    expected_resume = {"save:6:tmp_written": None, "save:12:renamed": 12, "step:18": 18}
    for kill_at, next_kill in zip(kills, kills[1:]):
        args = ("--resume", "auto", "--background-saves")
        resumed = train(out, *args, kill_at=next_kill) if next_kill else train_here(out, *args)
        assert resumed.returncode == (-signal.SIGKILL if next_kill else 0), resumed.stderr
        step = expected_resume[kill_at]
        assert ("no checkpoint yet" in resumed.stderr) if step is None else f"(step {step}," in resumed.stderr
        assert "in the background" in resumed.stderr  # the writer thread wrote them
    assert_same_training(family_reference, out, STEPS)


def test_a_signal_save_in_the_background_completes_before_exit(demo_assets, tmp_path):
    out = tmp_path / "run"
    stopped = train_here(out, *demo_assets, *COMMON, "--background-saves", kill_at="SIGTERM@micro:7:1")
    assert stopped.returncode == 143, stopped.stderr
    assert final_state(out).step == 7  # written in the writer thread, complete before the trainer exited


def test_resume_auto_with_a_misspelt_output_dir_warns_and_names_the_run_beside_it(demo_assets, reference):
    typo = reference.parent / "runn"
    started = train_here(typo, "--resume", "auto", *demo_assets, *COMMON, "--max-steps", "1")
    assert started.returncode == 0, started.stderr  # starting fresh stays possible: cloud scripts always pass auto
    assert f"WARNING --resume auto: {typo} does not exist, so a NEW run starts there at step 0" in started.stderr
    assert f"similar names: {reference} (newest checkpoint latest.pth)" in started.stderr


def test_an_event_file_opened_in_the_same_second_as_the_previous_ones_is_read_after_them(tmp_path):
    """A resume right after an invocation killed within a second of opening its event file: TensorBoard
    reads files in name order (creation second, host, pid), so the new file must not sort first, or the
    killed invocation's purge event would hide every step the resume writes."""
    import time

    from trainers.training.train_log import StepMetrics, TrainLog

    def write(start_step: int, steps: range) -> Path:
        tlog = TrainLog(tmp_path, start_step)
        for step in steps:
            metrics = StepMetrics()
            metrics.add({k: torch.tensor(float(step + start_step)) for k in
                         ("text_ce", "mel_ce", "text_tokens", "mel_tokens", "mel_correct")}, 1)
            tlog.train_step(step, metrics, 1e-3, 1.0, 0.1)
        tlog.write_steps()
        tlog.close()
        return max((tmp_path / "logs").iterdir(), key=lambda p: p.stat().st_mtime_ns)

    killed = write(0, range(1, 6))
    if time.time() % 1 > 0.5:  # the resume below opens its file well within the second named here
        time.sleep(1 - time.time() % 1)
    parts = killed.name.split(".")
    parts[3], parts[5] = str(int(time.time())), "99999999"  # this second, a pid that sorts after any
    killed.rename(killed.with_name(".".join(parts)))
    write(2, range(3, 5))  # resumed from step 2: steps 3-4 replace the killed run's 3-5
    assert [step for step, _ in train_scalars(tmp_path)["train/mel_loss"]] == [1, 2, 3, 4]
