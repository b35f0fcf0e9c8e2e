#!/usr/bin/env python3
"""IndexTTS-2.5 against IndexTTS2 (2.0), on this machine: trainable values, optimizer state and checkpoint bytes,
step time and peak memory, full fine-tuning and LoRA; and the memory of 2.5's text loss (a 60,510-row head).

    python benchmarks/family_cost.py [--repeats 3] [--rank 32] [--text-rows 4096] [--smoke]

Counted at the official configs (24 layers, model_dim 1280; 2.0: 12,000 text tokens, 2.5: 60,509), each family's
model built on torch's meta device: the values a step updates, AdamW's two fp32 moments per trainable value,
and a checkpoint as 4 bytes per value it keeps (full: the model's weights and both moments; LoRA: the adapters
and their moments), plus, for reference, the tensors each family carries for inference unchanged (2.0: the
conditioning encoders; 2.5: the emotion encoders; not built here, so not counted).

Measured at the official width with 2 layers instead of 24 (the official 2.5 model does not fit this
machine's memory with its optimizer state), random weights and data, 2 samples of 100 text ids and 256 codes,
dropout 0.1, fp32: one whole training step (forward and backward of `loss_sums`, clipping, AdamW over the
trainable tensors), each variant in its own process so that its peak resident memory (ru_maxrss, torch itself
included, ~0.3 GB) is its own; an untimed warm-up step, then the median of --repeats steps.

The text loss alone: --text-rows rows of final-normed hidden states (width 1280) through each text head and its
cross-entropy, forward and backward, in a process of its own: what its forward keeps for backward (the bytes of
the distinct storages autograd saves, the head's weights aside: alive beside every other activation until
backward, so this is what the loss adds to a step's peak), the resident memory added at its own peak (ru_maxrss after minus before) and its
time. 2.5 computes it in blocks of 1024 rows whose logits are recomputed in backward
(trainers/model/cross_entropy.py chunked_head_cross_entropy); shown beside the head at once, as 2.0 computes
it. --smoke: width 64, 1 layer, 1 step, 256 rows (seconds; tests/test_benchmarks.py): it checks the script, its
figures mean nothing (and every variant runs in the script's own process).
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

from trainers.families import FAMILIES  # noqa: E402
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT, dropout_keys  # noqa: E402
from trainers.model.lora import LoraSettings, add_adapters  # noqa: E402

BATCH, TEXT_LEN, CODE_LEN = 2, 100, 256
GB = 1e9
OFFICIAL_25 = {"number_text_tokens": 60509, "model_dim": 1280, "heads": 20, "layers": 24, "max_text_tokens": 600,
               "max_mel_tokens": 1815, "number_mel_codes": 8194, "start_mel_token": 8192, "stop_mel_token": 8193}
SMOKE_SIZE = {"model_dim": 64, "heads": 4, "layers": 1}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed steps per variant (>= 1)")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--text-rows", type=int, default=4096, help="rows of the text-loss measurement")
    p.add_argument("--smoke", action="store_true", help="width 64, 1 layer, 1 step: checks the script runs")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: "step FAMILY RANK" or "loss FAMILY BLOCKS"
    args = p.parse_args()
    if args.repeats < 1 or args.rank < 1 or args.text_rows < 1:
        p.error("--repeats, --rank and --text-rows must be at least 1")
    if args.smoke:
        args.repeats, args.text_rows = 1, 256
    return args


def official(family: str, **overrides: int) -> GPTConfig:
    """The official gpt section of a family (2.5: the 2.0 config with 2.5's text vocabulary), with overrides."""
    section = yaml.safe_load((REPO_ROOT / "checkpoints" / "config.yaml").read_text())["gpt"]
    if family == "indextts25":
        section = {**section, **OFFICIAL_25}
    return FAMILIES[family].read_config(section, **overrides)


def measured_config(family: str, smoke: bool) -> GPTConfig:
    return official(family, **{"layers": 2, **(SMOKE_SIZE if smoke else {})}, dropout=0.1)


def build(family: str, cfg: GPTConfig, rank: int) -> torch.nn.Module:
    model = FAMILIES[family].build_model(cfg)
    if rank:
        add_adapters(model, LoraSettings(rank=rank, alpha=2.0 * rank), seed=0)
    return model


def counts(family: str, rank: int) -> dict[str, int]:
    with torch.device("meta"):
        model = build(family, official(family), rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable": trainable, "kept": trainable if rank else sum(p.numel() for p in model.parameters())}


def batch(model: torch.nn.Module, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    inputs = {k: (torch.randn(v.shape, generator=g) if v.is_floating_point() else v)
              for k, v in model.example_conditioning(BATCH, "cpu").items()}
    return {**inputs, "text_ids": torch.randint(2, cfg.number_text_tokens, (BATCH, TEXT_LEN), generator=g),
            "text_lens": torch.full((BATCH,), TEXT_LEN),
            "codes": torch.randint(0, cfg.start_mel_token, (BATCH, CODE_LEN), generator=g),
            "code_lens": torch.full((BATCH,), CODE_LEN)}


def measure_step(family: str, rank: int, smoke: bool, repeats: int) -> dict:
    torch.manual_seed(0)
    cfg = measured_config(family, smoke)
    model = build(family, cfg, rank).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    inputs, keys = batch(model, cfg), dropout_keys(0, 0, torch.arange(BATCH))
    times = []
    for step in range(repeats + 1):
        t0 = time.perf_counter()
        sums = model.loss_sums(**inputs, dropout_keys=keys)
        (0.2 * sums["text_ce"] / sums["text_tokens"] + 0.8 * sums["mel_ce"] / sums["mel_tokens"]).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "rounds": times, "peak_bytes": peak_bytes()}


def measure_loss(family: str, blocks: bool, smoke: bool, rows: int) -> dict:
    """The text loss alone, forward and backward: what its forward keeps for backward (bytes of the distinct
    storages autograd saves), the resident memory forward and backward add at their peak, and the time."""
    torch.manual_seed(0)
    cfg = measured_config(family, smoke)
    model = FAMILIES[family].build_model(cfg)
    h = torch.randn(rows, cfg.model_dim, requires_grad=True)
    targets = torch.randint(0, cfg.number_text_tokens, (rows,))
    loss_of = model.text_cross_entropy if blocks else UnifiedVoiceGPT.text_cross_entropy.__get__(model)
    loss_of(h[:8], targets[:8]).backward()  # allocator and kernels warmed on a little
    kept: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # kept anyway: not the loss's

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    before = peak_bytes()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(h, targets)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {"saved_bytes": sum(kept.values()), "added_bytes": peak_bytes() - before, "seconds": seconds,
            "columns": cfg.number_text_tokens + 1}


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(args: argparse.Namespace) -> int:
    kind, family, value = args.one.split()
    result = (measure_step(family, int(value), args.smoke, args.repeats) if kind == "step"
              else measure_loss(family, value == "blocks", args.smoke, args.text_rows))
    print(json.dumps(result))
    return 0


def run_child(args: argparse.Namespace, what: str) -> dict | None:
    if args.smoke:  # its figures mean nothing: measured in this process, without a start-up per variant
        kind, family, value = what.split()
        return (measure_step(family, int(value), True, args.repeats) if kind == "step"
                else measure_loss(family, value == "blocks", True, args.text_rows))
    command = [sys.executable, __file__, "--one", what, "--repeats", str(args.repeats), "--text-rows",
               str(args.text_rows), *(["--smoke"] if args.smoke else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"{what} failed (exit {done.returncode}):\n{done.stderr}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    args = parse_args()
    if args.one is not None:
        return child(args)
    names = {"indextts2": "2.0", "indextts25": "2.5"}
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, CPU, "
          f"{torch.get_num_threads()} threads")
    print(f"official configs (24 layers, width 1280; text tokens 2.0 12000, 2.5 60509), counted on the meta device; "
          f"checkpoint = kept values + AdamW moments, 4 bytes each (LoRA r{args.rank}: adapters and moments):")
    for family, name in names.items():
        for rank in (0, args.rank):
            c = counts(family, rank)
            optimizer_bytes = 2 * 4 * c["trainable"]
            label = f"{name} {'full' if not rank else f'LoRA r{rank}'}"
            print(f"  {label:13s} trainable {c['trainable']:,}; optimizer state {optimizer_bytes / GB:.3f} GB; "
                  f"checkpoint {(4 * c['kept'] + optimizer_bytes) / GB:.3f} GB")
    cfg = measured_config("indextts25", args.smoke)
    print(f"measured: width {cfg.model_dim}, {cfg.layers} layers (not 24: memory), batch {BATCH} x ({TEXT_LEN} text "
          f"ids, {CODE_LEN} codes), fp32, each variant in its own process, median of {args.repeats} steps after a "
          "warm-up:")
    base = None
    for family, name in names.items():
        for rank in (0, args.rank):
            m = run_child(args, f"step {family} {rank}")
            if m is None:
                return 1
            base = base or m["step_s"]
            label = f"{name} {'full' if not rank else f'LoRA r{rank}'}"
            rounds = ", ".join(f"{t:.3f}" for t in m["rounds"])
            print(f"  {label:13s} {m['step_s']:.3f} s per step ({m['step_s'] / base:.2f}x 2.0 full); peak resident "
                  f"{m['peak_bytes'] / GB:.2f} GB  rounds: {rounds}")
    print(f"text loss alone, forward + backward, {args.text_rows} rows of width {cfg.model_dim}, each in its own "
          "process: what the forward keeps for backward (autograd's saved tensors), the resident memory added at "
          "the peak, the time:")
    for family, blocks, label in (("indextts2", False, "2.0 at once"), ("indextts25", False, "2.5 at once"),
                                  ("indextts25", True, "2.5 in blocks")):
        m = run_child(args, f"loss {family} {'blocks' if blocks else 'once'}")
        if m is None:
            return 1
        logits = args.text_rows * m["columns"] * 4
        print(f"  {label:14s} {m['columns']} columns (fp32 logits {logits / GB:.3f} GB): keeps {m['saved_bytes'] / GB:.3f}"
              f" GB for backward; peak adds {m['added_bytes'] / GB:.3f} GB; {m['seconds']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
