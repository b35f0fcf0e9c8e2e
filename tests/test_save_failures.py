"""A checkpoint that cannot be written stops the run with status 4; the previous checkpoint stays intact.

The failure is real: the trainer runs in a subprocess whose file-size limit (RLIMIT_FSIZE, what
`ulimit -f` sets) is below a checkpoint's size, so the write fails inside torch's serializer, as
on a full disk.
"""
from __future__ import annotations

import resource
import subprocess
import sys

import torch

from tests.demo_runs import REPO, SCRIPT, final_state, subprocess_env, train_here

FLAGS = ["--batch-size", "8", "--save-interval", "2", "--keep-checkpoints", "2", "--val-interval", "0",
         "--max-val-batches", "1", "--log-interval", "100", "--lr-decay-steps", "8"]


def _limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_failed_write_exits_4_keeps_the_previous_checkpoint_and_the_resume_is_exact(demo_assets, tmp_path):
    reference = tmp_path / "reference"
    assert train_here(reference, *demo_assets, *FLAGS, "--max-steps", "8").returncode == 0
    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS, "--max-steps", "4").returncode == 0
    size = (out / "latest.pth").stat().st_size
    failed = subprocess.run([sys.executable, str(SCRIPT), "--resume", "auto", "--output-dir", str(out),
                             "--max-steps", "8"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                            timeout=300, preexec_fn=_limit_file_size(size // 2))
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
