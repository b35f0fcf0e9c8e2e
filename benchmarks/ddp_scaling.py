#!/usr/bin/env python3
"""Steps per second with 1 and 2 processes at the same effective batch, and what a save costs the loop.

    python benchmarks/ddp_scaling.py [--steps 40] [--repeats 3] [--work-dir DIR]

Demo model on the CPU (gloo), effective batch 16. The default (3 rounds) takes about 2 minutes on
a shared 2-core VM. What it does:

1. Generates the demo corpus and base checkpoint once (tests/demo_runs.py, nothing downloaded).
2. For --repeats rounds, in rotating order, trains --steps steps from scratch in each setting:
     1 proc x 1 thread    python trainers/train_gpt_v2.py, OMP_NUM_THREADS=1, micro-batch 16
     1 proc x 2 threads   the same with OMP_NUM_THREADS=2 (the same cores as two processes)
     2 procs x 1 thread   python -m torch.distributed.run --standalone --nproc_per_node 2 ...,
                          OMP_NUM_THREADS=1, micro-batch 8 per process
   with --log-interval 10 and --save-interval 10 (checkpoints at steps 10, 20, 30 and the end).
3. Steps per second: the trainer's own per-interval rate (samples/s in its log line, over the
   time of the steps alone, saves and validation excluded) divided by the effective batch, the
   median of the intervals after the first (which holds the first step's warm-up).
   Blocked per save (2 processes): rank 0's log line "the checkpoint save held the 2 processes for
   X s", from entering the save until every process knows it ended (rank 0 writes the file with
   the usual atomic protocol while rank 1 waits in the agreement that follows), the median of
   the run's saves.
4. Prints every figure, the medians over the rounds, the machine and `uptime` before and after.
   Exit 0 when every run worked, 2 otherwise. The work directory is deleted unless given.

No GPU figures: this project has had no multi-GPU machine; NCCL is not exercised here.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

SCRIPT = REPO_ROOT / "trainers" / "train_gpt_v2.py"
EFFECTIVE = 16
SETTINGS = {  # name: (processes, threads per process)
    "1 proc x 1 thread": (1, 1),
    "1 proc x 2 threads": (1, 2),
    "2 procs x 1 thread": (2, 1),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (a multiple of 10, >= 20)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are taken over them")
    p.add_argument("--work-dir", type=Path, help="keep the corpus and runs here (default: a temporary directory)")
    args = p.parse_args()
    if args.steps < 20 or args.steps % 10 or args.repeats < 1:
        p.error("--steps must be a multiple of 10 and at least 20; --repeats at least 1")
    return args


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: %.2f, %.2f, %.2f" % os.getloadavg()


def train(out: Path, flags: list[str], processes: int, threads: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INDEXTTS_TRAIN_")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
                if processes > 1 else [sys.executable])
    result = subprocess.run([*launcher, str(SCRIPT), "--output-dir", str(out), *flags], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{processes} process(es) failed with status {result.returncode}:\n{result.stderr[-3000:]}")
    return result.stderr


def steps_per_second(log: str) -> tuple[float, list[float]]:
    rates = [float(r) / EFFECTIVE for r in re.findall(r"INFO step \d+/\d+ .* samples/s ([\d.]+)", log)]
    if len(rates) < 2:
        raise RuntimeError("fewer than two interval lines in the log")
    return statistics.median(rates[1:]), rates


def save_blocks(log: str) -> list[float]:
    return [float(s) for s in re.findall(r"the checkpoint save held the \d+ processes for ([\d.]+) s", log)]


def main() -> int:
    args = parse_args()
    given = args.work_dir is not None
    work = args.work_dir.resolve() if given else Path(tempfile.mkdtemp(prefix="ddp_scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    before = uptime()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPU cores, python {platform.python_version()}")
    print(f"uptime before: {before}")
    try:
        from tests.demo_runs import demo_flags
        import torch

        print(f"torch {torch.__version__}; demo model on the CPU (gloo); effective batch {EFFECTIVE}, "
              f"{args.steps} steps per run, {args.repeats} round(s)")
        flags = [*demo_flags(work / "assets"), "--effective-batch", str(EFFECTIVE), "--max-steps", str(args.steps),
                 "--log-interval", "10", "--save-interval", "10", "--val-interval", "0", "--max-val-batches", "1",
                 "--keep-checkpoints", "1", "--num-workers", "0"]
        rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
        blocks: list[float] = []
        names = list(SETTINGS)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order to spread drift
                processes, threads = SETTINGS[name]
                out = work / f"run_{r}_{processes}x{threads}"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.monotonic()
                log = train(out, [*flags, "--batch-size", str(EFFECTIVE // processes)], processes, threads)
                rate, intervals = steps_per_second(log)
                rates[name].append(rate)
                extra = ""
                if processes > 1:
                    held = save_blocks(log)
                    blocks.append(statistics.median(held))
                    extra = f"; blocked per save {', '.join(f'{h:.3f}' for h in held)} s"
                shown = ", ".join(f"{x:.2f}" for x in intervals)
                print(f"round {r + 1} {name}: {rate:.2f} steps/s (intervals {shown}; run "
                      f"{time.monotonic() - t0:.1f} s wall){extra}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports and exits
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 2
    finally:
        if not given:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"median over {args.repeats} round(s):")
    base = statistics.median(rates["1 proc x 1 thread"])
    for name, values in rates.items():
        m = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:20s} {m:6.2f} steps/s  ({m / base:.2f}x 1 proc x 1 thread; runs {runs})")
    print(f"  loop blocked per checkpoint save, 2 processes: {statistics.median(blocks):.3f} s "
          f"(runs {', '.join(f'{b:.3f}' for b in blocks)})")
    print(f"uptime after: {uptime()}")
    print("GPU figures: missing (no multi-GPU machine was available; NCCL was not exercised)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
