#!/usr/bin/env python3
"""Steps per second with 1 and 2 processes at the same effective batch, and what a save costs the loop.

    python benchmarks/ddp_scaling.py [--steps 40] [--repeats 3] [--work-dir DIR]
    python benchmarks/ddp_scaling.py --saves-only --width 256 --layers 4 --steps 20 --save-interval 2
    python benchmarks/ddp_scaling.py --smoke

Demo model on the CPU (gloo), effective batch 16. The default (3 rounds) takes about 3 minutes on
a shared 2-core VM. What it does:

1. Generates the demo corpus and base checkpoint once (tests/demo_runs.py, nothing downloaded);
   with --width / --layers, a corpus and base of a wider or deeper model of the demo's shape
   (a larger checkpoint, so that the write is a larger share of a save).
2. For --repeats rounds, in rotating order, trains --steps steps from scratch in each setting:
     1 proc x 1 thread    python trainers/train_gpt_v2.py, OMP_NUM_THREADS=1, micro-batch 16
     1 proc x 2 threads   the same with OMP_NUM_THREADS=2 (the same cores as two processes)
     2 procs x 1 thread   python -m torch.distributed.run --standalone --nproc_per_node 2 ...,
                          OMP_NUM_THREADS=1, micro-batch 8 per process, --no-background-saves:
                          rank 0 writes while the other waits (the only mode under torchrun before
                          background saves were allowed there)
     2 procs, background  the same with --background-saves: rank 0 copies the state and writes it
                          in its writer thread while both train on
   (--saves-only: the two 2-process settings alone), with --log-interval 10 and --save-interval 10
   (checkpoints at steps 10, 20, 30 and the end).
3. Steps per second: the trainer's own per-interval rate (samples/s in its log line, over the
   time of the steps alone, saves and validation excluded) divided by the effective batch, the
   median of the intervals after the first (which holds the first step's warm-up). A background
   write competes with training for the CPU cores, which shows here, not in the blocked time.
   Blocked per save (2 processes): rank 0's log line "the checkpoint save held the 2 processes for
   X s", from entering the save until every process knows how it ended: the write itself when
   synchronous; with background saves the wait for the previous write (if still going), the copy
   of the state and the agreement. The median of the run's saves, the final one excluded (it is
   followed by a wait for its write, which the line does not include).
4. Prints every figure, the medians over the rounds, the machine and `uptime` before and after.
   Exit 0 when every run worked, 2 otherwise. The work directory is deleted unless given.

--smoke (for tests/test_benchmarks.py): one round of 4 steps, a log line and a save every 2 steps, in two
settings only ("1 proc x 1 thread" and "2 procs, background": each code path of the script once, the
other two differ from these only by a variable or a flag); it checks the script runs, its figures mean
nothing.

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
SETTINGS = {  # name: (processes, threads per process, extra flags)
    "1 proc x 1 thread": (1, 1, ()),
    "1 proc x 2 threads": (1, 2, ()),
    "2 procs x 1 thread": (2, 1, ("--no-background-saves",)),
    "2 procs, background": (2, 1, ("--background-saves",)),
}
SMOKE = ("1 proc x 1 thread", "2 procs, background")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (a multiple of 10, >= 20)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are taken over them")
    p.add_argument("--work-dir", type=Path, help="keep the corpus and runs here (default: a temporary directory)")
    p.add_argument("--saves-only", action="store_true", help="only the two 2-process settings (the cost of a save)")
    p.add_argument("--width", type=int, default=0, help="model_dim of a wider model of the demo's shape (0: the demo)")
    p.add_argument("--layers", type=int, default=0, help="layers of that model (0: the demo's)")
    p.add_argument("--save-interval", type=int, default=10, help="optimizer steps between checkpoints")
    p.add_argument("--smoke", action="store_true", help="4 steps in 2 of the settings: checks the script runs")
    args = p.parse_args()
    if args.steps < 20 or args.steps % 10 or args.repeats < 1 or args.save_interval < 1:
        p.error("--steps must be a multiple of 10 and at least 20; --repeats and --save-interval at least 1")
    args.log_interval = 10
    if args.smoke:
        args.steps, args.repeats, args.save_interval, args.log_interval = 4, 1, 2, 2
    return args


def model_flags(root: Path, width: int, layers: int) -> list[str]:
    """The demo's flags, or those of a wider/deeper model of its shape with a corpus and base of its own."""
    from tests.demo_runs import demo_flags

    if not width and not layers:
        return demo_flags(root)
    import yaml

    from trainers.data.demo_data import DemoCorpusSpec, ensure_demo_assets
    from trainers.model.demo_base import ensure_demo_base
    from trainers.model.gpt_model import GPTConfig

    config = yaml.safe_load((REPO_ROOT / "checkpoints" / "demo.yaml").read_text())
    gpt = config["gpt"]
    gpt.update(model_dim=width or gpt["model_dim"], layers=layers or gpt["layers"])
    gpt["heads"] = max(1, gpt["model_dim"] // 64)
    root.mkdir(parents=True, exist_ok=True)
    model_yaml = root.parent / f"model_{gpt['model_dim']}x{gpt['layers']}.yaml"  # beside the corpus, not in it
    model_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
    corpus = ensure_demo_assets(root, DemoCorpusSpec(model_dim=gpt["model_dim"], vocab_size=gpt["number_text_tokens"],
                                                     num_codes=gpt["start_mel_token"]))
    base = ensure_demo_base(root, GPTConfig.from_yaml_section(gpt))
    return ["--demo", "--config", str(model_yaml), "--train-manifest", str(corpus.train_manifest),
            "--val-manifest", str(corpus.val_manifest), "--tokenizer", str(corpus.tokenizer),
            "--base-checkpoint", str(base)]


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
    """Each save's blocked time, the final save's excluded (its write is waited for after the line)."""
    return [float(s) for s in re.findall(r"the checkpoint save held the \d+ processes for ([\d.]+) s", log)][:-1]


def main() -> int:
    args = parse_args()
    given = args.work_dir is not None
    work = args.work_dir.resolve() if given else Path(tempfile.mkdtemp(prefix="ddp_scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    before = uptime()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPU cores, python {platform.python_version()}")
    print(f"uptime before: {before}")
    try:
        import torch

        flags = [*model_flags(work / "assets", args.width, args.layers), "--effective-batch", str(EFFECTIVE),
                 "--max-steps", str(args.steps), "--log-interval", str(args.log_interval),
                 "--save-interval", str(args.save_interval),
                 "--val-interval", "0", "--max-val-batches", "1", "--keep-checkpoints", "1", "--num-workers", "0"]
        model = f"model_dim {args.width}, {args.layers or 'demo'} layers" if args.width or args.layers else "demo model"
        print(f"torch {torch.__version__}; {model} on the CPU (gloo); effective batch {EFFECTIVE}, {args.steps} steps "
              f"per run, a save every {args.save_interval}, {args.repeats} round(s)")
        names = [n for n in SETTINGS if (SETTINGS[n][0] > 1 or not args.saves_only) and (not args.smoke or n in SMOKE)]
        rates: dict[str, list[float]] = {name: [] for name in names}
        blocks: dict[str, list[float]] = {name: [] for name in names if SETTINGS[name][0] > 1}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order to spread drift
                processes, threads, extra_flags = SETTINGS[name]
                out = work / f"run_{r}_{names.index(name)}"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.monotonic()
                log = train(out, [*flags, "--batch-size", str(EFFECTIVE // processes), *extra_flags], processes,
                            threads)
                rate, intervals = steps_per_second(log)
                rates[name].append(rate)
                extra = ""
                if processes > 1:
                    held = save_blocks(log)
                    blocks[name].append(statistics.median(held))
                    size = (out / "latest.pth").stat().st_size / 2**20
                    extra = f"; blocked per save {', '.join(f'{h:.3f}' for h in held)} s ({size:.1f} MiB checkpoint)"
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
    base = statistics.median(rates["1 proc x 1 thread"]) if "1 proc x 1 thread" in rates else None
    for name, values in rates.items():
        m = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        ratio = f"{m / base:.2f}x 1 proc x 1 thread; " if base else ""
        print(f"  {name:20s} {m:6.2f} steps/s  ({ratio}runs {runs})")
    for name, values in blocks.items():
        print(f"  loop blocked per checkpoint save, {name}: {statistics.median(values):.3f} s "
              f"(runs {', '.join(f'{b:.3f}' for b in values)})")
    print(f"uptime after: {uptime()}")
    print("GPU figures: missing (no multi-GPU machine was available; NCCL was not exercised)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
