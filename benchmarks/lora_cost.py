#!/usr/bin/env python3
"""What LoRA saves against full fine-tuning, on this machine: trainable parameters, optimizer state,
checkpoint size, step time and peak memory.

    python benchmarks/lora_cost.py [--repeats 5] [--ranks 8,32] [--smoke]

Counted at the official config (24 layers, model_dim 1280, the official vocabularies), built on torch's
meta device (no memory): the parameters a step updates; AdamW's two fp32 moments per trainable value;
and what a checkpoint must hold, computed as 4 bytes per value of every tensor it keeps (full: all weights
the training forward uses and both moments; LoRA: the adapters and their moments, the base being named by
path and fingerprint instead of copied), computed here; the trainer's LoRA checkpoints hold exactly these
tensors (tests/test_lora_runs.py), plus the small run state every checkpoint has. With an extended tokenizer the new text rows also train (2 x model_dim values per new
token, plus moments); not counted here (the official vocabulary only).

Measured at the official width with 2 layers instead of 24 (so it fits a small machine), random weights
and data, 2 samples of 394 positions, dropout 0.1, fp32: one whole training step (forward and backward
of `loss_sums`, clipping, AdamW over the trainable tensors), each variant in its own process so that its
peak resident memory (ru_maxrss, which includes torch itself, ~0.3 GB) is its own; an untimed warm-up
step, then the median of --repeats steps. LoRA targets: all four projections of every block
(trainers/model/lora.py DEFAULT_TARGETS), alpha = 2 x rank. --smoke: width 64, 1 layer, 1 step, the first rank
only (seconds;
tests/test_benchmarks.py): it checks the script, its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from benchmarks.dropout_cost import make_batch, official_width_config  # noqa: E402
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT, dropout_keys  # noqa: E402
from trainers.model.lora import LoraSettings, add_adapters  # noqa: E402

BATCH = 2
GB = 1e9


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant (>= 3)")
    p.add_argument("--ranks", default="8,32", help="comma-separated LoRA ranks")
    p.add_argument("--smoke", action="store_true", help="width 64, 1 layer, 1 step: checks the script runs")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this variant, print JSON
    args = p.parse_args()
    if args.repeats < 3:
        p.error("--repeats must be at least 3")
    try:
        args.ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks: expected comma-separated integers, got {args.ranks!r}")
    if any(r < 1 for r in args.ranks):
        p.error("--ranks: every rank must be at least 1")
    if args.smoke:
        args.repeats, args.ranks = 1, args.ranks[:1]
    return args


def build(cfg: GPTConfig, rank: int) -> UnifiedVoiceGPT:
    model = UnifiedVoiceGPT(cfg)
    if rank:
        add_adapters(model, LoraSettings(rank=rank, alpha=2.0 * rank), seed=0)
    return model


def counts(rank: int) -> dict[str, int]:
    """Values at the official config: trainable, and kept in a checkpoint (weights or adapters)."""
    section = yaml.safe_load((REPO_ROOT / "checkpoints" / "config.yaml").read_text())["gpt"]
    with torch.device("meta"):
        model = build(GPTConfig.from_yaml_section(section), rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kept = trainable if rank else sum(p.numel() for p in model.parameters())
    return {"trainable": trainable, "kept": kept}


def measure(cfg: GPTConfig, rank: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = build(cfg, rank).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    batch = make_batch(cfg, BATCH, torch.device("cpu"))
    keys = dropout_keys(0, 0, torch.arange(BATCH))
    times = []
    for step in range(repeats + 1):
        t0 = time.perf_counter()
        sums = model.loss_sums(**batch, dropout_keys=keys)
        loss = 0.2 * sums["text_ce"] / sums["text_tokens"] + 0.8 * sums["mel_ce"] / sums["mel_tokens"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # step 0 warms up and creates the optimizer state
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"step_s": statistics.median(times), "rounds": times, "peak_bytes": peak}


def child(args: argparse.Namespace) -> int:
    cfg = official_width_config(args.smoke)
    print(json.dumps(measure(cfg, int(args.one), args.repeats)))
    return 0


def main() -> int:
    args = parse_args()
    if args.one is not None:
        return child(args)
    variants = [0, *args.ranks]
    cfg = official_width_config(args.smoke)
    width = f"--smoke: width {cfg.model_dim}" if args.smoke else f"official width {cfg.model_dim}"
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, CPU, "
          f"{torch.get_num_threads()} threads")
    print("official config (24 layers), counted on the meta device; checkpoint = kept values + AdamW moments, "
          "4 bytes each (LoRA: the adapters and their moments, no copy of the base):")
    full = counts(0)
    for rank in variants:
        c = counts(rank)
        name = "full" if not rank else f"LoRA r{rank}"
        optimizer_bytes = 2 * 4 * c["trainable"]
        checkpoint_bytes = 4 * c["kept"] + optimizer_bytes
        print(f"  {name:9s} trainable {c['trainable']:,} ({100 * c['trainable'] / full['trainable']:.2f}% of full); "
              f"optimizer state {optimizer_bytes / GB:.3f} GB; checkpoint {checkpoint_bytes / GB:.3f} GB")
    print(f"measured: {width}, {cfg.layers} layers, batch {BATCH} x 394 positions, fp32, each variant in its own "
          f"process, median of {args.repeats} steps after a warm-up:")
    base_time = None
    for rank in variants:
        command = [sys.executable, __file__, "--one", str(rank), "--repeats", str(max(args.repeats, 3))]
        if args.smoke:
            command.append("--smoke")
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"variant rank {rank} failed (exit {done.returncode}):\n{done.stderr}", file=sys.stderr)
            return 1
        m = json.loads(done.stdout.strip().splitlines()[-1])
        base_time = base_time or m["step_s"]
        name = "full" if not rank else f"LoRA r{rank}"
        rounds = ", ".join(f"{t:.3f}" for t in m["rounds"])
        print(f"  {name:9s} {m['step_s']:.3f} s per step ({m['step_s'] / base_time:.2f}x full); peak resident "
              f"{m['peak_bytes'] / GB:.2f} GB  rounds: {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
