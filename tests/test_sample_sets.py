"""The generated samples on disk: a set per validation step under RUN_DIR/samples, written atomically
(a SIGKILL mid-write leaves the complete set or none), bounded (the last K and the best's), never seen
as checkpoints, and read back for rendering."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from trainers.checkpoint.step_files import CheckpointManager
from trainers.errors import UserError
from trainers.run.run_dir import prepare_run_dir
from trainers.run.sample_sets import SAMPLES_DIR, SampleStore, list_sets, new_set, read_set, read_step
from trainers.tools.run_files import newest_checkpoint, step_checkpoints

SETTINGS = {"max_codes": 16, "do_sample": False, "mel_positions": "upstream", "repetition_penalty": 1.0}


def a_set(step: int):
    return new_set(step, ids=["utt_1", "ünï", "lone\ud800"], languages=["am", None, "en"],
                   codes=[torch.tensor([5, 6, 7]), [], np.arange(12)], stopped=[True, True, False],
                   ref_lengths=[3, 4, 10], settings=SETTINGS, metrics={"gen/stop_rate": 2 / 3})


def test_a_set_reads_back_as_written(tmp_path):
    path = SampleStore(tmp_path, keep=3).write(a_set(120))
    assert path == tmp_path / SAMPLES_DIR / "step_00000120.npz" and list_sets(tmp_path) == {120: path}
    back = read_set(path)
    assert (back.step, back.ids, back.languages) == (120, ["utt_1", "ünï", "lone\ud800"], ["am", None, "en"])
    assert [c.tolist() for c in back.codes] == [[5, 6, 7], [], list(range(12))]
    assert back.stopped == [True, True, False] and back.ref_lengths == [3, 4, 10]
    assert back.settings == SETTINGS and back.metrics == {"gen/stop_rate": pytest.approx(2 / 3)}


def test_the_last_k_sets_and_the_protected_step_are_kept(tmp_path):
    store = SampleStore(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        store.write(a_set(step), protect=[20])  # step 20 holds the best checkpoint
    assert sorted(list_sets(tmp_path)) == [20, 30, 40]
    store.write(a_set(50), protect=[40])  # a new best: the old best's set goes
    assert sorted(list_sets(tmp_path)) == [40, 50]


def test_a_resume_from_an_earlier_step_keeps_its_new_set_and_leaves_later_ones(tmp_path):
    """A run resumed from step 10 after sets up to 40 were written: the set it writes for 20 replaces the
    old one and is not pruned for being older than 30 and 40; those stay until the run reaches them."""
    store = SampleStore(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        store.write(a_set(step))
    replaced = a_set(20)
    replaced.codes[0] = np.array([1, 1], dtype=np.int32)
    store.write(replaced)
    assert sorted(list_sets(tmp_path)) == [20, 30, 40]
    assert read_set(list_sets(tmp_path)[20]).codes[0].tolist() == [1, 1]


def test_sample_sets_are_never_counted_or_removed_as_checkpoints(tmp_path):
    checkpoints = CheckpointManager(tmp_path, keep=1)
    checkpoints.save({"step": 10}, 10)
    store = SampleStore(tmp_path, keep=5)
    for step in (10, 20):
        store.write(a_set(step))
    (tmp_path / SAMPLES_DIR / ".step_00000030.npz.tmp-1").write_bytes(b"partial")
    checkpoints.save({"step": 20}, 20)  # rotation deletes model_step10.pth, nothing under samples/
    assert step_checkpoints(tmp_path) == {20: tmp_path / "model_step20.pth"}
    assert newest_checkpoint(tmp_path) == tmp_path / "latest.pth"
    before = sorted(p.name for p in (tmp_path / SAMPLES_DIR).iterdir())
    checkpoints.clean_stale_temporaries()
    prepare_run_dir(tmp_path)  # the trainer's start-up clean-up of the run directory
    assert sorted(p.name for p in (tmp_path / SAMPLES_DIR).iterdir()) == before
    assert sorted(list_sets(tmp_path)) == [10, 20]


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from trainers.run.sample_sets import SampleStore, new_set
    store = SampleStore(sys.argv[1], keep=3)
    one = lambda step, code: new_set(step, ["a", "b"], [None, None], [[code] * 5, [2]], [True, True], [5, 1])
    store.write(one(10, 1))
    store.write(one(20, 1))
    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
    store.write(one(int(sys.argv[2]), 3), on_written=kill)  # the temporary complete, not yet renamed
""")


@pytest.mark.parametrize("step", [20, 30], ids=["replacing-a-set", "a-new-set"])
def test_a_sigkill_mid_write_leaves_the_complete_set_or_none(tmp_path, step):
    """A real process killed with SIGKILL after its temporary was written in full but before the rename:
    the step's set is the previous complete one (or absent), the temporary is not listed, and the
    trainer's clean-up removes it."""
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path), str(step)], capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert sorted(list_sets(tmp_path)) == [10, 20]
    assert read_set(list_sets(tmp_path)[20]).codes[0].tolist() == [1] * 5  # the old set, whole
    temps = [p.name for p in (tmp_path / SAMPLES_DIR).iterdir() if p.name.startswith(".")]
    assert len(temps) == 1 and temps[0].startswith(f".step_{step:08d}.npz.tmp-"), temps
    removed = SampleStore(tmp_path, keep=3).clean_temporaries()
    assert [p.name for p in removed] == temps
    assert not any(p.name.startswith(".") for p in (tmp_path / SAMPLES_DIR).iterdir())


def test_a_damaged_or_missing_set_is_a_user_error_naming_the_file(tmp_path):
    path = SampleStore(tmp_path, keep=1).write(a_set(10))
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(UserError, match=r"step_00000010\.npz is not a readable sample set .*delete it"):
        read_set(path)
    with pytest.raises(UserError, match="no such sample set"):
        read_set(tmp_path / SAMPLES_DIR / "step_00000099.npz")
    (tmp_path / SAMPLES_DIR / "notes.txt").write_text("mine")
    assert sorted(list_sets(tmp_path)) == [10]  # other files are not sets (and are left alone)


def test_a_run_without_samples_lists_none(tmp_path):
    assert list_sets(tmp_path) == {} and list_sets(tmp_path / "missing") == {}
    assert SampleStore(tmp_path, keep=1).clean_temporaries() == []
    with pytest.raises(UserError, match="holds no sample sets"):
        read_step(tmp_path)


def test_a_step_is_read_by_number_or_the_newest_and_a_missing_one_names_those_kept(tmp_path):
    store = SampleStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.write(a_set(step))
    assert read_step(tmp_path).step == 30 and read_step(tmp_path, 20).step == 20
    with pytest.raises(UserError, match=r"no sample set of step 10 \(steps kept: 20, 30;"):
        read_step(tmp_path, 10)
