"""Out-of-memory recovery: what the trainer does when a pass does not fit.

A forward/backward pass (or the unscaling and clipping after it) that runs out of memory
(torch.OutOfMemoryError, or the RuntimeError cuBLAS/cuDNN raise when they cannot allocate) is abandoned whole: its partial
gradients are dropped, memory is returned to the device, and the same samples are processed
again in pieces half the size. Because the loss is normalised per optimizer step, the redone
step equals the original within float rounding. Below a batch of 1 there is nothing to try.
"""
from __future__ import annotations

import gc

import torch


class StepOutOfMemory(RuntimeError):
    """Forward/backward of a micro-batch ran out of memory; the step can be redone with smaller pieces."""


class OutOfMemoryStop(RuntimeError):
    """Out of memory at batch size 1: nothing smaller to try."""


# How allocation failures inside cuBLAS and cuDNN surface: a RuntimeError, not torch.OutOfMemoryError.
_LIBRARY_ALLOC_FAILURES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA error: out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _LIBRARY_ALLOC_FAILURES)


def oom_message(exc: BaseException) -> str:
    # Only the first line: the rest of CUDA's message is allocator statistics.
    return (str(exc).strip().splitlines() or ["out of memory"])[0]


def halved(size: int, what: str, error: str) -> int:
    """The next size to try after `error` at `size`; OutOfMemoryStop when size is already 1."""
    if size <= 1:
        raise OutOfMemoryStop(f"out of memory in {what} even with a batch of 1 ({error})")
    return size // 2


def release_memory(device: torch.device) -> None:
    """Return what a failed or finished pass held, so the next try starts from the same state.

    Call it outside the `except` block that caught the error: the exception's traceback keeps
    the failed pass's frames, and with them its activations, alive until the handler ends.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
