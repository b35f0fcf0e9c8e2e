#!/usr/bin/env python3
"""What --amp and --deterministic cost per training step, on this machine.

    python benchmarks/amp_cost.py [--repeats 5] [--device cpu|cuda] [--threads N] [--variants fp32,bf16,...] [--smoke]

At the official width (model_dim 1280, 20 heads, the official vocabularies; 2 layers instead of
24), random weights and data, 2 samples of 394 positions (the shapes of
benchmarks/dropout_cost.py), dropout 0.1: one whole training step (forward and backward of
`loss_sums`, clipping, AdamW) for each of

  fp32           --amp off (what --amp auto is on the CPU)
  bf16           --amp bf16 (autocast; what auto is on GPUs with bf16)
  fp16           --amp fp16 (autocast and the loss scaler; what auto is on T4 / V100)
  fp32 determ.   --amp off --deterministic (torch's deterministic algorithms, the gather cross-entropy)

timed in rotating order within each round after an untimed warm-up round; medians are printed
with every round's time. Then the two cross-entropy formulations alone (forward and backward
of the mel head's loss over 2 x 257 positions and 8,194 classes). On a shared machine expect
10-20% noise; the CPU figures say nothing about a GPU, where --device cuda runs the same.
fp16 autocast on a CPU without fp16 arithmetic is very slow (minutes per step): --variants
leaves it out (the figures are relative to fp32, which is always run). --smoke runs every variant once at
width 64 with 1 layer (seconds; tests/test_benchmarks.py): it checks the script, its figures mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.dropout_cost import make_batch, official_width_config  # noqa: E402
from trainers.model.cross_entropy import summed_cross_entropy  # noqa: E402
from trainers.model.gpt_model import UnifiedVoiceGPT, dropout_keys  # noqa: E402

VARIANTS = {"fp32": (None, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, False),
            "fp32 determ.": (None, True)}
BATCH = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (>= 3)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--smoke", action="store_true",
                   help="one round at width 64, 1 layer: checks the script runs, measures nothing")
    args = p.parse_args()
    if args.repeats < 3:
        p.error("--repeats must be at least 3")
    if args.smoke:
        args.repeats = 1
    args.variants = ["fp32", *(v for v in args.variants.split(",") if v != "fp32")]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; use {', '.join(VARIANTS)}")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: UnifiedVoiceGPT, optimizer: torch.optim.Optimizer, batch: dict, name: str,
               device: torch.device) -> float:
    """Seconds for one optimizer step of the variant `name`."""
    dtype, deterministic = VARIANTS[name]
    torch.use_deterministic_algorithms(deterministic)
    model.deterministic_loss = deterministic
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    sync(device)
    t0 = time.perf_counter()
    with autocast:
        sums = model.loss_sums(**batch, dropout_keys=dropout_keys(0, 0, torch.arange(BATCH, device=device)))
        loss = 0.2 * sums["text_ce"] / sums["text_tokens"] + 0.8 * sums["mel_ce"] / sums["mel_tokens"]
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - t0


def cross_entropy_times(device: torch.device, repeats: int) -> dict[str, float]:
    """Median milliseconds of forward + backward of each formulation on mel-head-sized logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH * 257, 8194, generator=g).to(device).requires_grad_()
    targets = torch.randint(0, 8192, (BATCH * 257,), generator=g).to(device)
    times: dict[str, list[float]] = {"fused": [], "gather": []}
    for _ in range(repeats + 1):
        for name in times:
            sync(device)
            t0 = time.perf_counter()
            summed_cross_entropy(logits, targets, deterministic=name == "gather").backward()
            sync(device)
            times[name].append(time.perf_counter() - t0)
            logits.grad = None
    return {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = official_width_config(args.smoke)
    model = UnifiedVoiceGPT(cfg).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = make_batch(cfg, BATCH, device)
    names = args.variants
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for round_ in range(args.repeats + 1):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                seconds = train_step(model, optimizer, batch, name, device)
                if round_:  # round 0 warms up every variant
                    times[name].append(seconds)
    finally:
        torch.use_deterministic_algorithms(False)
    width = f"--smoke: width {cfg.model_dim}" if args.smoke else "official width"
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, device {device}, "
          f"{torch.get_num_threads()} threads; {width}, {cfg.layers} layers, batch {BATCH} x 394 positions")
    base = statistics.median(times["fp32"])
    for name, values in times.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {name:13s} {median:.3f} s per step ({median / base:.2f}x fp32)  rounds: {rounds}")
    ce = cross_entropy_times(device, args.repeats)
    print(f"  cross-entropy alone, forward + backward, {BATCH * 257} x 8194 logits: fused {ce['fused']:.2f} ms, "
          f"gather {ce['gather']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
