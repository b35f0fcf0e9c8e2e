#!/usr/bin/env python3
"""What the moving average of the weights (--ema-decay) gives and costs.

    python benchmarks/ema.py [--work-dir DIR] [--decays 0.9,0.97,0.99] [--repeats 5] [--cost-only] [--smoke]

1. What it gives, on the demo (checkpoints/demo.yaml, its corpus and settings: 240 steps, learning rate 3e-3 with 20
   warmup steps and a cosine to 3e-4, dropout 0), through the trainer's main() in this process: the same run
   once per --ema-decay (--ema-start 0), validating every 40 steps on the demo's 128 validation samples. Printed
   per validation: the weights' validation mel loss (the same bits in every run, checked: the average changes no
   weight) and each average's.
2. What it costs. Memory: one fp32 copy of the trained parameters, counted at the official config (24 layers) on
   torch's meta device, for full fine-tuning and LoRA r8 (benchmarks/lora_cost.py counts). Time: one update
   (WeightsEMA.step_done, what the trainer runs after each optimizer step) against one training step (forward,
   backward, clipping, AdamW; 2 samples of 394 positions, fp32, dropout 0.1) of the official width with 2 of its
   24 layers on this CPU, medians of --repeats after a warm-up. Both grow with the layers, so their ratio is about
   that of the whole model. A validation with the average costs a second loss pass over the validation samples.
   --cost-only: part 2 alone.

--smoke (tests/test_benchmarks.py): 8 demo steps, one decay, width 64: it checks the script, its figures mean nothing.
Exit 0 unless a run fails (2) or the weights differ between the runs (1).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.dropout_cost import make_batch, official_width_config  # noqa: E402
from benchmarks.forgetting import demo_assets  # noqa: E402
from benchmarks.lora_cost import counts  # noqa: E402
from trainers.checkpoint import schema  # noqa: E402
from trainers.main import main as main_of_the_trainer  # noqa: E402
from trainers.model.gpt_model import UnifiedVoiceGPT, dropout_keys  # noqa: E402
from trainers.training.ema import WeightsEMA  # noqa: E402

GB = 1e9
STEPS, VAL_EVERY, SMOKE_STEPS = 240, 40, 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=None, help="where the demo runs go [a fresh temp dir]")
    p.add_argument("--decays", default="0.9,0.97,0.99", help="comma-separated --ema-decay values")
    p.add_argument("--repeats", type=int, default=5, help="timed updates and steps (>= 3)")
    p.add_argument("--cost-only", action="store_true", help="the memory and time only, no demo runs")
    p.add_argument("--smoke", action="store_true", help="a few steps, one decay: checks the script runs")
    args = p.parse_args()
    args.decays = [float(d) for d in args.decays.split(",")][: 1 if args.smoke else None]
    args.repeats = 1 if args.smoke else max(3, args.repeats)
    return args


def demo_run(work: Path, decay: float, steps: int) -> list[dict]:
    """The demo with this --ema-decay: its validations (history entries)."""
    with contextlib.redirect_stderr(io.StringIO()):  # "Reusing demo corpus" after the first run
        folder, tokenizer, base, _ = demo_assets(work / "demo_data")
    out = work / f"ema{decay:g}"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main_of_the_trainer([
            "--demo", "--output-dir", str(out), "--train-manifest", str(folder / "train.jsonl"), "--val-manifest",
            str(folder / "val.jsonl"), "--tokenizer", str(tokenizer), "--base-checkpoint", str(base),
            "--max-steps", str(steps), "--val-interval", str(VAL_EVERY if steps == STEPS else 4),
            "--max-val-batches", "0" if steps == STEPS else "1", "--ema-decay", str(decay), "--save-interval", "1000"])
    if status != 0:
        print(f"the demo with --ema-decay {decay:g} failed (exit {status}):\n{err.getvalue()[-3000:]}", file=sys.stderr)
        raise SystemExit(2)
    return [h for h in schema.read(out / "latest.pth", mmap=True).history if h["kind"] == "val"]


def timed(call, repeats: int) -> list[float]:
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        call()
        if i:  # the first warms up (and creates AdamW's state)
            times.append(time.perf_counter() - t0)
    return times


def update_and_step(smoke: bool, repeats: int) -> tuple[int, list[float], list[float]]:
    """(trained values, EMA update times, training step times) at the official width, 2 layers."""
    cfg = official_width_config(smoke)
    torch.manual_seed(0)
    model = UnifiedVoiceGPT(cfg).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    batch, keys = make_batch(cfg, 2, torch.device("cpu")), dropout_keys(0, 0, torch.arange(2))

    def step() -> None:
        sums = model.loss_sums(**batch, dropout_keys=keys)
        (0.2 * sums["text_ce"] / sums["text_tokens"] + 0.8 * sums["mel_ce"] / sums["mel_tokens"]).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    ema = WeightsEMA(model, 0.999, 0)
    steps = timed(step, repeats)
    updates = timed(lambda: ema.step_done(10), repeats)
    return sum(p.numel() for p in params), updates, steps


def quality(work: Path, decays: list[float], steps: int) -> bool:
    """Part 1: the table; whether the weights' validation is the same in every run."""
    runs = {decay: demo_run(work, decay, steps) for decay in decays}
    weights = [[v["mel_loss"] for v in vals] for vals in runs.values()]
    same = all(w == weights[0] for w in weights)
    print(f"demo, {steps} steps, validation mel loss of the weights and of their average (--ema-decay D, "
          "--ema-start 0):")
    print("| step | weights | " + " | ".join(f"EMA {d:g}" for d in runs) + " |")
    print("|---|---|" + "---|" * len(runs))
    for i, v in enumerate(next(iter(runs.values()))):
        print(f"| {v['step']} | {v['mel_loss']:.4f} | "
              + " | ".join(f"{vals[i]['ema/mel_loss']:.4f}" for vals in runs.values()) + " |")
    print(f"the weights' validation is the same in every run: {'yes' if same else 'NO'}")
    return same


def costs(smoke: bool, repeats: int) -> None:
    """Part 2: memory at the official config, time at the official width."""
    for rank, name in ((0, "full fine-tuning"), (8, "LoRA r8")):
        trained = counts(rank)["trainable"]
        print(f"memory, official config, {name}: {trained:,} trained values, the average {4 * trained / GB:.3f} GB "
              "fp32 (and as much more in each checkpoint)")
    values, updates, step_times = update_and_step(smoke, repeats)
    update, step = statistics.median(updates), statistics.median(step_times)
    print(f"time, {'--smoke width' if smoke else 'official width'}, 2 layers ({values:,} trained values): "
          f"EMA update {1000 * update:.2f} ms, training step {step:.3f} s: +{100 * update / step:.2f}% per step  "
          f"rounds: {', '.join(f'{1000 * t:.2f}' for t in updates)} ms")


def main() -> int:
    args = parse_args()
    started, same = time.monotonic(), True
    print(f"machine: {platform.machine()}, torch {torch.__version__}, CPU, {torch.get_num_threads()} threads")
    if not args.cost_only:
        work = args.work_dir.resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="ema-"))
        try:
            same = quality(work, args.decays, SMOKE_STEPS if args.smoke else STEPS)
        finally:
            if args.work_dir is None:
                shutil.rmtree(work, ignore_errors=True)
    costs(args.smoke, args.repeats)
    print(f"total {time.monotonic() - started:.0f} s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
