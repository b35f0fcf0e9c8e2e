"""The training step at the official width on the GPU, in this process, with the trainer's own pieces: its
micro-batch probe (trainers/hardware/batch_probe.py), autocast, the model's loss sums and its optimizer
(trainers/training/optimization.py), split and normalised as trainers/loop.py's train_step does.

What it reports: the probe's answer and how long it took; seconds per optimizer step, samples, positions and
tokens per second and model FLOPs utilisation (flops.py) of the step as the trainer runs it now, and of the
switches that exist, side by side on the same model and inputs (the dropout masks v2, the default, against v3,
made in the kernel that applies them, and against --dropout 0, which gives each version's share of the step;
AdamW foreach, the trainer's kernels until fused AdamW, against fused); the peak memory of the steps;
the host-device synchronisations of one step and the lines that cause them (torch.cuda.set_sync_debug_mode);
and which kernels take the GPU's time in one step (the profiler), attention's among them.

For IndexTTS2 (official_step) and IndexTTS-2.5 (official_step_25, its 3-position prefix, language embedding
and 60,510-column text loss computed in blocks): both measure the masks (v2, v3, none); the AdamW switch is the
trainer's whatever the model, so only 2.0 measures it, last, when time is left.

Every layer of the config fits an H100 and the budget: an optimizer step at the official config over 64 long
samples takes about a second there at 40% MFU (computed, not measured). On the CPU side of a dry run the same
code runs at width 64 in fp32 with the probe's passes above 2 samples failing (injected); CUDA's sync debug mode is
left out there, and the profiler sees torch's CPU ops instead of kernels.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from benchmarks.acceptance.context import CheckTimeout, Context
from benchmarks.acceptance.corpus import IDX2, LABELS, LONG_CODES, LONG_TEXT, build_model, family_of, positions, \
    random_inputs
from benchmarks.acceptance.flops import MFU_RULE, flops_per_sample, mfu, peak_flops
from benchmarks.acceptance.runner import Outcome
from trainers.config.settings import TrainConfig
from trainers.faults import OomInjector
from trainers.hardware.batch_probe import MEMORY_MARGIN, largest_fitting, model_fits
from trainers.hardware.detect import detect_hardware
from trainers.hardware.oom_recovery import release_memory
from trainers.hardware.precision import choose_amp
from trainers.model.gpt_model import UnifiedVoiceGPT, dropout_keys
from trainers.training.evaluation import autocast_for
from trainers.training.optimization import Optimization

EFFECTIVE_BATCH = 64
TIMED_STEPS = 3  # per variant, after one untimed step (AdamW's state, cuBLAS's plans, the allocator's blocks)
SEED = 1234
RESERVE_S = 5.0  # of the check's budget, kept for what follows the timed steps
SETTINGS = TrainConfig(learning_rate=2e-5, warmup_steps=0)  # the trainer's defaults otherwise (--dropout 0.1)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    fused: bool | None  # AdamW's fused kernels (None: the trainer's choice, fused where the weights are on a GPU)
    dropout: float
    what: str
    masks: str = SETTINGS.dropout_masks  # --dropout-masks


# The trainer's step now first; the others each change one switch, in the order of what they are for now (a
# variant the check's time no longer allows is left out).
VARIANTS = (
    Variant("now", None, SETTINGS.dropout, "the trainer's step: fused AdamW on a GPU, --dropout 0.1, masks v2"),
    Variant("masks_v3", None, SETTINGS.dropout, "--dropout-masks v3: each mask made in the kernel applying it", "v3"),
    Variant("no_dropout", None, 0.0, "--dropout 0: what the dropout masks cost"),
    Variant("foreach_adamw", False, SETTINGS.dropout, "before: AdamW's foreach kernels, the trainer's until now"),
)
MASK_VARIANTS = ("now", "masks_v3", "no_dropout")  # every model's: v2 against v3, and the step without masks
# Dry run: the config at this width, short samples, every probing pass above 2 samples "out of memory".
SMALL = {"model_dim": 64, "heads": 4, "layers": 2}
SMALL_TEXT, SMALL_CODES, SMALL_BATCH, INJECTED_LIMIT = 20, 60, 4, 2
# Matrix products: CUDA's kernel names, or on the CPU side torch's op names.
GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|aten::(?:add)?mm\b|aten::bmm\b", re.IGNORECASE)
ATTENTION = re.compile(r"flash|fmha|attention|sdpa|attn|cudnn::fusion", re.IGNORECASE)  # not softmax: the loss has one
# The v2 dropout masks' hash: integer elementwise kernels (xor, shifts, multiplies, the int16 threshold compare).
MASKS = re.compile(r"<int, int, int|BitwiseXor|BitwiseAnd|rshift|lshift|MulFunctor<int>|compare_scalar_kernel<short>")
# CUDA runtime calls and the profiler's own markers: host time, not kernels (the first H100 run divided the
# kernels' time by a total holding "Command Buffer Full" and cudaStreamSynchronize, 39% of it).
RUNTIME = re.compile(r"^(cuda[A-Z]|cu[A-Z]|Command Buffer Full)")


@dataclasses.dataclass
class Inputs:
    """An effective batch of equal, long samples (every step the same work) on the device."""

    tensors: dict[str, torch.Tensor]  # the model's inputs by name: its conditioning, text_ids, text_lens, codes, ...
    indices: torch.Tensor
    text_len: int
    code_len: int
    prefix_len: int  # of the model's family

    @property
    def samples(self) -> int:
        return len(self.indices)

    @property
    def packed_len(self) -> int:
        return positions(self.text_len, self.code_len, self.prefix_len)


def make_inputs(cfg, samples: int, text_len: int, code_len: int, device: torch.device) -> Inputs:
    tensors = random_inputs(cfg, [text_len] * samples, [code_len] * samples, SEED)
    return Inputs({k: t.to(device) for k, t in tensors.items()}, torch.arange(samples, device=device), text_len,
                  code_len, family_of(cfg).model.prefix_len)


def train_step(model: UnifiedVoiceGPT, optim: Optimization, inputs: Inputs, micro: int, amp: torch.dtype | None,
               step: int) -> None:
    """One optimizer step over the inputs in micro-batches, the loss normalised per step (trainers/loop.py)."""
    device = inputs.indices.device
    optim.start_step(step)
    text_total, mel_total = inputs.samples * (inputs.text_len + 1), inputs.samples * (inputs.code_len + 1)
    for start in range(0, inputs.samples, micro):
        part = slice(start, start + micro)
        with autocast_for(device, amp):
            sums = model.loss_sums(**{k: t[part] for k, t in inputs.tensors.items()}, packed_len=inputs.packed_len,
                                   dropout_keys=dropout_keys(SEED, step, inputs.indices[part]))
            loss = (SETTINGS.text_loss_weight * sums["text_ce"] / text_total
                    + SETTINGS.mel_loss_weight * sums["mel_ce"] / mel_total)
        optim.backward(loss)
    optim.apply(optim.prepare())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Measured:
    probe_s: float
    micro: int
    seconds: dict[str, float]  # per optimizer step, per variant
    peak_gib: float | None
    syncs: dict | None
    kernels: dict | None
    fused: bool = True  # the trainer's AdamW here
    compile_s: float | None = None  # what the first v3 step took more than the second (torch.compile on CUDA)


def _variant(model: UnifiedVoiceGPT, variant: Variant) -> Optimization:
    model.cfg = dataclasses.replace(model.cfg, dropout=variant.dropout)
    model.dropout_masks = variant.masks
    return Optimization(model, SETTINGS, fp16=False, frozen=None, device_type=model.text_head.weight.device.type,
                        fused=variant.fused)


def measure(ctx: Context, cfg, inputs: Inputs, amp: torch.dtype | None, oom: OomInjector, steps: int,
            gpu_details: bool, variants: tuple[Variant, ...] = VARIANTS) -> Measured:
    """The probe, then each variant: one untimed step and up to `steps` timed ones, as many as the check's time
    left allows (the step as the trainer runs it now first, with its diagnostics; a variant without time for
    one step is left out)."""
    assert variants[0] is VARIANTS[0]
    device = inputs.indices.device
    model = build_model(cfg, device)
    try:
        started = time.perf_counter()
        fits = model_fits(model, device, amp, inputs.text_len, inputs.code_len, oom, 1, inputs.samples)
        micro = max(1, largest_fitting(fits, inputs.samples))
        probe_s = time.perf_counter() - started
        seconds, peak, syncs, kernels, fused, compile_s = {}, None, None, None, True, None
        for variant in variants:
            optim = _variant(model, variant)
            if variant is VARIANTS[0]:
                fused = optim.fused
            if variant.masks == "v3":
                compile_s = _compiled_first(model, optim, inputs, micro, amp)
            started = time.perf_counter()
            train_step(model, optim, inputs, micro, amp, 0)  # untimed
            _sync(device)
            first = time.perf_counter() - started
            if compile_s is not None and variant.masks == "v3":
                compile_s = round(max(0.0, compile_s - first), 2)
            affordable = int((ctx.remaining() - RESERVE_S) / first) - (2 if variant is VARIANTS[0] else 0)
            timed = min(steps, affordable) if variant is not VARIANTS[0] else max(1, min(steps, affordable))
            if timed >= 1:
                if variant is VARIANTS[0] and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                started = time.perf_counter()
                for step in range(1, timed + 1):
                    train_step(model, optim, inputs, micro, amp, step)
                _sync(device)
                seconds[variant.name] = (time.perf_counter() - started) / timed
            if variant is VARIANTS[0]:
                if device.type == "cuda":
                    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
                one_step = functools.partial(train_step, model, optim, inputs, micro, amp, steps + 1)
                if gpu_details:
                    syncs = _guarded(functools.partial(count_syncs, one_step))
                kernels = _guarded(functools.partial(kernel_times, ctx, one_step, device))
            optim = one_step = None  # AdamW's moments go before the next variant's
            model.zero_grad(set_to_none=True)
            release_memory(device)
        return Measured(probe_s, micro, seconds, peak, syncs, kernels, fused, compile_s)
    finally:
        model = None
        release_memory(device)


def _compiled_first(model: UnifiedVoiceGPT, optim: Optimization, inputs: Inputs, micro: int,
                    amp: torch.dtype | None) -> float:
    """One untimed step with v3 masks, the one that compiles them on CUDA (its time: compile + a step), so that the
    untimed step after it, which decides how many timed steps fit, is a step like the others."""
    started = time.perf_counter()
    train_step(model, optim, inputs, micro, amp, 0)
    _sync(inputs.indices.device)
    return time.perf_counter() - started


def _guarded(measure_it: Callable[[], dict]) -> dict:
    """A diagnostic that fails says why instead of failing the check (it judges nothing)."""
    try:
        return measure_it()
    except CheckTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's profiler and debug modes change between versions
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def count_syncs(step: Callable[[], None]) -> dict:
    """Host-device synchronisations of one step, by the line of Python that caused them (CUDA's debug mode warns
    at each one, attributed to the calling line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower())
    return {"per_step": sum(where.values()), "where": dict(where.most_common(8))}


def _self_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def kernel_times(ctx: Context, step: Callable[[], None], device: torch.device) -> dict:
    """Where one step's time goes: the share of matrix products and of attention's kernels, the kernels taking
    most, and the whole table in the logs archive (profile.txt)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
        _sync(device)
    named = [(e.key, _self_us(e)) for e in prof.key_averages() if _self_us(e) > 0]
    shares, table = kernel_shares(named)
    (ctx.log_dir / "profile.txt").write_text("\n".join(table) + "\n", encoding="utf-8")
    return shares


def kernel_shares(named: list[tuple[str, float]]) -> tuple[dict, list[str]]:
    """(shares, table) of the profiler's (name, self time) rows: matrix products (attention's own wgmma kernels
    not counted twice), attention, the dropout masks' integer kernels, as shares of the kernels' time alone;
    the table lists the kernels, then the host-side rows."""
    everything = sorted(named, key=lambda row: row[1], reverse=True)
    events = [row for row in everything if not RUNTIME.search(row[0])]
    total = sum(us for _, us in events) or 1.0
    table = [f"{us / total:7.2%}  {us / 1e3:10.2f} ms  {name}" for name, us in events]
    table += ["", "host side (not in the shares above):"]
    table += [f"           {us / 1e3:10.2f} ms  {name}" for name, us in everything if RUNTIME.search(name)]

    def share(pattern: re.Pattern, but: re.Pattern | None = None) -> float:
        return round(sum(us for name, us in events if pattern.search(name) and not (but and but.search(name)))
                     / total, 3)

    return ({"gemm_share": share(GEMM, ATTENTION), "attention_share": share(ATTENTION), "mask_share": share(MASKS),
             "attention_kernels": [name[:90] for name, _ in events if ATTENTION.search(name)][:4],
             "top": [[name[:90], round(us / total, 3)] for name, us in events[:6]]}, table)


def _figures(cfg, inputs: Inputs, m: Measured, peak: tuple[float, str, str] | None) -> dict:
    sample_flops = flops_per_sample(cfg, inputs.text_len, inputs.code_len, inputs.packed_len)
    per_variant = {}
    for name, s in m.seconds.items():
        rate = inputs.samples / s
        per_variant[name] = {"step_s": round(s, 4), "samples_per_s": round(rate, 2),
                             "positions_per_s": round(rate * inputs.packed_len),
                             "tokens_per_s": round(rate * (inputs.text_len + inputs.code_len)),
                             "tflops_per_s": round(rate * sample_flops / 1e12, 1),
                             "mfu": round(mfu(rate, sample_flops, peak[0]), 4) if peak else None}
    return {"model": LABELS[family_of(cfg).name], "adamw": "fused" if m.fused else "foreach (the CPU's)",
            "layers": cfg.layers, "width": cfg.model_dim, "text_vocabulary": cfg.number_text_tokens + 1,
            "positions": inputs.packed_len,
            "effective_batch": inputs.samples, "micro_batch": m.micro, "probe_s": round(m.probe_s, 2),
            "model_tflop_per_sample": round(sample_flops / 1e12, 3), "variants": per_variant,
            "masks": _mask_figures(per_variant, m.compile_s),
            "peak_allocated_gib": round(m.peak_gib, 2) if m.peak_gib is not None else None,
            "syncs": m.syncs, "kernels": m.kernels,
            "peak_tflops": {"value": peak[0] / 1e12, "precision": peak[1], "source": peak[2]} if peak else None}


def _mask_figures(per_variant: dict, compile_s: float | None) -> dict:
    """The masks v2 (the step now) and v3 side by side: s/step, tokens/s, MFU and their share of the step (1 - the
    step without dropout / the step with them); v3's compile time. Empty when a variant was left out."""
    plain = per_variant.get("no_dropout")
    found = {}
    for version, name in (("v2", "now"), ("v3", "masks_v3")):
        if name in per_variant:
            v = per_variant[name]
            share = round(1 - plain["step_s"] / v["step_s"], 4) if plain else None
            found[version] = {"step_s": v["step_s"], "tokens_per_s": v["tokens_per_s"], "mfu": v["mfu"],
                              "share_of_step": share}
    return {**found, "v3_compile_s": compile_s} if "v3" in found else found


def _mask_line(masks: dict) -> str | None:
    """v2 -> v3 in words, or None when v3 was not measured."""
    if "v3" not in masks:
        return None
    def part(key: str, form: Callable[[float], str]) -> str:
        values = [masks[v][key] for v in ("v2", "v3")]
        return " -> ".join(form(x) if x is not None else "?" for x in values)
    return (f"dropout masks v2 -> v3: {part('step_s', lambda x: f'{x:.3f}')} s/step, "
            f"{part('tokens_per_s', lambda x: f'{x:,}')} tokens/s, MFU {part('mfu', lambda x: f'{x:.1%}')}, "
            f"the masks' share of the step {part('share_of_step', lambda x: f'{x:.1%}')}; v3's first step took "
            f"{masks['v3_compile_s']} s more than the next (on CUDA: torch.compile)")


def _lines(figures: dict, amp_name: str, gpu: str | None, total_gib: float | None) -> tuple[str, ...]:
    v = figures["variants"]
    now = v["now"]
    mfu_text = lambda x: f"MFU {x['mfu']:.1%}" if x["mfu"] is not None else "MFU: no peak known here"  # noqa: E731
    lines = [f"{figures['model']}: {amp_name}, {figures['layers']} layers at width {figures['width']}, text head "
             f"{figures['text_vocabulary']:,} wide, samples of {figures['positions']} positions, effective batch "
             f"{figures['effective_batch']}",
             f"probe: micro-batch {figures['micro_batch']} (the trainer's probe, {MEMORY_MARGIN:.0%} of free memory) "
             f"in {figures['probe_s']:.1f} s",
             f"step now: {now['step_s']:.3f} s, {now['samples_per_s']:.1f} samples/s, {now['positions_per_s']:,} "
             f"positions/s, {now['tokens_per_s']:,} text+code tokens/s, {now['tflops_per_s']} TFLOP/s, {mfu_text(now)}"]
    before = v.get("foreach_adamw")
    if before:
        lines.append(f"before/after: AdamW foreach {before['step_s']:.3f} s/step -> {figures['adamw']} "
                     f"{now['step_s']:.3f} s/step (x{before['step_s'] / now['step_s']:.3f})")
    plain = v.get("no_dropout")
    if plain:
        lines.append(f"switch: --dropout 0.1 {now['step_s']:.3f} s/step, --dropout 0 {plain['step_s']:.3f} s/step "
                     f"(the masks cost {now['step_s'] / plain['step_s'] - 1:.1%})")
    masks = _mask_line(figures["masks"])
    if masks:
        lines.append(masks)
    if figures["peak_allocated_gib"] is not None:
        lines.append(f"peak memory of the steps: {figures['peak_allocated_gib']} GiB allocated of {total_gib} GiB")
    syncs = figures["syncs"]
    if syncs and "per_step" in syncs:
        lines.append(f"host-device synchronisations per step: {syncs['per_step']} ({syncs['where']})")
    kernels = figures["kernels"]
    if kernels and "gemm_share" in kernels:
        named = ", ".join(kernels["attention_kernels"]) or "no attention kernel named"
        lines.append(f"kernel time: matrix products {kernels['gemm_share']:.0%}, attention "
                     f"{kernels['attention_share']:.0%}, dropout masks' integer kernels "
                     f"{kernels.get('mask_share', 0):.0%} ({named})")
    peak = figures["peak_tflops"]["value"] if figures["peak_tflops"] else "?"
    lines.append(f"MFU = model FLOPs / s / peak, {MFU_RULE}; peak {peak} TFLOP/s ({gpu or 'CPU'})")
    return tuple(lines)


def _variants(family: str) -> tuple[Variant, ...]:
    """The masks for every model (their share of the step depends on its shape); the AdamW switch is the trainer's,
    not a family's: measured on IndexTTS2 only."""
    return VARIANTS if family == IDX2 else tuple(v for v in VARIANTS if v.name in MASK_VARIANTS)


def official_step(ctx: Context, family: str = IDX2) -> Outcome:
    device = torch.device("cuda", 0)
    amp = choose_amp(detect_hardware(device), "auto")
    cfg = ctx.gpt(family, dropout=SETTINGS.dropout)
    inputs = make_inputs(cfg, EFFECTIVE_BATCH, LONG_TEXT, LONG_CODES, device)
    m = measure(ctx, cfg, inputs, amp.dtype, OomInjector(), TIMED_STEPS, gpu_details=True, variants=_variants(family))
    figures = _figures(cfg, inputs, m, peak_flops(ctx.gpu_name or ""))
    total = round(torch.cuda.get_device_properties(device).total_memory / 2 ** 30, 1)
    ok = m.micro >= 1 and all(s > 0 for s in m.seconds.values())
    return Outcome(ok, figures, "", _lines(figures, amp.name, ctx.gpu_name, total))


def official_step_cpu_side(ctx: Context, family: str = IDX2) -> Outcome:
    """The same code at width 64 on the CPU, in fp32 (a bf16 step on a CPU without bf16 instructions is ~80x
    slower and proves nothing about a GPU), the probe answering the injected limit."""
    cfg = ctx.gpt(family, **SMALL, dropout=SETTINGS.dropout)
    inputs = make_inputs(cfg, SMALL_BATCH, SMALL_TEXT, SMALL_CODES, torch.device("cpu"))
    variants = _variants(family)
    m = measure(ctx, cfg, inputs, None, OomInjector(above=INJECTED_LIMIT), 1, gpu_details=False, variants=variants)
    figures = _figures(cfg, inputs, m, None)
    ok = m.micro == INJECTED_LIMIT and set(m.seconds) == {v.name for v in variants}  # the budget is ample here
    ok = ok and bool(m.kernels) and "gemm_share" in m.kernels
    return Outcome(ok, figures, "", _lines(figures, "fp32", None, None))
