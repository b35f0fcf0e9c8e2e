#!/usr/bin/env python3
"""Optimizer steps/s and real tokens/s of the demo model: the old data path against the new one.

    python benchmarks/throughput.py [--rounds 3] [--steps 60] [--threads 2] [--smoke]

Each round trains the demo (`--demo`: the tiny config and the built-in corpus, effective batch
16, micro-batch auto) from scratch for --steps optimizer steps with dropout 0.1, once per path,
in alternating order (a slow spell of the machine hits both):

  old  --data-order random  --dropout-masks v1   (what runs made before issue 11 use)
  new  --data-order grouped --dropout-masks v2   (the default for new runs)

Both run the same trainer build, so what the two share (the device-side metrics, the host-side
sample check, TF32) is in both figures. Validation is off after the start, saves happen only at
the end, and the trainer is a subprocess with --threads intra-op threads.

Figures, from the trainer's own log lines: every log interval (10 steps) prints its samples/s,
so an interval took 10 x 16 / rate seconds; its real tokens (text + codes of its samples, no
padding) come from sample_ids.tsv (--log-sample-ids) and the corpus manifest. The first
interval is left out (warm-up: allocator, first AdamW state). Per path: steps/s and real
tokens/s over the timed intervals of a round; the medians of the rounds are printed, with
every round's figure.

--smoke (for tests/test_benchmarks.py): one round of 4 steps per path with one thread and a log
interval of 2, to check the script runs (seconds); its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "trainers" / "train_gpt_v2.py"
PATHS = {
    "old": ["--data-order", "random", "--dropout-masks", "v1"],
    "new": ["--data-order", "grouped", "--dropout-masks", "v2"],
}
LOG_INTERVAL = 10
SMOKE = {"rounds": 1, "steps": 4, "threads": 1, "log_interval": 2}
EFFECTIVE_BATCH = 16
INTERVAL_LINE = re.compile(r"step (\d+)/\d+ grad_norm \S+ samples/s ([\d.]+)")


def run_path(work: Path, name: str, steps: int, threads: int, log_interval: int = LOG_INTERVAL) -> tuple[float, float]:
    out = work / f"{name}-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, str(TRAINER), "--demo", "--output-dir", str(out), "--max-steps", str(steps),
           "--effective-batch", str(EFFECTIVE_BATCH), "--dropout", "0.1", "--val-interval", "0",
           "--save-interval", str(steps), "--log-interval", str(log_interval), "--log-sample-ids", *PATHS[name]]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"the {name} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    lengths = manifest_lengths(out)
    tokens_of_step = {}
    for line in (out / "sample_ids.tsv").read_text().splitlines():
        step, _, ids = line.split("\t")
        tokens_of_step[int(step)] = sum(lengths[i] for i in ids.split(","))
    seconds = tokens = 0.0
    timed_steps = 0
    for match in INTERVAL_LINE.finditer(done.stderr):
        end, rate = int(match.group(1)), float(match.group(2))
        if end <= log_interval:
            continue  # warm-up
        seconds += log_interval * EFFECTIVE_BATCH / rate
        tokens += sum(tokens_of_step[s] for s in range(end - log_interval + 1, end + 1))
        timed_steps += log_interval
    if not timed_steps:
        sys.exit(f"no timed interval in the {name} run: raise --steps above {2 * log_interval}")
    return timed_steps / seconds, tokens / seconds


def manifest_lengths(run_dir: Path) -> dict[str, int]:
    """id -> text + code tokens of the training manifest the run used."""
    saved = json.loads((run_dir / "run_config.json").read_text())
    settings = saved.get("config", saved)
    lengths = {}
    for manifest in settings["train_manifests"]:
        path = Path(manifest.split("::")[0])
        path = path if path.is_absolute() else REPO / path
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                lengths[row["id"]] = int(row["target_text_len"]) + int(row["target_code_len"])
    return lengths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="one round of 4 steps per path: checks the script runs")
    args = ap.parse_args()
    log_interval = LOG_INTERVAL
    if args.smoke:
        args.rounds, args.steps, args.threads, log_interval = (SMOKE[k] for k in ("rounds", "steps", "threads",
                                                                                  "log_interval"))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {version('torch')}; "
          f"{args.threads} intra-op threads; demo model, effective batch {EFFECTIVE_BATCH}, dropout 0.1, "
          f"{args.steps} steps per run, first {log_interval} not timed; load {os.getloadavg()[0]:.2f}")
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
            for name in order:
                figures[name].append(run_path(Path(tmp), name, args.steps, args.threads, log_interval))
                steps, tokens = figures[name][-1]
                print(f"round {r + 1} {name}: {steps:.2f} steps/s, {tokens:,.0f} real tokens/s")
    print()
    print("| path | steps/s (median) | real tokens/s (median) | rounds (steps/s) |")
    print("|---|---|---|---|")
    medians = {}
    for name, rows in figures.items():
        medians[name] = (statistics.median(s for s, _ in rows), statistics.median(t for _, t in rows))
        print(f"| {name} | {medians[name][0]:.2f} | {medians[name][1]:,.0f} | "
              f"{', '.join(f'{s:.2f}' for s, _ in rows)} |")
    print(f"\nnew / old: steps/s x{medians['new'][0] / medians['old'][0]:.2f}, real tokens/s "
          f"x{medians['new'][1] / medians['old'][1]:.2f}; load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
