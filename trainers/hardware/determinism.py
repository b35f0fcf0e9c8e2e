"""--deterministic: kernels that give the same bits run to run on a GPU, or a clear stop.

`torch.use_deterministic_algorithms(True)` without warn_only: an op with a deterministic variant
uses it, and an op without one raises instead of running. So no step of a --deterministic run is
ever computed with a nondeterministic kernel; the trainer turns the error into exit status 2
naming the op (`NondeterministicOp`), keeping the steps finished before it (each of them ran
deterministic kernels only).

Attention. With deterministic algorithms on (and warn_only off), torch's CUDA dispatcher skips
cuDNN attention, flash attention runs its deterministic backward, and memory-efficient attention
runs with a single key split, which is deterministic (torch's aten/src/ATen/native/transformers/
cuda/sdp_utils.cpp and attention_backward.cu). Both keep memory linear in the sequence length,
so nothing needs forcing onto the math backend, which materialises the attention matrix:
heads x length^2 per sample and layer (0.48 GB at 20 heads x 2,450 positions in fp32).
`attention_backend` says which one the training pass gets; torch itself makes the choice.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from trainers.hardware.detect import Hardware

log = logging.getLogger("train")

CUBLAS_DETERMINISTIC = ":4096:8"  # a fixed cuBLAS workspace: what its deterministic mode needs
NO_DETERMINISM_ADVICE = ("pass --no-deterministic to train on with nondeterministic kernels (a resume then agrees "
                         "with an uninterrupted run within float rounding, not bit for bit), or use a torch build "
                         "with a deterministic kernel for that op")
_NO_KERNEL = " does not have a deterministic implementation"
_CUBLAS = "because it uses CuBLAS"
_SPLIT_KEYS = "makes the algorithm non-deterministic"


def make_deterministic() -> None:
    """Deterministic kernels for the rest of the process; an op without one raises RuntimeError."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # Flash and memory-efficient attention are deterministic in this mode (see above); cuDNN attention
    # is not, and torch skips it anyway: switched off so that the choice does not rest on that.
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    torch.backends.cuda.enable_math_sdp(True)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


@dataclass(frozen=True)
class AttentionBackend:
    name: str  # "flash", "memory-efficient", "math" or "cpu"
    detail: str

    def describe(self) -> str:
        return f"{self.name} ({self.detail})"


def attention_backend(machine: Hardware, amp_dtype: torch.dtype | None, head_dim: int) -> AttentionBackend:
    """The SDPA backend torch's CUDA dispatcher picks for a deterministic training pass of this model.

    Mirrors the dispatcher's rules for dense inputs with a causal mask and no attention dropout:
    flash needs compute 8.0-12.1, fp16/bf16 and head_dim <= 256 (not 193-224 when training on
    compute 8.6/8.9/12.x); memory-efficient needs compute 5.0-12.1, fp32/fp16 (bf16 from 8.0)
    and head_dim a multiple of the GEMM alignment. Also what the micro-batch probe's cache key
    may record, since the math backend needs far more memory.
    """
    if machine.gpu is None:
        return AttentionBackend("cpu", "torch's CPU kernels, deterministic")
    cap, dtype = machine.gpu.capability, amp_dtype or torch.float32
    half = dtype in (torch.float16, torch.bfloat16)
    where = f"{str(dtype).removeprefix('torch.')}, head dim {head_dim}, compute {cap[0]}.{cap[1]}"
    training_limit = (8, 6) <= cap <= (8, 9) or cap >= (12, 0)
    if (8, 0) <= cap <= (12, 1) and half and head_dim <= 256 and not (training_limit and 192 < head_dim <= 224):
        return AttentionBackend("flash", f"deterministic backward; {where}")
    alignment = (8 if half else 4) if cap >= (8, 0) else (8 if half else 1) if cap >= (7, 0) else 1
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if cap >= (8, 0) else (torch.float32, torch.float16)
    if (5, 0) <= cap <= (12, 1) and dtype in dtypes and head_dim % alignment == 0:
        return AttentionBackend("memory-efficient", f"deterministic backward with one key split; {where}")
    return AttentionBackend("math", f"no fused kernel for {where}; keeps the full attention matrix")


def math_attention_bytes(seq_len: int, heads: int, dtype: torch.dtype | None) -> int:
    """Bytes the math backend keeps per sample and layer for backward: the attention probabilities."""
    element = torch.finfo(dtype).bits // 8 if dtype is not None else 4
    return heads * seq_len * seq_len * element


class NondeterministicOp(RuntimeError):
    """Under --deterministic an op with no deterministic kernel on this device was about to run; it did not."""

    def __init__(self, op: str, where: str) -> None:
        super().__init__(f"--deterministic: {op} has no deterministic implementation on this device (torch "
                         f"{torch.__version__}), met {where}; it was not run, so no step was computed with it")
        self.op = op

    @classmethod
    def from_error(cls, exc: BaseException, where: str) -> "NondeterministicOp | None":
        """The stop for torch's error about a nondeterministic op; None for any other error."""
        if isinstance(exc, cls):
            return exc
        text = str(exc)
        if _NO_KERNEL in text:
            words = text.split(_NO_KERNEL, 1)[0].split()
            return cls(words[-1] if words else "an op", where)
        if _CUBLAS in text:
            value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            return cls(f"cuBLAS (CUBLAS_WORKSPACE_CONFIG={value!r}; its deterministic settings are "
                       f"{CUBLAS_DETERMINISTIC} and :16:8, unset it to get the first)", where)
        if _SPLIT_KEYS in text:
            return cls("memory-efficient attention with several key splits", where)
        return None


def nondeterministic_or(exc: RuntimeError, where: str) -> RuntimeError:
    """What to raise for a RuntimeError of a pass: the stop for a nondeterministic op, else the error itself."""
    return NondeterministicOp.from_error(exc, where) or exc


def log_determinism(machine: Hardware, amp_dtype: torch.dtype | None, heads: int, head_dim: int,
                    seq_len: int) -> None:
    """The start-up line of a --deterministic run: what it guarantees, and the attention backend."""
    backend = attention_backend(machine, amp_dtype, head_dim)
    log.info("deterministic: on (an op with no deterministic kernel stops the run with exit 2 before it runs)")
    log.info("attention: %s", backend.describe())
    if backend.name == "math":
        gib = math_attention_bytes(seq_len, heads, amp_dtype) / 2 ** 30
        log.warning("attention runs on the math backend, which keeps %.2f GiB per sample and layer at the longest "
                    "sequence the config allows (%d positions); if memory runs short pass a smaller --batch-size. "
                    "Mixed precision (--amp bf16 or fp16) may give a fused backend on this GPU", gib, seq_len)
