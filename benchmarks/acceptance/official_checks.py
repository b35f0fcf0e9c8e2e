"""Checks at the official model size: the micro-batch probe and real steps after it (with and without gradient
checkpointing and --deterministic), the training throughput and model FLOPs utilisation, and a real
out-of-memory error recovered by halving the micro-batch.

On the CPU side of a dry run the same runs use the official config at width 64 and short samples, with
out-of-memory errors injected (trainers/faults.py) so that the probe and the halving run there.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from benchmarks.acceptance.context import Context, Finished
from benchmarks.acceptance.corpus import (
    LONG_CODES, LONG_TEXT, Corpus, official_gpt, positions, write_config, write_corpus,
)
from benchmarks.acceptance.flops import flops_per_sample, mfu, peak_flops
from benchmarks.acceptance.runner import Outcome
from benchmarks.throughput import INTERVAL_LINE
from trainers.config.flags import parse_command_line
from trainers.hardware.batch_probe import CACHE_NAME, _forward_backward
from trainers.hardware.detect import detect_hardware
from trainers.hardware.oom_recovery import release_memory
from trainers.hardware.precision import choose_amp
from trainers.model.gpt_model import UnifiedVoiceGPT

EFFECTIVE_BATCH = 64  # the probe tries micro-batches up to the effective batch
VARIANTS = {"plain": [], "grad_checkpointing": ["--grad-checkpointing"], "deterministic": ["--deterministic"],
            "both": ["--grad-checkpointing", "--deterministic"]}
STEPS = {"plain": 10}  # the plain run also measures throughput; the others take 2 steps after their probe
LOG_INTERVAL = 2
FLAGS = ["--val-interval", "0", "--max-val-batches", "1", "--warmup-steps", "1", "--log-interval", str(LOG_INTERVAL),
         "--save-interval", "1000", "--keep-checkpoints", "1"]
# Dry run: the official config at this width, short samples, and every pass above 2 samples "out of memory".
SMALL = {"model_dim": 64, "heads": 4, "layers": 2}
SMALL_LENGTHS = {"text_len": 20, "code_len": 100, "samples": 16, "val_samples": 4}
SMALL_BATCH, INJECTED_LIMIT = 8, 2
OOM_LAYERS = 4  # the forced out-of-memory run: the official width with 4 layers (see forced_oom)
OOM_MICRO_BATCHES = (32, 16, 8)  # the first whose calibration fits and leaves OOM_MARGIN
OOM_MARGIN = 2 ** 29  # 0.5 GiB each side of the cap: the allocator's rounding, cuBLAS's workspace, fragments
CAPPED = Path(__file__).resolve().parent / "capped_trainer.py"
HALVED = re.compile(r"out of memory at step 1 with micro-batch (\d+) \((.*?)\): "
                    r"redoing the step with micro-batch (\d+)")


def _small(ctx: Context) -> bool:
    return ctx.device == "cpu"


def official_corpus(ctx: Context) -> Corpus:
    def make() -> Corpus:
        small = _small(ctx)
        return write_corpus(ctx.folder("official"), ctx.demo_tokenizer(), SMALL if small else None,
                            **(SMALL_LENGTHS if small else {"text_len": LONG_TEXT, "code_len": LONG_CODES}))
    return ctx.shared(f"official_corpus/{ctx.device}", make)


def official_run(ctx: Context, variant: str) -> tuple[Path, Finished]:
    """The trainer at the official config with the micro-batch left to the probe; its *.pth files are deleted
    (6 GB each) once read."""
    def make() -> tuple[Path, Finished]:
        out = ctx.folder(f"official_runs/{variant}")
        corpus = official_corpus(ctx)
        steps = STEPS.get(variant, 2) if not _small(ctx) else 4
        batch = SMALL_BATCH if _small(ctx) else EFFECTIVE_BATCH
        env = {"INDEXTTS_TRAIN_OOM_ABOVE": str(INJECTED_LIMIT)} if _small(ctx) else None
        done = ctx.run_one(ctx.trainer(out, *corpus.flags(), *FLAGS, *VARIANTS[variant], "--device", ctx.device,
                                       "--effective-batch", str(batch), "--max-steps", str(steps), env=env))
        for checkpoint in out.glob("*.pth"):
            checkpoint.unlink()
        return out, done
    return ctx.shared(f"official_run/{ctx.device}/{variant}", make)


def _probed(out: Path, done: Finished, steps: int) -> tuple[bool, dict]:
    cache = out / CACHE_NAME
    micro = json.loads(cache.read_text())["micro_batch"] if cache.exists() else None
    finished = f"training finished at step {steps} " in done.stderr
    oom = "out of memory" in done.stderr.lower()
    figures = {"micro_batch": micro, "exit": done.returncode, "out_of_memory": oom, "seconds": done.seconds}
    return done.returncode == 0 and finished and not oom and bool(micro), figures


def probe_official(ctx: Context) -> Outcome:
    """For each variant: the probe answers, and the steps after it run without an out-of-memory error."""
    figures, ok = {}, True
    for variant in VARIANTS:
        out, done = official_run(ctx, variant)
        good, figures[variant] = _probed(out, done, STEPS.get(variant, 2))
        ok &= good
        if not good:
            figures[variant]["log"] = done.tail(600)
    return Outcome(ok, figures, f"effective batch {EFFECTIVE_BATCH}, samples of {LONG_TEXT} text and {LONG_CODES} "
                                "codes")


def probe_official_cpu_side(ctx: Context) -> Outcome:
    """The plain variant at width 64 with passes above 2 samples failing: the probe runs on the CPU and answers 2;
    the other variants' command lines parse."""
    out, done = official_run(ctx, "plain")
    ok, figures = _probed(out, done, 4)
    ok = ok and figures["micro_batch"] == INJECTED_LIMIT
    for variant, flags in VARIANTS.items():
        parse_command_line(["--output-dir", str(out), *official_corpus(ctx).flags(), *FLAGS, *flags])
    return Outcome(ok, figures, "" if ok else done.tail(600))


def _intervals(log: str, batch: int) -> tuple[float, int]:
    """Samples/s over the logged intervals after the first (the first holds AdamW's first step), from the
    trainer's own rate per interval (benchmarks/throughput.py reads it the same way)."""
    seconds, samples = 0.0, 0
    for match in INTERVAL_LINE.finditer(log):
        end, rate = int(match.group(1)), float(match.group(2))
        if end > LOG_INTERVAL:
            seconds += LOG_INTERVAL * batch / rate
            samples += LOG_INTERVAL * batch
    if not samples:
        raise RuntimeError("no timed interval in the run's log")
    return samples / seconds, samples


def official_throughput(ctx: Context) -> Outcome:
    """Tokens/s and MFU of the plain run; peak memory of a pass at micro-batch 1 and at the probed size, measured
    with the probe's own measurement."""
    out, done = official_run(ctx, "plain")
    ok, probed = _probed(out, done, STEPS["plain"])
    corpus, cfg = official_corpus(ctx), official_gpt()
    rate, samples = _intervals(done.stderr, EFFECTIVE_BATCH)
    peak = peak_flops(ctx.gpu_name or "")
    sample_flops = flops_per_sample(cfg, corpus.text_len, corpus.code_len, corpus.positions)
    figures = {"gpu": ctx.gpu_name, "micro_batch": probed["micro_batch"], "samples_timed": samples,
               "samples_per_s": round(rate, 3), "positions_per_s": round(rate * corpus.positions),
               "text_and_code_tokens_per_s": round(rate * (corpus.text_len + corpus.code_len)),
               "tflops_per_s": round(rate * sample_flops / 1e12, 1),
               "mfu": round(mfu(rate, sample_flops, peak[0]), 3) if peak else None,
               "peak_tflops": {"value": peak[0] / 1e12, "precision": peak[1], "source": peak[2]} if peak else None}
    figures.update(_pass_peaks(cfg, probed["micro_batch"] or 1))
    return Outcome(ok, figures, "MFU: 6 x block params x positions + PaLM's attention term + heads (flops.py)")


def _pass_peaks(cfg, micro: int) -> dict:
    """Peak memory of a forward and backward pass at micro-batch 1 and `micro`, in the precision --amp auto picks."""
    device = torch.device("cuda", 0)
    amp = choose_amp(detect_hardware(device), "auto").dtype
    model = UnifiedVoiceGPT(cfg).to(device).train()
    try:
        peaks = {n: _step_peak(model, n, device, amp, passes=1) for n in sorted({1, micro})}
    finally:
        del model
        release_memory(device)
    per_sample = (peaks[micro] - peaks[1]) / (micro - 1) if micro > 1 else None
    return {"pass_peak_gib": {n: round(p / 2 ** 30, 2) for n, p in peaks.items()},
            "per_sample_gib": round(per_sample / 2 ** 30, 3) if per_sample else None}


def official_throughput_cpu_side(ctx: Context) -> Outcome:
    """The rate read from the small plain run's log, the FLOPs of an official sample and the peak table."""
    out, done = official_run(ctx, "plain")
    rate, samples = _intervals(done.stderr, SMALL_BATCH)
    flops = flops_per_sample(official_gpt(), LONG_TEXT, LONG_CODES, positions(LONG_TEXT, LONG_CODES))
    known = {name: peak_flops(name)[0] / 1e12 for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB",
                                                            "Tesla T4", "NVIDIA L4", "NVIDIA A10G")}
    ok = rate > 0 and flops > 0 and known["NVIDIA H100 80GB HBM3"] == 989.0 and known["Tesla T4"] == 65.0
    return Outcome(ok, {"samples_per_s_small": round(rate, 2), "official_tflop_per_sample": round(flops / 1e12, 2),
                        "peak_tflops": known})


def forced_oom(ctx: Context) -> Outcome:
    """A real CUDA out-of-memory error: the allocator is capped (torch.cuda.set_per_process_memory_fraction)
    between what a step at micro-batch m needs and what one at m / 2 needs, measured here first with the
    probe's own measurement; the trainer, given --batch-size m, must halve and finish.

    The official width with OOM_LAYERS layers: activations then dominate the weights, so the gap between m
    and m / 2 is wide against the allocator's rounding. A step's two accumulating passes peak at P(m); from the
    first update on, AdamW's moments (2 x the trained weights, M) are held too. The cap is the weights plus the
    midpoint of P(m) (step 1 at m, no moments yet: must not fit) and M + P(m / 2) (every later step: must fit),
    so both miss it by the same margin, at least OOM_MARGIN."""
    cfg = official_gpt(layers=OOM_LAYERS)
    micro, fraction, figures = _calibrate(cfg)
    if micro is None:
        return Outcome(False, figures, f"no micro-batch in {OOM_MICRO_BATCHES} leaves {OOM_MARGIN / 2 ** 30} GiB "
                                       "each side of the cap on this GPU")
    config = write_config(ctx.folder("oom/config.yaml"), layers=OOM_LAYERS)
    done = ctx.run_one(ctx.trainer(ctx.folder("oom/run"), *_oom_flags(ctx, config, micro),
                                   launcher=[sys.executable, str(CAPPED), f"{fraction:.6f}"]))
    ok, found = _halving(done, micro, injected=False)
    return Outcome(ok, {**figures, **found}, "" if ok else done.tail(800))


def forced_oom_cpu_side(ctx: Context) -> Outcome:
    """The same launcher and run uncapped on the CPU, the error injected at the first micro-batch of step 1."""
    config = write_config(ctx.folder("oom/config.yaml"), **{**SMALL, "layers": OOM_LAYERS})
    micro = SMALL_BATCH // 2
    done = ctx.run_one(ctx.trainer(ctx.folder("oom/run"), *_oom_flags(ctx, config, micro),
                                   launcher=[sys.executable, str(CAPPED), "0"], env={"INDEXTTS_TRAIN_OOM_AT": "1:0"}))
    ok, found = _halving(done, micro, injected=True)
    return Outcome(ok, found, "" if ok else done.tail(800))


def _oom_flags(ctx: Context, config: Path, micro: int) -> list[str]:
    return [*official_corpus(ctx).flags(), "--config", str(config), *FLAGS, "--device", ctx.device, "--max-steps", "2",
            "--effective-batch", str(2 * micro), "--batch-size", str(micro), "--val-batch-size", "4"]


def _halving(done: Finished, micro: int, injected: bool) -> tuple[bool, dict]:
    found = HALVED.search(done.stderr)
    figures = {"exit": done.returncode, "halved": [int(found.group(1)), int(found.group(3))] if found else None,
               "error": found.group(2)[:160] if found else None}
    real = bool(found) and ("injected" in found.group(2)) == injected and "out of memory" in found.group(2).lower()
    ok = done.returncode == 0 and real and figures["halved"] == [micro, micro // 2]
    return ok and "training finished at step 2 " in done.stderr, figures


def _calibrate(cfg) -> tuple[int | None, float, dict]:
    """(micro-batch m, allocator fraction, figures) for the first m of OOM_MICRO_BATCHES that fits with a margin."""
    device = torch.device("cuda", 0)
    amp = choose_amp(detect_hardware(device), "auto").dtype
    total = torch.cuda.get_device_properties(device).total_memory
    model = UnifiedVoiceGPT(cfg).to(device).train()
    weights = sum(p.numel() * 4 for p in model.parameters())
    figures: dict = {"layers": cfg.layers}
    try:
        for micro in OOM_MICRO_BATCHES:
            try:
                full, half = (_step_peak(model, n, device, amp) for n in (micro, micro // 2))
            except torch.OutOfMemoryError:
                continue
            later = 2 * weights + half  # AdamW's moments and a step at m / 2
            cap = weights + (full + later) // 2
            margin = (full - later) // 2
            figures.update(micro_batch=micro, step_peak_gib=[round(full / 2 ** 30, 2), round(half / 2 ** 30, 2)],
                           cap_gib=round(cap / 2 ** 30, 2), margin_gib=round(margin / 2 ** 30, 2))
            if margin >= OOM_MARGIN:
                return micro, cap / total, figures
    finally:
        del model
        release_memory(device)
    return None, 0.0, figures


def _step_peak(model: UnifiedVoiceGPT, n: int, device: torch.device, amp: torch.dtype | None, passes: int = 2) -> int:
    """Peak bytes of `passes` accumulating passes over n long samples (a step's two by default), gradients included:
    the probe's own measurement, from a model without gradients and an emptied cache."""
    model.zero_grad(set_to_none=True)
    release_memory(device)
    try:
        return _forward_backward(model, n, device, amp, LONG_TEXT, LONG_CODES, passes=passes)
    finally:
        model.zero_grad(set_to_none=True)
