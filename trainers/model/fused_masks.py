"""Dropout masks v3: the keep decision is made in the kernel that applies it, forward and backward.

The mask of a cell is a pure function of its sample's key for the site and its cell index, nothing else:

    a    = hash32((key + site * 0x27D4EB2F) mod 2**32)        the (sample, site) key; key = dropout_keys(seed, step, i)
    u    = hash32((cell * 0x9E3779B1 + 0x632BE5AB) mod 2**32)  the counter, a bijection of the cell index
    z    = hash32(u xor a)                                      (cell = position * width + channel)
    kept iff z >= round(p * 2**32); a kept cell is scaled by 1 / (1 - p), a dropped one is 0

(hash32: trainers/model/mask_hash.py). So, as for v1 and v2, a sample's masks do not depend on its batch-mates,
the padding, the micro-batch split, a resume or a recomputation under gradient checkpointing.

Why a keyed hash of a counter and not Philox: Philox-4x32 (torch's CUDA dropout, Triton's tl.rand) is also a key
and a counter, but its rounds need the high half of 32 x 32-bit products, which torch has no operation for; in
int64 those products overflow (its multipliers are above 2**31), and overflow is where backends may differ. Two
rounds of the project's mixer need only low halves, every product below 2**63, and their masks show no correlation
between samples, sites, shifted positions or keys that differ in one bit (tests/test_dropout_masks.py).

Why int64: no value reaches 2**63 (the mixer multiplies values below 2**32 by constants below 2**31, the counter
cells below 2**31 by a constant below 2**32; a larger sample is refused), so no operation overflows in torch's CPU
or CUDA kernels nor in the C++ or Triton code inductor generates from the same function: the bits cannot depend on
where it runs. A GPU compiler is free to
narrow the arithmetic to 32 bits (only low halves are ever kept); the result is the same.

Where it runs: on CUDA, `torch.compile` of `mask_and_scale` (inductor makes one pointwise kernel of it: read x,
hash, compare, write x * scale or 0), the same compiled function in forward and backward, so nothing is saved
for backward and the backward regenerates the mask. On the CPU the same function runs eagerly (the reference),
in chunks whose int64 temporaries stay in the cache.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterator

import torch

from trainers.model.mask_hash import MASK32, hash32, site_key

CELL_MUL, CELL_ADD = 0x9E3779B1, 0x632BE5AB  # the counter's affine map before the mixer
MAX_CELLS = 2**31  # cells per sample: cell * CELL_MUL + CELL_ADD stays below 2**63
# The devices where v3 runs compiled (tests add "cpu" to compile it there once).
COMPILED_DEVICES = ("cuda",)
# On the CPU, cells of the whole micro-batch per chunk: 1 MiB per int64 temporary, which then stays in cache.
_CPU_CELLS = 1 << 17
# Device types where compiling failed in this process: v3 runs unfused there from then on (the same masks).
_FAILED: set[str] = set()


def threshold(p: float) -> int:
    """The 32-bit threshold of drop rate p: a cell is kept iff its hash is at least this (rate within 2**-33 of p)."""
    return min(round(p * 2**32), 2**32 - 1)


def check_cells(cells: int) -> None:
    if cells >= MAX_CELLS:
        raise ValueError(f"dropout masks v3 take at most {MAX_CELLS - 1} cells (positions x width) per sample, "
                         f"got {cells}")


def site_keys(keys: torch.Tensor, site: int) -> torch.Tensor:
    """The per-sample key `a` of a site, [B, 1] int64 (B: the samples' dropout_keys)."""
    return site_key(keys.view(-1, 1), site)


def mask_and_scale(x: torch.Tensor, keys: torch.Tensor, first_cell: int, threshold: int, scale: float) -> torch.Tensor:
    """x [B, N] holding cells first_cell .. first_cell + N - 1 of each sample: x * scale where kept, 0 where dropped.

    `keys` [B, 1] int64 are the samples' site keys (`site_keys`). The definition of v3, run eagerly on the CPU and
    compiled on CUDA.
    """
    cells = torch.arange(first_cell, first_cell + x.shape[1], dtype=torch.int64, device=x.device)
    z = hash32(hash32((cells * CELL_MUL + CELL_ADD) & MASK32) ^ keys)
    return torch.where(z >= threshold, x * scale, 0.0)


@functools.cache
def _compiled():
    # dynamic: one kernel for every batch size, length and width (the adapters' inputs are 4 x wider).
    return torch.compile(mask_and_scale, dynamic=True, fullgraph=True)


@functools.cache
def _compiles_on(device_type: str) -> bool:
    if device_type not in COMPILED_DEVICES:
        return False
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            warnings.warn("dropout masks v3 run unfused on this GPU: torch.compile needs Triton, which this torch "
                          "install lacks (the masks are the same, the step slower); install the triton package "
                          "that matches torch, or train with --dropout-masks v2")
            return False
    return True


@contextlib.contextmanager
def compiled_on(device_type: str) -> Iterator[None]:
    """Inside, v3 runs compiled on `device_type` too (the tests and benchmarks/dropout_cost.py compile it for the
    CPU to see what inductor makes of the same function there)."""
    global COMPILED_DEVICES
    saved = COMPILED_DEVICES
    COMPILED_DEVICES = (*saved, device_type)
    _compiles_on.cache_clear()
    try:
        yield
    finally:
        COMPILED_DEVICES = saved
        _compiles_on.cache_clear()
        _FAILED.discard(device_type)


def apply(t: torch.Tensor, keys: torch.Tensor, threshold: int, scale: float) -> torch.Tensor:
    """t [B, ...] through the v3 masks of its cells (each sample's cells numbered in t's order), fused where the
    device compiles it, else eagerly (in chunks on the CPU)."""
    flat = t.reshape(t.shape[0], -1)
    if t.device.type not in _FAILED and _compiles_on(t.device.type):
        try:
            # Detached and without grad, as FusedMask needs it: one graph (per dtype) serves forward and backward.
            with torch.no_grad():
                return _compiled()(flat.detach(), keys, 0, threshold, scale).view(t.shape)
        except Exception as exc:
            from torch._dynamo.exc import BackendCompilerFailed  # loaded by torch.compile (not at import: 1.5 s)

            if not isinstance(exc, BackendCompilerFailed):  # inductor's errors are; a kernel's (out of memory) not
                raise
            _FAILED.add(t.device.type)
            inner = getattr(exc, "inner_exception", None) or exc
            first = f"{type(inner).__name__}: {(str(inner).strip().splitlines() or [''])[0][:160]}"
            warnings.warn(f"dropout masks v3 run unfused on {t.device.type} from now on: torch.compile failed "
                          f"({first}); the masks are the same, the steps slower; fix what the error names (a C "
                          f"compiler, Triton) or train new runs with --dropout-masks v2")
    if t.device.type != "cpu":
        return mask_and_scale(flat, keys, 0, threshold, scale).view(t.shape)
    chunk = max(1024, _CPU_CELLS // max(1, flat.shape[0]))
    out = torch.empty_like(flat)
    for start in range(0, flat.shape[1], chunk):
        part = slice(start, start + chunk)
        out[:, part] = mask_and_scale(flat[:, part], keys, start, threshold, scale)
    return out.view(t.shape)


class FusedMask(torch.autograd.Function):
    """x * keep * scale, the mask made where it is applied; backward applies the same mask to the gradient.

    Nothing is saved for backward: the site keys ([B, 1] integers, not an activation) and two numbers are kept
    on the context, and the mask is regenerated from them.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, keys: torch.Tensor, threshold: int, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.keys, ctx.threshold, ctx.scale = keys, threshold, scale
        return apply(x, keys, threshold, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return apply(grad, ctx.keys, ctx.threshold, ctx.scale), None, None, None
