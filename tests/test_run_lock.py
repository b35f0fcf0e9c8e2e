"""One trainer per run directory: a second one is refused, and a killed one leaves no stale lock."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.demo_runs import final_state, subprocess_env, train, train_here
from tests.trainer_process import TrainerProcess
from trainers.errors import UserError
from trainers.run.lock import RunLock

FLAGS = ["--batch-size", "16", "--val-interval", "0", "--max-val-batches", "1", "--log-interval", "1",
         "--save-interval", "1000", "--lr-decay-steps", "400"]


def test_a_second_trainer_is_refused_and_a_killed_ones_lock_does_not_block(demo_assets, tmp_path):
    out = tmp_path / "run"
    first = TrainerProcess(["--output-dir", str(out), *demo_assets, *FLAGS, "--max-steps", "400"], subprocess_env())
    try:
        first.wait_for("first optimizer step finished", timeout=120)  # training, no checkpoint yet (as a fresh start sees it)
        config = (out / "run_config.json").read_bytes()
        for flags in (["--resume", "auto"], [*demo_assets, *FLAGS, "--seed", "2"]):  # continue it; start another
            refused = train_here(out, *flags)
            assert refused.returncode == 2, refused.stderr
            assert "another trainer is using" in refused.stderr and f"pid {first.pid} on" in refused.stderr
        assert (out / "run_config.json").read_bytes() == config  # the running trainer's settings stand
        (out / ".trainer.lock").unlink()  # by hand, while the first trainer runs: the directory stays locked
        refused = train_here(out, "--resume", "auto")
        assert refused.returncode == 2, refused.stderr
        assert "another trainer is using" in refused.stderr and ".trainer.lock was deleted" in refused.stderr
        assert not (out / ".trainer.lock").exists() and (out / "run_config.json").read_bytes() == config
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(timeout=60) == -signal.SIGKILL
    finally:
        first.kill_tree()
    resumed = train_here(out, "--resume", "auto", "--max-steps", "2")
    assert resumed.returncode == 0, resumed.stderr  # the kernel dropped the dead trainer's lock
    assert "no checkpoint yet" in resumed.stderr and final_state(out).step == 2


def test_a_forked_child_does_not_keep_the_run_locked(tmp_path):
    """Data-loader workers are forked with the trainer's descriptors; a worker outliving its trainer
    must not hold the run directory."""
    lock = RunLock(tmp_path / "run").acquire()
    ready, forked = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only waits
        os.write(forked, b"1")  # os.fork() has returned here: the at-fork hooks have run
        time.sleep(3)
        os._exit(0)
    os.close(forked)
    try:
        assert os.read(ready, 1) == b"1"
        with pytest.raises(UserError, match="another trainer is using"):
            RunLock(tmp_path / "run").acquire()
        lock.release()  # the trainer ends; its forked child still runs
        RunLock(tmp_path / "run").acquire().release()
    finally:
        os.close(ready)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_second_trainer_started_while_the_first_sets_up_gets_the_locks_message(demo_assets, tmp_path):
    """A second trainer started before the first had written anything used to find no run there, warn that a
    NEW run starts, then stop on "no training data" (or start a second run): the first took the lock only after
    reading its inputs. It now holds it from its first look at the directory, which it created."""
    out = tmp_path / "runs" / "run"
    first = TrainerProcess(["--output-dir", str(out), "--resume", "auto", *demo_assets, *FLAGS, "--max-steps", "2"],
                           subprocess_env())
    try:
        first.wait_for("so a NEW run starts there", timeout=120)
        # Frozen in its start-up, the lock held; it may have begun to write the run's files since that line.
        os.kill(first.pid, signal.SIGSTOP)
        before = sorted(p.name for p in out.iterdir())
        for flags in (["--resume", "auto"], [*demo_assets, *FLAGS, "--seed", "2"]):  # continue it; start another
            refused = train(out, *flags)
            assert refused.returncode == 2, refused.stderr
            assert "another trainer is using" in refused.stderr and f"pid {first.pid} on" in refused.stderr
            assert "NEW run" not in refused.stderr and "Traceback" not in refused.stderr
        assert ".trainer.lock" in before and sorted(p.name for p in out.iterdir()) == before  # they wrote nothing
        assert "does not exist, so a NEW run starts there" in first.stderr_text()  # said of the directory as found
        os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=120) == 0, first.stderr_text()
    finally:
        if first.returncode is None:
            os.kill(first.pid, signal.SIGCONT)
        first.kill_tree()
    assert final_state(out).step == 2


def test_a_start_refused_after_locking_leaves_the_disk_as_it_found_it(tmp_path):
    """The lock comes first, so a start refused on its input afterwards removes what locking made: the lock
    file, and the directories it created; a directory that was there keeps its files (and one it found)."""
    made = RunLock(tmp_path / "new" / "run").acquire()
    assert not made.existed
    made.abandon()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    found = RunLock(tmp_path / "mine").acquire()
    assert found.existed
    found.abandon()
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    RunLock(tmp_path / "mine").acquire().release()  # a lock file a finished trainer left stays where it is
    again = RunLock(tmp_path / "mine").acquire()
    again.abandon()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == [".trainer.lock", "notes.txt"]
