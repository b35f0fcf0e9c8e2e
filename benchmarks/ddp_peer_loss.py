#!/usr/bin/env python3
"""How the survivor of a 2-process torchrun job exits when its peer is SIGKILLed at a random moment.

    python benchmarks/ddp_peer_loss.py [--trials 50] [--victim-rank 0] [--work-dir DIR] [--smoke]

Demo model on the CPU (gloo), effective batch 16, micro-batch 8 per process. What it does:

1. Generates the demo corpus and base checkpoint once (tests/demo_runs.py, nothing downloaded) and
   trains 2 steps in one process, with a decay horizon of 5000 steps, as the run every trial resumes.
2. Each trial copies that run and resumes it under `torchrun --standalone --nproc_per_node 2` towards
   step 2000; once rank 0 has logged step 20 it waits a random 0-0.3 s and SIGKILLs the worker of
   --victim-rank (found by its RANK variable), so the kill lands in any phase of a step.
3. Reads each worker's exit code from torchrun's report and whether "terminate called" (a C++
   std::terminate, exit -6) appeared, and prints one line per trial and the counts.
   With the machine and its load before and after. Exit 0 when every survivor exited with the
   documented status 6, 1 otherwise.

Each trial takes about 10 s on a shared 2-core VM. The abort this counts depends on thread timing,
so small counts are indicative only. --smoke (for tests/test_benchmarks.py): one trial, the kill once
rank 0 logged step 4, the counts printed but not judged (exit 0): it checks that the script runs.
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.demo_runs import SCRIPT, demo_flags, subprocess_env, train_here  # noqa: E402

RUN_FLAGS = ["--effective-batch", "16", "--batch-size", "8", "--lr-decay-steps", "5000", "--val-interval", "0",
             "--max-val-batches", "1", "--log-interval", "4", "--dropout", "0.1", "--save-interval", "1000"]
KILL_AFTER_STEP = 20  # rank 0 has logged this step: training is under way
STATUS = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--victim-rank", type=int, choices=(0, 1), default=0, help="the worker to SIGKILL")
    p.add_argument("--work-dir", type=Path, help="keep the corpus and runs here (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="one trial, killed at step 4, not judged: checks the script "
                   "runs")
    args = p.parse_args()
    args.kill_after_step = KILL_AFTER_STEP
    if args.smoke:
        args.trials, args.kill_after_step = 1, 4
    return args


def base_run(work: Path) -> Path:
    import torch

    torch.set_num_threads(1)  # as the trainer subprocesses (OMP_NUM_THREADS=1)
    base = work / "base"
    if not (base / "latest.pth").exists():
        result = train_here(base, *demo_flags(work / "assets"), *RUN_FLAGS, "--max-steps", "2")
        if result.returncode != 0:
            sys.exit(f"the base run failed:\n{result.stderr[-3000:]}")
    return base


def trial(base: Path, out: Path, victim_rank: int, kill_after_step: int) -> tuple[dict[int, int], bool]:
    """(each rank's exit code, whether a std::terminate was printed)."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--output-dir", str(out), "--resume", "auto", "--max-steps", "2000"]
    proc = subprocess.Popen(cmd, env=subprocess_env(None, {"INDEXTTS_DDP_TIMEOUT_S": "60"}), cwd=REPO_ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        logged = re.search(r" step (\d+)/2000", line)
        if logged and int(logged.group(1)) >= kill_after_step:
            break
    time.sleep(random.uniform(0, 0.3))  # any phase of a step
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    victim = next(int(w) for w in workers
                  if f"\0RANK={victim_rank}\0" in "\0" + Path(f"/proc/{w}/environ").read_text())
    os.kill(victim, signal.SIGKILL)
    stderr = "".join(seen) + proc.stderr.read()
    proc.wait()
    (out.parent / f"{out.name}.stderr").write_text(stderr)
    return {int(r): int(c) for r, c in STATUS.findall(stderr)}, "terminate called" in stderr


def main() -> int:
    args = parse_args()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs; load before: {os.getloadavg()}", flush=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ddp_peer_loss_"))
    base = base_run(work)
    survivor = 1 - args.victim_rank
    counts: collections.Counter = collections.Counter()
    for t in range(args.trials):
        statuses, aborted = trial(base, work / f"trial{t}", args.victim_rank, args.kill_after_step)
        counts[(statuses.get(survivor), aborted)] += 1
        print(f"trial {t}: rank {args.victim_rank} SIGKILLed; survivor rank {survivor} exit "
              f"{statuses.get(survivor)}{' after std::terminate' if aborted else ''}", flush=True)
    print("survivor (exit code, std::terminate printed): trials")
    for (status, aborted), n in sorted(counts.items(), key=str):
        print(f"  ({status}, {aborted}): {n} of {args.trials}")
    print(f"load after: {os.getloadavg()}")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    if args.smoke:
        print("--smoke: one trial, not judged")
        return 0
    return 0 if set(counts) == {(6, False)} else 1


if __name__ == "__main__":
    sys.exit(main())
