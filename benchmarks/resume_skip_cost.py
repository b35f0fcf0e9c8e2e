#!/usr/bin/env python3
"""How much does resuming deep into a large epoch cost compared with resuming at its start?

    python benchmarks/resume_skip_cost.py [--lines 200000] [--repeats 3] [--work-dir DIR] [--smoke]

What it does:

1. Builds the demo corpus, tokenizer and base checkpoint (checkpoints/demo.yaml) once, and writes a
   training manifest of --lines paired lines (default 200,000) that cycle through the demo's
   384 paired lines, each with a unique id ("bench_000000", ...). The feature files are shared.
2. Runs the trainer fresh for one optimizer step on that manifest, which writes a real
   checkpoint (model, optimizer, RNG state, configuration, fingerprints of the big manifest).
3. Makes two run directories from that checkpoint by editing ONLY its position fields
   (through the checkpoint schema: data.epoch, data.step_in_epoch, data.samples_in_epoch,
   progress.step, progress.samples_seen, and the saved max_steps so that the resume runs
   exactly one more step):
     A  epoch 1, step 0 of the epoch             (resume at sample 0)
     B  epoch 1, step 75% of the epoch's steps    (resume deep into the epoch)
   Both sit in epoch 1 so both start with a non-zero global step (no step-0 validation) and
   both draw a fresh epoch permutation; they differ only in where in the epoch they resume,
   which is exactly what the cost of skipping the already-trained samples depends on.
4. Times `train_gpt_v2.py --resume auto --output-dir DIR --max-steps N+1` for A and B
   alternately (--repeats times, each from a pristine copy of the run directory), from the
   moment the subprocess is started until the trainer logs "first optimizer step finished";
   the trainer's own figure (seconds since its process started) is parsed from that line too.
   The process is killed once that line has been read: only the time to the first step counts.

Prints the medians and `ratio deep/zero`; exits 0 when the ratio is at most 1.20, else 1
(2 when the benchmark itself could not run). --smoke (for tests/test_benchmarks.py): 64 lines, one
resume per position, the ratio not judged: it checks that the script runs.
"""
from __future__ import annotations

import argparse
import json
import math
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

import torch  # noqa: E402
import yaml  # noqa: E402

from trainers.checkpoint import schema  # noqa: E402
from trainers.model.demo_base import ensure_demo_base  # noqa: E402
from trainers.data.demo_data import DemoAssets, DemoCorpusSpec, ensure_demo_assets  # noqa: E402
from trainers.model.gpt_model import GPTConfig  # noqa: E402

TRAINER = REPO_ROOT / "trainers" / "train_gpt_v2.py"
DEMO_YAML = REPO_ROOT / "checkpoints" / "demo.yaml"
BATCH = 16
TARGET_RATIO = 1.2
DEEP_FRACTION = 0.75
FIRST_STEP_RE = re.compile(r"first optimizer step finished ([0-9.]+) s after process start")
RESUME_RE = re.compile(r"resuming from .* \(step (\d+), epoch (\d+), step (\d+) of that epoch[;)]")
PAIRED_PATH_KEYS = ("prompt_condition_path", "prompt_emo_vec_path", "target_text_ids_path",
                    "target_codes_path", "target_emo_vec_path")
RUN_TIMEOUT_S = 300


class BenchError(RuntimeError):
    pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=200_000, help="lines in the training manifest (one epoch)")
    p.add_argument("--repeats", type=int, default=3, help="timed resumes per position; the median is reported")
    p.add_argument("--work-dir", type=Path, default=None, help="where to build everything [a fresh temp dir]")
    p.add_argument("--keep", action="store_true", help="keep the work dir (a given --work-dir is always kept)")
    p.add_argument("--smoke", action="store_true",
                   help="64 lines, one resume per position, the ratio not judged: checks the script runs")
    args = p.parse_args()
    if args.lines < 2 * BATCH or args.repeats < 1:
        p.error("--lines must be at least 32 and --repeats at least 1")
    if args.smoke:
        args.lines, args.repeats = 4 * BATCH, 1
    return args


# --- data ---------------------------------------------------------------------------------------


def build_assets(work: Path) -> tuple[DemoAssets, Path]:
    """Demo corpus, tokenizer and base checkpoint under work/demo_data."""
    gpt = yaml.safe_load(DEMO_YAML.read_text(encoding="utf-8"))["gpt"]
    spec = DemoCorpusSpec(model_dim=gpt["model_dim"], vocab_size=gpt["number_text_tokens"],
                          num_codes=gpt["start_mel_token"])
    assets = ensure_demo_assets(work / "demo_data", spec)
    base = ensure_demo_base(work / "demo_data", GPTConfig.from_yaml_section(gpt))
    return assets, base


def write_big_manifest(demo_train: Path, out: Path, lines: int) -> None:
    """`lines` paired lines cycling through the demo's; paths rewritten relative to out's folder."""
    prefix = os.path.relpath(demo_train.parent, out.parent)
    rows = [json.loads(line) for line in demo_train.read_text(encoding="utf-8").splitlines() if line.strip()]
    for row in rows:
        if "prompt_condition_path" not in row or "target_codes_path" not in row:
            raise BenchError(f"{demo_train}: expected paired lines, got {sorted(row)}")
        for key in PAIRED_PATH_KEYS:
            row[key] = f"{prefix}/{row[key]}"
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for n in range(lines):
            row = rows[n % len(rows)]
            row["id"] = f"bench_{n:06d}"
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


# --- runs ---------------------------------------------------------------------------------------


def trainer_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("INDEXTTS_TRAIN_KILL_AT", None)  # trainers.faults: never inject a kill here
    return env


def run_fresh(run_dir: Path, common: list[str]) -> None:
    cmd = [sys.executable, str(TRAINER), *common, "--output-dir", str(run_dir), "--max-steps", "1"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0 or not (run_dir / "latest.pth").is_file():
        raise BenchError(f"the fresh run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")


def make_positioned_copy(src: Path, dst: Path, epoch: int, step_in_epoch: int, spe: int, lines: int) -> int:
    """Copy run dir src to dst with its checkpoint moved to (epoch, step_in_epoch); returns the global step."""
    shutil.copytree(src, dst)
    ckpt = schema.read(dst / "latest.pth")
    for old in [*dst.glob("model_step*.pth"), dst / "latest.pth"]:
        old.unlink()
    step = epoch * spe + step_in_epoch
    ckpt = ckpt.edited("data", epoch=epoch, step_in_epoch=step_in_epoch,
                       samples_in_epoch=min(step_in_epoch * BATCH, lines))
    ckpt = ckpt.edited("progress", step=step, samples_seen=step * BATCH)
    ckpt = ckpt.edited("run", config={**ckpt.settings, "max_steps": step + 1})
    target = dst / f"model_step{step}.pth"
    torch.save(ckpt.to_file(), target)
    os.link(target, dst / "latest.pth")
    return step


def time_resume(pristine: Path, live: Path, step: int, expect: tuple[int, int, int]) -> tuple[float, float]:
    """Wall seconds from Popen to the trainer's first-step line, and the trainer's own figure."""
    if live.exists():
        shutil.rmtree(live)
    shutil.copytree(pristine, live)
    cmd = [sys.executable, str(TRAINER), "--resume", "auto", "--output-dir", str(live), "--max-steps", str(step + 1)]
    tail: list[str] = []
    resumed_at = None
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    try:
        for line in proc.stdout:
            now = time.monotonic()
            tail = (tail + [line.rstrip()])[-40:]
            m = RESUME_RE.search(line)
            if m:
                resumed_at = tuple(int(x) for x in m.groups())
            m = FIRST_STEP_RE.search(line)
            if m:
                if resumed_at != expect:
                    raise BenchError(f"{live.name}: the trainer resumed at (step, epoch, step in epoch) {resumed_at}, "
                                     f"expected {expect}")
                return now - start, float(m.group(1))
            if now - start > RUN_TIMEOUT_S:
                break
        raise BenchError(f"{live.name}: no 'first optimizer step finished' line (exit {proc.poll()}):\n"
                         + "\n".join(tail))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def main() -> int:
    args = parse_args()
    given = args.work_dir is not None
    work = args.work_dir.resolve() if given else Path(tempfile.mkdtemp(prefix="resume_skip_cost-"))
    work.mkdir(parents=True, exist_ok=True)
    t_begin = time.monotonic()
    try:
        assets, base = build_assets(work)
        big = work / f"train_{args.lines}.jsonl"
        if not big.is_file():
            write_big_manifest(assets.train_manifest, big, args.lines)
        spe = math.ceil(args.lines / BATCH)
        deep_step = max(1, min(spe - 1, int(spe * DEEP_FRACTION)))
        common = ["--demo", "--train-manifest", str(big), "--val-manifest", str(assets.val_manifest),
                  "--tokenizer", str(assets.tokenizer), "--base-checkpoint", str(base),
                  "--batch-size", str(BATCH), "--grad-accumulation", "1", "--val-interval", "0",
                  "--max-val-batches", "1", "--num-workers", "0", "--save-interval", "1000000"]
        seed_dir = work / "runs" / "seed"
        if seed_dir.exists():
            shutil.rmtree(seed_dir)
        run_fresh(seed_dir, common)
        cases = {}
        for name, sie in (("zero", 0), ("deep", deep_step)):
            pristine = work / "runs" / f"pristine_{name}"
            if pristine.exists():
                shutil.rmtree(pristine)
            step = make_positioned_copy(seed_dir, pristine, 1, sie, spe, args.lines)
            cases[name] = {"pristine": pristine, "live": work / "runs" / f"live_{name}", "step": step,
                           "expect": (step, 1, sie), "sample": sie * BATCH, "wall": [], "own": []}
        for r in range(args.repeats):
            order = ("zero", "deep") if r % 2 == 0 else ("deep", "zero")  # alternate to cancel drift
            for name in order:
                c = cases[name]
                wall, own = time_resume(c["pristine"], c["live"], c["step"], c["expect"])
                c["wall"].append(wall)
                c["own"].append(own)
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 2
    finally:
        if not given and not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    zero, deep = cases["zero"], cases["deep"]
    med = {n: (statistics.median(c["wall"]), statistics.median(c["own"])) for n, c in cases.items()}
    ratio = med["deep"][0] / med["zero"][0]
    print(f"lines in epoch: {args.lines}")
    print(f"steps per epoch: {spe} (effective batch {BATCH})")
    print(f"resume at sample 0:     epoch 1, step {zero['expect'][2]} of the epoch, sample offset {zero['sample']}")
    print(f"resume deep:            epoch 1, step {deep['expect'][2]} of the epoch, sample offset {deep['sample']} "
          f"({deep['sample'] / args.lines:.0%} of the epoch)")
    for n, label in (("zero", "sample 0"), ("deep", "deep    ")):
        walls = ", ".join(f"{w:.2f}" for w in cases[n]["wall"])
        print(f"{label}: median wall {med[n][0]:.2f} s to first optimizer step (runs: {walls}); "
              f"trainer-reported {med[n][1]:.2f} s")
    judged = "; not judged: --smoke" if args.smoke else ""
    print(f"ratio deep/zero = {ratio:.2f} (target <= {TARGET_RATIO:.2f}{judged})")
    print(f"how: wall time from subprocess start to the trainer's 'first optimizer step finished' line, median of "
          f"{args.repeats} alternating runs per position; {os.cpu_count()} CPU core(s), {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}, torch {torch.__version__}, device {'cuda' if torch.cuda.is_available() else 'cpu'} (trainer --device auto, --demo model); "
          f"benchmark total {time.monotonic() - t_begin:.0f} s")
    return 0 if ratio <= TARGET_RATIO or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
