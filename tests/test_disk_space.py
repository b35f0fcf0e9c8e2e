"""Room on the disk for the checkpoints a run keeps: refused at start (status 2, nothing trained), warned about
before a save when the disk filled up since, and a demo on a full disk refused without a traceback.

The disks are real: a 2 MiB tmpfs mounted for each test (skipped where mounting is not permitted), and the
trainer runs in a process of its own (tests/trainer_process.py), as a user's would.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.demo_runs import final_state, small_corpus_flags, subprocess_env, train, train_here
from tests.slowness import scaled
from tests.trainer_process import TrainerProcess
from trainers.checkpoint import schema
from trainers.checkpoint.disk_space import checkpoint_bytes, files_at_peak, free_bytes, saves_to_come
from trainers.checkpoint.step_files import CheckpointManager

FLAGS = ["--effective-batch", "4", "--batch-size", "2", "--log-interval", "100", "--warmup-steps", "2"]


@contextlib.contextmanager
def tmpfs(disk: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted on the directory `disk` (made if missing); the test is skipped where mounting is
    not permitted."""
    disk.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a full disk as a user meets one."""
    with tmpfs(tmp_path / "disk", "2m") as disk:
        yield disk


def fill(disk: Path, leave: int) -> None:
    """Fill `disk` up to `leave` free bytes."""
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * (free_bytes(disk) - leave))
        f.flush()
        os.fsync(f.fileno())


def test_a_start_without_room_for_the_checkpoints_is_refused_before_training(small_disk, tmp_path):
    """Ten kept checkpoints of about 0.3 MiB do not fit on 2 MiB: refused at start, naming the bytes needed
    and free; before, the run trained until a save failed (status 4, the steps since the last save lost)."""
    flags = small_corpus_flags(tmp_path / "data")
    refused = train(small_disk / "run", *flags, *FLAGS, "--save-interval", "2", "--max-steps", "40",
                    "--keep-checkpoints", "10")
    assert refused.returncode == 2, refused.stderr
    assert f"not enough disk space for this run's checkpoints in {small_disk / 'run'}: they need " in refused.stderr
    assert "12 checkpoint files of up to" in refused.stderr and "10 model_step files, best.pth and the one being " \
        "written), and the disk has " in refused.stderr
    assert "lower --keep-checkpoints" in refused.stderr and "(nothing was trained)" in refused.stderr
    assert "Traceback" not in refused.stderr and "step 1" not in refused.stderr
    assert list(small_disk.iterdir()) == []  # not even the run directory is left
    fits = train(small_disk / "run", *flags, *FLAGS, "--save-interval", "2", "--max-steps", "4")  # 3 kept: fits
    assert fits.returncode == 0, fits.stderr
    assert "disk space" not in fits.stderr


def test_a_disk_that_fills_up_during_the_run_is_warned_about_before_the_save(small_disk, tmp_path):
    """The trainer stops itself (SIGSTOP) after the save of step 2; the disk is filled to 300 KB free meanwhile.
    The save of step 4 is warned about first (it fits, the ones after do not), the save of step 6 fails (status
    4); a resume on that disk is then refused at start, with nothing changed."""
    out = small_disk / "run"
    flags = [*small_corpus_flags(tmp_path / "data"), *FLAGS, "--save-interval", "2", "--max-steps", "8"]
    proc = TrainerProcess(["--output-dir", str(out), *flags], subprocess_env(env={
        "INDEXTTS_TRAIN_KILL_AT": "SIGSTOP@step:2"}))
    try:
        proc.wait_for("saved checkpoint", timeout=120)
        deadline = time.monotonic() + scaled(60)
        while process_state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(proc.pid) == "T", proc.stderr_text()
        fill(small_disk, 300 * 1024)
        os.kill(proc.pid, signal.SIGCONT)
        status = proc.wait(timeout=120)
    finally:
        if proc.returncode is None:
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill_tree()
    err = proc.stderr_text()
    assert status == 4, err
    warned = err.index("WARNING disk space: saving step 4 and the checkpoints after it need ")
    assert warned < err.index("saved checkpoint " + str(out / "model_step4.pth"))
    assert "but the disk has " in err[warned:] and "Free disk space now; the run goes on" in err[warned:]
    assert "could not write the checkpoint of step 6" in err and "Traceback" not in err
    assert final_state(out).step == 4
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    refused = train(out, "--resume", "auto")
    assert refused.returncode == 2, refused.stderr
    assert "not enough disk space for this run's checkpoints" in refused.stderr
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_demo_on_a_full_disk_is_refused_without_a_traceback(small_disk):
    """The demo corpus does not fit on 2 MiB: status 2 and one line; it used to end in an OSError's traceback
    (status 1) while the corpus was written."""
    refused = train(small_disk / "run", "--demo")
    assert refused.returncode == 2, refused.stderr
    assert f"cannot write the demo corpus in {small_disk / 'run' / 'demo_data'}: No space left on device; free " \
        "disk space or pass an --output-dir on another disk (nothing was trained)" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert list(small_disk.iterdir()) == []


def test_a_full_disk_under_the_tensorboard_log_ends_in_one_message_and_no_traceback(tmp_path):
    """logs/ on a full 64 KiB tmpfs: TensorBoard's writer fails as the log is opened, in its own thread, before the
    first step. Status 4 and the message; the writer thread's 24-line traceback followed them, because the handler
    that turns it into a line was installed after the writer was made."""
    out = tmp_path / "run"
    with tmpfs(out / "logs", "64k") as logs:
        fill(logs, 0)
        failed = train(out, *small_corpus_flags(tmp_path / "data"), *FLAGS, "--max-steps", "1")
    assert failed.returncode == 4, failed.stderr
    assert f"could not write the training log in {out}: [Errno 28] No space left on device; free disk space" \
        in failed.stderr
    assert "Traceback" not in failed.stderr and "Exception in thread" not in failed.stderr, failed.stderr
    assert "first optimizer step" not in failed.stderr and not list(out.glob("*.pth"))


def test_the_size_estimate_bounds_the_checkpoints_written(tmp_path):
    """The size known before the first step (model tensors, AdamW's moments of the trained parameters) is an
    upper bound on the files the run writes, and not far above: 31% more on this 0.26 MB file (5% on the
    demo's 1.9 MB one, less the larger the model: the allowance is per tensor and per file)."""
    out = tmp_path / "run"
    done = train_here(out, *small_corpus_flags(tmp_path / "data"), *FLAGS, "--max-steps", "2")
    assert done.returncode == 0, done.stderr
    ckpt = final_state(out)
    trained = [ckpt.model[name] for name, _ in ckpt.param_shapes]
    estimate, real = checkpoint_bytes(ckpt.model.values(), trained), (out / "latest.pth").stat().st_size
    assert real < estimate < 1.4 * real, (real, estimate)
    assert isinstance(schema.read(out / "latest.pth"), schema.Checkpoint)


@pytest.mark.parametrize("keep, best", [(3, True), (3, False), (1, True), (0, True), (0, False)])
def test_files_at_peak_counts_what_the_saving_scheme_holds_at_once(tmp_path, keep, best):
    """The files the real saving scheme (trainers/checkpoint/step_files.py) holds at each of its events, each
    inode once (latest.pth is a link), never exceed files_at_peak, and reach it."""
    files = CheckpointManager(tmp_path, keep)
    held = []
    files.on_event = lambda event, step: held.append(len({p.stat().st_ino for p in tmp_path.iterdir()}))
    state = {"x": torch.zeros(256)}
    saves = 6
    for step in range(1, saves + 1):
        files.save(state, step)
        if best:  # each validation a new best, after the save: the most the scheme holds
            files.save_best(state, step)
    assert max(held) == files_at_peak(keep, saves, best)
    assert files_at_peak(keep, 0, best) == 0


def test_the_saves_an_invocation_makes_are_counted_as_the_loop_makes_them():
    assert saves_to_come(0, 8, 2) == 4  # 2, 4, 6, 8
    assert saves_to_come(0, 9, 2) == 5  # and the final one at 9
    assert saves_to_come(4, 9, 4) == 2  # 8, 9
    assert saves_to_come(9, 9, 4) == 0
