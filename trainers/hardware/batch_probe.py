"""Find the largest micro-batch that fits by trying it, and remember the answer per machine.

A VRAM table cannot know the sequence lengths of the user's data, gradient checkpointing or
the AMP dtype, so the probe runs real forward and backward passes on the longest sample shapes
of the training set. The answer is cached in the run directory with everything it depends on,
so a resume on the same machine starts at once and a resume on another machine probes again.
"""
from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from trainers.files import write_text_atomically
from trainers.training.faults import OomInjector
from trainers.model.layout import CONDITION_LEN
from trainers.model.gpt_model import UnifiedVoiceGPT, dropout_keys
from trainers.hardware.oom_recovery import is_out_of_memory, release_memory

log = logging.getLogger("train")

CACHE_NAME = "micro_batch_probe.json"
# Use at most this share of the memory that was free when probing: room for the allocator's
# fragmentation, other processes and samples a little longer than the probe's.
MEMORY_MARGIN = 0.85
REFINE_TRIES = 3  # bisection steps between the last size that fit and the first that did not


@dataclass(frozen=True)
class ProbeKey:
    """Everything the answer depends on; any difference means probing again."""

    hardware: str
    model_config: str
    amp_dtype: str
    grad_checkpointing: bool
    longest_text: int
    longest_codes: int
    effective_batch: int


class ProbeCache:
    def __init__(self, run_dir: Path, writable: bool = True) -> None:
        self.path = run_dir / CACHE_NAME
        self.writable = writable  # False: another process of the run (torchrun's rank 0) writes it

    def lookup(self, key: ProbeKey) -> int | None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if data.get("key") != asdict(key) or not isinstance(data.get("micro_batch"), int):
            return None
        return data["micro_batch"]

    def store(self, key: ProbeKey, micro_batch: int, detail: str) -> None:
        if not self.writable:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.path, json.dumps({"key": asdict(key), "micro_batch": micro_batch,
                                                     "detail": detail}, indent=2) + "\n")


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in 1..upper with fits(n), assuming fits is monotone; 0 if even 1 fails.

    Doubling finds the bracket in log2(upper) tries; a few bisection steps then recover most
    of the gap, e.g. 12 instead of 8 when 16 does not fit.
    """
    good, bad, n = 0, upper + 1, 1
    while n <= upper:
        if not fits(n):
            bad = n
            break
        good = n
        if n == upper:
            break
        n = min(2 * n, upper)
    for _ in range(REFINE_TRIES):
        if bad - good <= 1:
            break
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def model_fits(model: UnifiedVoiceGPT, device: torch.device, amp_dtype: torch.dtype | None, longest_text: int,
               longest_codes: int, oom: OomInjector) -> Callable[[int], bool]:
    """fits(n): one forward and backward of n longest samples stays within the memory budget.

    The budget also leaves room for AdamW's two moments, which are allocated only at the first
    optimizer step and so are not yet part of the measured peak.
    """
    trainable_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    budget = None
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] * MEMORY_MARGIN - 2 * trainable_bytes

    def fits(n: int) -> bool:
        try:
            oom.check(n)
            peak = _forward_backward(model, n, device, amp_dtype, longest_text, longest_codes)
            ok = budget is None or peak <= budget
        except RuntimeError as exc:  # torch.OutOfMemoryError, or cuBLAS/cuDNN failing to allocate
            if not is_out_of_memory(exc):
                raise
            ok, peak = False, 0
        model.zero_grad(set_to_none=True)
        release_memory(device)  # the failed pass's tensors went with its frame
        log.debug("micro-batch probe: %d samples %s (peak %.2f GiB)", n, "fit" if ok else "do not fit", peak / 2 ** 30)
        return ok

    return fits


def _forward_backward(model: UnifiedVoiceGPT, n: int, device: torch.device, amp_dtype: torch.dtype | None,
                      text_len: int, code_len: int) -> int:
    """Peak bytes allocated by one training pass over n longest samples (0 on CPU: not measured)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    batch = _longest_batch(n, model.cfg.model_dim, text_len, code_len, device)
    ctx = torch.autocast(device_type=device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    with ctx:
        sums = model.loss_sums(*batch, dropout_keys=dropout_keys(0, 0, torch.arange(n, device=device)))
    (sums["text_ce"] + sums["mel_ce"]).backward()
    if not cuda:
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _longest_batch(n: int, dim: int, text_len: int, code_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    # Memory depends on shapes only, so constant contents are as good as real features.
    return (
        torch.zeros(n, CONDITION_LEN, dim, device=device),
        torch.zeros(n, dim, device=device),
        torch.zeros(n, text_len, dtype=torch.long, device=device),
        torch.full((n,), text_len, dtype=torch.long, device=device),
        torch.zeros(n, code_len, dtype=torch.long, device=device),
        torch.full((n,), code_len, dtype=torch.long, device=device),
    )
