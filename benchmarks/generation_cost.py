#!/usr/bin/env python3
"""What does generating validation samples cost? Greedy mel-code generation (trainers/model/generation.py)
with and without the KV cache.

    python benchmarks/generation_cost.py [--repeats 3] [--layers 2] [--threads N] [--device cpu|cuda] [--smoke]

One generation is what a validation would run: a batch of 4 samples with texts of different lengths, each
generating a fixed number of codes (the stop code is suppressed, as for a model that never stops: the most
a validation can cost at that limit). Random weights; the figures depend only on the sizes. Two configs:

  demo      checkpoints/demo.yaml as it is (width 64, 2 layers), texts of 24-48 ids, 150 codes each
            (its max_mel_tokens), with and without the cache;
  official  checkpoints/config.yaml's width, heads, vocabularies and position tables with --layers of its
            24 layers (cost grows about linearly with layers), texts of 60-120 ids: 16 codes with and
            without the cache, then 500 codes (about 10 s of speech) with the cache only; without it the
            whole sequence is recomputed at each step, so its cost grows with the square of the length.

Each model generates once untimed first, then each case runs --repeats timed runs; the median is printed
with the runs. On a busy machine pass --threads 1: tiny ops with 2+ threads wait on descheduled threads.
--smoke runs every case once at width 64 with 1 layer and 8 codes (seconds; tests/test_benchmarks.py):
its figures say nothing about the cost.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from trainers.model.generation import generate_codes  # noqa: E402
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT  # noqa: E402

BATCH = 4
SMOKE_SIZE = {"model_dim": 64, "heads": 4, "layers": 1}
SMOKE_CODES = 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (>= 1)")
    p.add_argument("--layers", type=int, default=2, help="layers of the official-width model (the official has 24)")
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (fp32)")
    p.add_argument("--smoke", action="store_true", help="every case once at width 64, 1 layer, 8 codes")
    args = p.parse_args()
    if args.repeats < 1 or args.layers < 1:
        p.error("--repeats and --layers must be at least 1")
    return args


def load_config(name: str, **overrides) -> GPTConfig:
    section = yaml.safe_load((REPO_ROOT / "checkpoints" / name).read_text(encoding="utf-8"))["gpt"]
    return GPTConfig.from_yaml_section(section, **overrides)


def build(cfg: GPTConfig, device: torch.device) -> UnifiedVoiceGPT:
    model = UnifiedVoiceGPT(cfg).to(device).eval()
    with torch.no_grad():
        model.mel_head.bias[cfg.stop_mel_token] = -1e4  # never stops: every sample generates max_codes
    return model


def inputs(cfg: GPTConfig, text_range: tuple[int, int], device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    lens = torch.linspace(text_range[0], text_range[1], BATCH).round().long()
    return {
        "condition": torch.randn(BATCH, 32, cfg.model_dim, generator=g).to(device),
        "emo_vec": torch.randn(BATCH, cfg.model_dim, generator=g).to(device),
        "text_ids": torch.randint(2, cfg.number_text_tokens, (BATCH, int(lens.max())), generator=g).to(device),
        "text_lens": lens.to(device),
    }


def timed(model: UnifiedVoiceGPT, batch: dict, codes: int, kv_cache: bool, repeats: int, warm_up: bool) -> list[float]:
    def once() -> float:
        if batch["condition"].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = generate_codes(model, **batch, max_codes=codes, kv_cache=kv_cache)
        if batch["condition"].is_cuda:
            torch.cuda.synchronize()
        assert all(len(c) == codes for c in result.codes)
        return time.perf_counter() - start

    if warm_up:
        once()
    return [once() for _ in range(repeats)]


def show(runs: list[float], codes: int) -> str:
    median = statistics.median(runs)
    listed = ", ".join(f"{r:.3f}" for r in runs)
    return f"{median:.3f} s ({1000 * median / codes:.2f} ms per step of the batch; runs {listed})"


def compare(label: str, model: UnifiedVoiceGPT, batch: dict, codes: int, args: argparse.Namespace) -> None:
    cached = timed(model, batch, codes, True, args.repeats, warm_up=not args.smoke)  # warms the model up for all
    full = timed(model, batch, codes, False, args.repeats, warm_up=False)
    ratio = statistics.median(full) / statistics.median(cached)
    print(f"{label}, {codes} codes each:\n  kv cache  {show(cached, codes)}\n  no cache  {show(full, codes)}\n"
          f"  no cache / kv cache = {ratio:.1f}x", flush=True)


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.repeats = 1
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"generation cost on {device} ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs), "
          f"greedy, batch {BATCH}, random weights, stop suppressed; median of "
          f"{args.repeats} timed runs{'' if args.smoke else ' after one untimed run'}"
          f"{' (SMOKE: tiny sizes, no meaning)' if args.smoke else ''}")
    small = SMOKE_SIZE if args.smoke else {}
    demo = load_config("demo.yaml", **{k: v for k, v in small.items()})
    demo_codes = SMOKE_CODES if args.smoke else demo.max_mel_tokens
    compare(f"demo (checkpoints/demo.yaml: width {demo.model_dim}, {demo.layers} layers, {demo.heads} heads), "
            "texts 24-48 ids", build(demo, device), inputs(demo, (24, 48), device), demo_codes, args)
    official = load_config("config.yaml", **(small or {"layers": args.layers}))
    model = build(official, device)
    batch = inputs(official, (60, 120), device)
    label = (f"official width (checkpoints/config.yaml: width {official.model_dim}, {official.heads} heads, "
             f"{official.layers} of 24 layers), texts 60-120 ids")
    compare(label, model, batch, SMOKE_CODES if args.smoke else 16, args)
    long_codes = SMOKE_CODES if args.smoke else 500
    long_runs = timed(model, batch, long_codes, True, args.repeats, warm_up=False)
    print(f"{label}, {long_codes} codes each:\n  kv cache  {show(long_runs, long_codes)}\n"
          "  no cache  not run (it recomputes the whole sequence at every step)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
