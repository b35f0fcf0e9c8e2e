"""A checkpoint that cannot be written stops the run with status 4; the previous checkpoint stays intact.

The failure is real: the trainer runs in a process of its own (tests/trainer_process.py) whose file-size limit (RLIMIT_FSIZE, what
`ulimit -f` sets) is below a checkpoint's size, so the write fails inside torch's serializer, as
on a full disk.
"""
from __future__ import annotations

import subprocess

import torch

from tests.demo_runs import final_state, subprocess_env, train_here
from tests.trainer_process import TrainerProcess

FLAGS = ["--batch-size", "8", "--save-interval", "2", "--keep-checkpoints", "2", "--val-interval", "0",
         "--max-val-batches", "1", "--log-interval", "100", "--lr-decay-steps", "8"]


def test_a_failed_write_exits_4_keeps_the_previous_checkpoint_and_the_resume_is_exact(demo_assets, tmp_path):
    reference = tmp_path / "reference"
    assert train_here(reference, *demo_assets, *FLAGS, "--max-steps", "8").returncode == 0
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "4").returncode == 0
    size = (out / "latest.pth").stat().st_size
    failed = _resume_limited(out, size // 2, "--max-steps", "8")
    assert failed.returncode == 4, failed.stderr
    assert "could not write the checkpoint of step 6" in failed.stderr
    assert "File too large" in failed.stderr and "model_step4.pth" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert final_state(out).step == 4
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]  # the partial file was removed
    resumed = train_here(out, "--resume", "auto", "--max-steps", "8")
    assert resumed.returncode == 0, resumed.stderr
    a, b = final_state(reference), final_state(out)
    assert a.step == b.step == 8 and all(torch.equal(a.model[k], b.model[k]) for k in a.model)


def _resume_limited(out, limit: int, *flags: str) -> subprocess.CompletedProcess:
    """`--resume auto` in a trainer process whose files cannot grow past `limit` bytes."""
    proc = TrainerProcess(["--resume", "auto", "--output-dir", str(out), *flags], subprocess_env(),
                          file_size_limit=limit)
    proc.wait(timeout=300)
    return proc.result()


def test_a_log_that_cannot_be_written_mid_run_exits_4_without_a_traceback(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "2", "--log-sample-ids").returncode == 0
    limit = (out / "sample_ids.tsv").stat().st_size + 2000  # a few more steps' ids, then the "disk" is full
    failed = _resume_limited(out, limit, "--max-steps", "8", "--save-interval", "100", "--log-interval", "1")
    assert failed.returncode == 4, failed.stderr
    assert "could not write the training log" in failed.stderr and "File too large" in failed.stderr
    assert "(the last checkpoint, model_step2.pth, is intact)" in failed.stderr
    assert "Traceback" not in failed.stderr
    resumed = train_here(out, "--resume", "auto", "--max-steps", "8")
    assert resumed.returncode == 0, resumed.stderr
    steps = [int(line.split("\t")[0]) for line in (out / "sample_ids.tsv").read_text().splitlines()]
    assert steps == list(range(1, 9))  # what the failed attempt wrote past the checkpoint was dropped


def test_a_run_directory_that_cannot_be_written_at_start_exits_2(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "2").returncode == 0
    (out / "run_config.json").unlink()
    failed = _resume_limited(out, 1, "--max-steps", "4")  # no file can grow past 1 byte
    assert failed.returncode == 2, failed.stderr
    assert f"cannot write in the run directory {out}" in failed.stderr and "Traceback" not in failed.stderr
    assert final_state(out).step == 2


def test_files_a_killed_trainer_left_half_written_are_removed_at_the_next_start(demo_assets, tmp_path):
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "2").returncode == 0
    (out / ".run_config.json.tmp").write_text("{half")
    (out / ".demo_data.tmp-abc123").mkdir()
    (out / ".demo_data.tmp-abc123" / "train.jsonl").write_text("half")
    (out / "notes.txt").write_text("mine")
    resumed = train_here(out, "--resume", "auto", "--max-steps", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert "removed 2 unfinished file(s) left by an interrupted trainer" in resumed.stderr
    assert not (out / ".run_config.json.tmp").exists() and not (out / ".demo_data.tmp-abc123").exists()
    assert (out / "notes.txt").read_text() == "mine"  # nothing that is not the trainer's is touched
