"""Checks of the model's numbers on CUDA: the CUDA-only tests, dropout masks, losses in each precision."""
from __future__ import annotations

import re
import sys
import time
import xml.etree.ElementTree as ElementTree
from contextlib import nullcontext

import torch

from benchmarks.acceptance.context import Context, Job, child_env
from benchmarks.acceptance.corpus import IDX2, IDX25, LABELS, build_model, random_inputs
from benchmarks.acceptance.runner import Outcome
from tests.demo_runs import REPO
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.model import fused_masks
from trainers.model.sample_dropout import MASK_VERSIONS, SampleDropout, dropout_keys

# Model losses (mean cross-entropy per target, text and mel), relative to fp32 on the same device:
# fp32 on CUDA with TF32 off against fp32 on the CPU: the same arithmetic summed in another order, which moves
# a mean over thousands of targets far less than 1e-5; a kernel computing something else moves it more.
FP32_DEVICE_RTOL = 1e-5
# The global gradient norm of the same pass: more sums than the loss, hence 10x looser.
FP32_GRAD_NORM_RTOL = 1e-4
# bf16 autocast keeps 8 significant bits in the matrix products; 2% bounds what that does to a loss.
BF16_RTOL = 2e-2
# fp16 keeps 11 bits, 8x bf16's precision, but overflows above 65504: 1% catches an overflow or bad scaling.
FP16_RTOL = 1e-2
HEAD_SCALE = 10.0  # see _model
# The official width with this many of its layers: how far CUDA's kernels agree with the CPU's does not depend on
# the depth, and the CPU's fp32 reference pass then takes seconds on the GPU machine's time.
LOSS_LAYERS = 6
LENGTHS = ((120, 600), (80, 400))  # (text, codes) of the two samples: padding and packing take part
SMALL_LENGTHS = ((12, 60), (8, 40))
# A skipif on CUDA: the tests the CPU suite cannot run.
CUDA_SKIP = re.compile(r"@pytest\.mark\.skipif\(\s*not torch\.cuda\.is_available\(\)[^\n]*\n(?:@[^\n]*\n)*"
                       r"def (test_\w+)")


# -- the CUDA-only tests ---------------------------------------------------------------------------------------


def cuda_only_tests() -> list[str]:
    """pytest ids of the tests marked to skip without CUDA."""
    return [f"tests/{path.name}::{name}" for path in sorted((REPO / "tests").glob("test_*.py"))
            for name in CUDA_SKIP.findall(path.read_text(encoding="utf-8"))]


def _run_tests(ctx: Context, ids: list[str]) -> dict[str, tuple[str, str]]:
    """{test id: (passed|skipped|failed, message)} from pytest's JUnit XML."""
    xml = ctx.log_dir / "cuda_tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", f"--junitxml={xml}", *ids]
    done = ctx.run_one(Job(command, child_env()))
    if not xml.exists():
        raise RuntimeError(f"pytest wrote no report (exit {done.returncode}): {done.tail()}")
    results = {}
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = "skipped" if child.tag == "skipped" else "failed"
                message = child.get("message", "")
        results[f"{case.get('classname')}::{case.get('name')}"] = (status, message)
    return results


def cuda_tests(ctx: Context) -> Outcome:
    ids = cuda_only_tests()
    results = _run_tests(ctx, ids)
    bad = {k: v for k, v in results.items() if v[0] != "passed"}
    figures = {"tests": len(results), "passed": len(results) - len(bad)}
    if not ids or len(results) < len(ids) or bad:
        return Outcome(False, figures, f"not passed: {bad}" if bad else f"found {ids}, ran {list(results)}")
    return Outcome(True, figures)


def cuda_tests_cpu_side(ctx: Context) -> Outcome:
    """The tests exist, are collected and skip for want of CUDA (nothing else)."""
    ids = cuda_only_tests()
    results = _run_tests(ctx, ids)
    other = {k: v for k, v in results.items() if v[0] != "skipped" or "CUDA" not in v[1]}
    ok = bool(ids) and len(results) >= len(ids) and not other
    return Outcome(ok, {"tests": len(results)}, f"{len(results)} CUDA-only tests collected and skipped"
                   if ok else f"expected {ids} to skip for want of CUDA, got {results}")


# -- dropout masks ---------------------------------------------------------------------------------------------

# (batch, positions, channels): a cell count that is odd (half a 32-bit word at the end), and one larger than
# the CPU's chunk of 2^18 cells at the official width.
MASK_SHAPES = ((3, 37, 63), (2, 411, 1280))
MASK_SITES = (0, 1, 48)


def _masked(device: str, version: str, shape: tuple[int, int, int], site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ones through the dropout of `site` (kept cells 1 / (1 - p), dropped 0) and the keys, on the CPU."""
    drop = _dropout(device, version, shape)
    return drop(torch.ones(shape, device=device), site).cpu(), drop.keys.cpu()


def _masked_whole_batch(shape: tuple[int, int, int], site: int) -> torch.Tensor:
    """The same through the path a GPU takes (the batch's mask in one tensor, one fused multiply), on the CPU."""
    drop, x = _dropout("cpu", "v2", shape), torch.ones(shape)
    return torch.addcmul(x.new_zeros(()), x, drop.keep_mask(site, x.dtype), value=drop.scale)


def _dropout(device: str, version: str, shape: tuple[int, int, int]) -> SampleDropout:
    keys = dropout_keys(1234, 7, torch.tensor([5, 900, 70001][: shape[0]], device=device))
    return SampleDropout(0.1, keys, shape[1], shape[2], torch.device(device), version)


def dropout_masks(ctx: Context) -> Outcome:
    """Every mask of v1, v2 and v3 (and the keys they come from) is the same on CUDA as on the CPU: v3's compiled
    kernel against the CPU's eager function, the reference; for v3 also backward's masks and bf16 inputs."""
    cells, differing = 0, {}
    started = time.perf_counter()
    for version in MASK_VERSIONS:
        for shape in MASK_SHAPES:
            for site in MASK_SITES:
                (cpu, cpu_keys), (cuda, cuda_keys) = (_masked(d, version, shape, site) for d in ("cpu", "cuda"))
                cells += cpu.numel()
                wrong = int((cpu != cuda).sum()) + int((cpu_keys != cuda_keys).sum())
                if wrong:
                    differing[f"{version} {shape} site {site}"] = wrong
    v3 = _v3_passes("cuda")
    figures = {"cells_compared": cells + v3.pop("cells"), "differing": {**differing, **v3.pop("differing")} or 0,
               **v3, "seconds_with_v3_compile": round(time.perf_counter() - started, 2)}
    return Outcome(not figures["differing"], figures)


def _v3_passes(device: str, sites: tuple[int, ...] = MASK_SITES) -> dict:
    """v3 on `device` against the CPU's eager function (or on the CPU: its chunks against the whole-batch function
    CUDA compiles): which cells a forward of fp32 and bf16 inputs and its backward keep. Kept bf16 values are
    counted apart (rounding, not masks): figures, never a failure."""
    cells, differing, values_differing = 0, {}, 0
    for shape in MASK_SHAPES:
        for site in sites:
            for dtype in (torch.float32, torch.bfloat16):
                cpu_out, cpu_grad = _v3_pass("cpu", shape, site, dtype, whole=device == "cpu")
                out, grad = _v3_pass(device, shape, site, dtype)
                cells += 2 * out.numel()
                wrong = int(((out != 0) != (cpu_out != 0)).sum() + ((grad != 0) != (cpu_grad != 0)).sum())
                if wrong:
                    differing[f"v3 {dtype} forward/backward {shape} site {site}"] = wrong
                values_differing += int((out != cpu_out).sum())
    return {"cells": cells, "differing": differing, "v3_values_differing": values_differing}


def _v3_pass(device: str, shape: tuple[int, int, int], site: int, dtype: torch.dtype,
             whole: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """v3's output for a random input and the gradient of a random upstream gradient, on the CPU. `whole`: the
    batch in one call of the function CUDA compiles, instead of the CPU's chunks."""
    g = torch.Generator().manual_seed(site)
    x = torch.randn(shape, generator=g).to(dtype)
    upstream = torch.randn(shape, generator=g).to(dtype)
    drop = _dropout(device, "v3", shape)
    if whole:
        keys = fused_masks.site_keys(drop.keys, site)
        return tuple(fused_masks.mask_and_scale(t.reshape(shape[0], -1), keys, 0, drop.threshold, drop.scale)
                     .view(shape) for t in (x, upstream))
    x = x.to(device).requires_grad_()
    out = drop(x, site)
    out.backward(upstream.to(device))
    return out.detach().cpu(), x.grad.cpu()


def dropout_masks_cpu_side(ctx: Context) -> Outcome:
    """On the CPU, v2's and v3's chunked paths give the masks of the whole-batch paths the GPU takes (v3: the
    function it compiles, run eagerly here), forward and backward."""
    cells, differing = 0, {}
    for shape in MASK_SHAPES:
        for site in MASK_SITES:
            chunked, _ = _masked("cpu", "v2", shape, site)
            whole = _masked_whole_batch(shape, site)
            cells += chunked.numel()
            if not torch.equal(chunked, whole):
                differing[f"{shape} site {site}"] = int((chunked != whole).sum())
    v3 = _v3_passes("cpu", MASK_SITES[:1] if ctx.smoke else MASK_SITES)  # --smoke: seconds, not a measurement
    differing.update(v3["differing"])
    ok = not differing and v3["v3_values_differing"] == 0  # one device, one function: the values too
    return Outcome(ok, {"cells_compared": cells + v3["cells"], "differing": differing or 0})


# -- losses in each precision ----------------------------------------------------------------------------------


def _pass(model: UnifiedVoiceGPT, device: str, dtype: torch.dtype | None,
          lens: tuple[tuple[int, int], ...] = LENGTHS, grads: dict | None = None) -> dict[str, float]:
    """Mean text and mel cross-entropy and the global gradient norm of one training pass (dropout on), in the
    model's own dtype (`dtype`: autocast's); `grads` (if given) receives each parameter's gradient."""
    weights = next(model.parameters()).dtype
    batch = random_inputs(model.cfg, [t for t, _ in lens], [c for _, c in lens], seed=3)
    batch = {k: (t.to(weights) if t.is_floating_point() else t).to(device) for k, t in batch.items()}
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype) if dtype else nullcontext():
        sums = model.loss_sums(**batch, dropout_keys=dropout_keys(1234, 0, torch.arange(2, device=device)))
    (sums["text_ce"] + sums["mel_ce"]).backward()
    # In float64: the CPU's float32 norm of a 15M-element gradient accumulates 1e-4 of error (measured), which made
    # CPU and CUDA look 2.8e-4 apart when every parameter's gradient agreed to 1e-6.
    norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()
                                                 if p.grad is not None]))
    if grads is not None:
        grads.update({n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None})  # no copy
    sums = {k: v.detach() for k, v in sums.items()}
    return {"text": float(sums["text_ce"] / sums["text_tokens"]), "mel": float(sums["mel_ce"] / sums["mel_tokens"]),
            "grad_norm": float(norm)}


def _worst_grads(grads: dict, reference: dict, norm: float, n: int = 3) -> dict[str, float]:
    """The parameters whose gradients are furthest from the reference's, as a share of the global norm: which
    kernel computes something else, when one does."""
    far = sorted(((float((g - reference[k].to(g.device)).double().norm()) / norm, k) for k, g in grads.items()),
                 reverse=True)[:n]
    return {k: float(f"{d:.2e}") for d, k in far}


def _compare(figures: dict, name: str, got: dict, ref: dict, rtol: float, grad_rtol: float | None = None) -> bool:
    rel = {k: abs(got[k] - ref[k]) / abs(ref[k]) for k in got}
    figures[name] = {**{k: round(v, 5) for k, v in got.items()}, "rel_diff": max(rel["text"], rel["mel"]),
                     "grad_rel_diff": rel["grad_norm"]}
    losses = (got["text"], got["mel"])  # the gradient norm is reported only: fp16's may overflow without a scaler
    ok = all(torch.isfinite(torch.tensor(losses))) and max(rel["text"], rel["mel"]) <= rtol
    return ok and (grad_rtol is None or rel["grad_norm"] <= grad_rtol)


def _model(cfg) -> UnifiedVoiceGPT:
    """The trainer's initialisation, with the heads 10x larger: logits of a spread like a trained model's
    (std about 7 instead of 0.7), so that the losses depend on what the products compute, not only on the
    vocabulary's size (near-uniform logits give ln(vocabulary) whatever the precision)."""
    model = build_model(cfg)
    with torch.no_grad():
        for head in (model.text_head, model.mel_head):
            head.weight.mul_(HEAD_SCALE)
    return model


FAMILIES = (IDX2, IDX25)  # both models: 2.5's prefix, language rows and 60,510-column text loss in blocks


def _family_losses(cfg) -> tuple[bool, dict]:
    """One model at the official width: CUDA fp32 (TF32 off) against the CPU's fp32; CUDA bf16 and fp16 against
    CUDA fp32. The parameters whose gradients differ most between the CPU and CUDA are named (share of the norm)."""
    model = _model(cfg)
    cpu_grads: dict = {}
    figures: dict = {"size": _size(cfg), "fp32_cpu": _pass(model, "cpu", None, grads=cpu_grads)}
    model.zero_grad(set_to_none=True)
    model.cuda()  # the same weights, moved
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        cuda_grads: dict = {}
        ref = _pass(model, "cuda", None, grads=cuda_grads)
        ok = _compare(figures, "fp32_cuda", ref, figures["fp32_cpu"], FP32_DEVICE_RTOL, FP32_GRAD_NORM_RTOL)
        figures["fp32_cuda"]["worst_grads"] = _worst_grads(cuda_grads, cpu_grads, figures["fp32_cpu"]["grad_norm"])
        del cuda_grads, cpu_grads
        ok &= _compare(figures, "bf16_cuda", _pass(model, "cuda", torch.bfloat16), ref, BF16_RTOL)
        ok &= _compare(figures, "fp16_cuda", _pass(model, "cuda", torch.float16), ref, FP16_RTOL)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        del model
        torch.cuda.empty_cache()
    return ok, figures


def model_losses(ctx: Context) -> Outcome:
    """Each model (2.0, 2.5) at the official width with LOSS_LAYERS layers: _family_losses."""
    return _each_family(ctx, lambda family: _family_losses(ctx.gpt(family, layers=LOSS_LAYERS)))


def _each_family(ctx: Context, compare) -> Outcome:
    """`compare(family)` -> (ok, figures) for each model; the figures under its label, a line each."""
    figures, lines, ok = {}, [], True
    for family in FAMILIES:
        passed, figures[LABELS[family]] = compare(family)
        ok &= passed
        lines += _loss_lines(figures[LABELS[family]], LABELS[family])
    return Outcome(ok, figures, "", tuple(lines))


def _loss_lines(figures: dict, label: str) -> tuple[str, ...]:
    against = ("fp32 cpu for fp32 cuda, fp32 cuda for bf16/fp16" if "fp32_cuda" in figures else "fp32 cpu")
    parts = [f"{name.replace('_', ' ')} {figures[name]['rel_diff']:.1e} (gradient norm "
             f"{figures[name]['grad_rel_diff']:.1e})" for name in figures if "rel_diff" in figures[name]]
    return (f"{label}: {figures['size']}, one training pass: loss vs {against} (relative): {', '.join(parts)}; "
            f"tolerances fp32 {FP32_DEVICE_RTOL} (gradient norm {FP32_GRAD_NORM_RTOL}), bf16 {BF16_RTOL}, "
            f"fp16 {FP16_RTOL}",)


def _size(cfg) -> str:
    return f"{cfg.layers} layers at width {cfg.model_dim}, text head {cfg.number_text_tokens + 1:,} wide"


def _cpu_losses(cfg) -> tuple[bool, dict]:
    model = _model(cfg)
    figures: dict = {"size": _size(cfg), "fp32_cpu": _pass(model, "cpu", None, SMALL_LENGTHS)}
    ref = figures["fp32_cpu"]
    ok = _compare(figures, "bf16_cpu", _pass(model, "cpu", torch.bfloat16, SMALL_LENGTHS), ref, BF16_RTOL)
    ok &= _compare(figures, "fp16_cpu", _pass(model, "cpu", torch.float16, SMALL_LENGTHS), ref, FP16_RTOL)
    return ok, figures


def model_losses_cpu_side(ctx: Context) -> Outcome:
    """The same comparisons on the CPU's autocast (bf16 and fp16 against fp32) at width 64, 2 layers and short
    samples, each model: without bf16 instructions a CPU's bf16 and fp16 products are ~50-80x slower than fp32."""
    return _each_family(ctx, lambda family: _cpu_losses(ctx.gpt(family, model_dim=64, heads=4, layers=2)))
