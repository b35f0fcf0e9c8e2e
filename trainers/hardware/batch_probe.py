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

from trainers.faults import OomInjector
from trainers.files import write_text_atomically
from trainers.hardware.oom_recovery import is_out_of_memory, release_memory
from trainers.model.gpt_model import UnifiedVoiceGPT, dropout_keys

log = logging.getLogger("train")

CACHE_NAME = "micro_batch_probe.json"
# Use at most this share of the memory that was free when probing: room for the allocator's
# fragmentation, other processes and samples a little longer than the probe's.
MEMORY_MARGIN = 0.85
REFINE_TRIES = 3  # bisection steps between the last size that fit and the first that did not
# NCCL's communication buffers under torchrun: allocated outside torch's allocator when DDP starts,
# after the probe (a few hundred MiB on one node with many channels; more with many peers).
NCCL_BYTES = 2 ** 30
# Bumped when what the probe measures or budgets changes, so answers of an earlier probe are not reused.
PROBE_METHOD = 2


@dataclass(frozen=True)
class ProbeKey:
    """Everything the answer depends on; any difference means probing again."""

    hardware: str
    model_config: str
    amp_dtype: str
    grad_checkpointing: bool
    deterministic: bool  # attention on the math backend, which keeps the whole attention matrix
    dropout: float  # dropout > 0 keeps masks for the backward pass
    dropout_masks: str
    world_size: int  # under torchrun DDP holds a copy of the gradients
    longest_text: int
    longest_codes: int
    effective_batch: int  # of this process
    method: int = PROBE_METHOD


class ProbeCache:
    """micro_batch_probe.json: the micro-batch to start at on this machine with these settings, and the
    smallest one that ran out of memory there (recorded by out-of-memory recovery)."""

    def __init__(self, run_dir: Path, writable: bool = True) -> None:
        self.path = run_dir / CACHE_NAME
        self.writable = writable  # False: another process of the run (torchrun's rank 0) writes it

    def _record(self, key: ProbeKey) -> dict | None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != asdict(key) or not isinstance(data.get("micro_batch"), int):
            return None
        return data

    def lookup(self, key: ProbeKey) -> int | None:
        record = self._record(key)
        return record["micro_batch"] if record else None

    def failed_size(self, key: ProbeKey) -> tuple[int, str] | None:
        """(the micro-batch that ran out of memory, where) when one did with this key."""
        record = self._record(key)
        failed = record.get("out_of_memory_at") if record else None
        return (failed, record.get("detail", "")) if isinstance(failed, int) else None

    def store(self, key: ProbeKey, micro_batch: int, detail: str, out_of_memory_at: int | None = None) -> None:
        if not self.writable:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"key": asdict(key), "micro_batch": micro_batch, "detail": detail,
                  "out_of_memory_at": out_of_memory_at}
        write_text_atomically(self.path, json.dumps(record, indent=2) + "\n")


@dataclass(frozen=True)
class MemoryBudget:
    """The probe's limit, and what a training step holds that a probing pass does not.

    A probing pass measures forward and backward (gradients included). After the probe the run also
    holds AdamW's two moments (each the size of the trained weights), under torchrun DDP's gradient
    buckets (one more copy of the gradients) and NCCL's buffers; the optimizer update needs the
    gradients and one more temporary of the weights' size (foreach AdamW's square-root of exp_avg_sq)."""

    limit: int  # MEMORY_MARGIN x the memory free when probing
    trainable_bytes: int  # of the trained fp32 weights
    world_size: int = 1

    @property
    def resident(self) -> int:
        ddp = self.trainable_bytes + NCCL_BYTES if self.world_size > 1 else 0
        return 2 * self.trainable_bytes + ddp

    def allows(self, peak: int) -> bool:
        """Whether a step fits, when forward and backward peaked at `peak` bytes: the most it holds beyond the
        weights is the larger of that peak and the update's temporaries, plus what stays resident."""
        return max(peak, 2 * self.trainable_bytes) + self.resident <= self.limit


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
               longest_codes: int, oom: OomInjector, world_size: int = 1, upper: int = 0) -> Callable[[int], bool]:
    """fits(n): a step's passes over n longest samples, with what the run holds besides (MemoryBudget),
    stay within MEMORY_MARGIN of the free memory. Below `upper` (the step's samples) a step has several
    micro-batches, so two passes accumulate into the same gradients as the step's do; an allocation
    failure, torch's or cuBLAS/cuDNN's, means n does not fit."""
    trainable_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    budget = None
    if device.type == "cuda":
        budget = MemoryBudget(int(torch.cuda.mem_get_info(device)[0] * MEMORY_MARGIN), trainable_bytes, world_size)

    def fits(n: int) -> bool:
        passes = 2 if n < upper else 1
        try:
            oom.check(n)
            peak = _forward_backward(model, n, device, amp_dtype, longest_text, longest_codes, passes)
            ok = budget is None or budget.allows(peak)
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
                      text_len: int, code_len: int, passes: int = 1) -> int:
    """Peak bytes allocated by `passes` training passes over n longest samples, accumulating gradients
    (0 on CPU: not measured)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    batch = _longest_batch(model, n, text_len, code_len, device)
    ctx = torch.autocast(device_type=device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    for _ in range(passes):
        with ctx:
            sums = model.loss_sums(**batch, dropout_keys=dropout_keys(0, 0, torch.arange(n, device=device)))
        (sums["text_ce"] + sums["mel_ce"]).backward()
        del sums
    if not cuda:
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _longest_batch(model: UnifiedVoiceGPT, n: int, text_len: int, code_len: int,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The model's inputs by name for n samples of the longest shapes. Memory depends on shapes only, so
    constant contents are as good as real features."""
    return {
        **model.example_conditioning(n, device),
        "text_ids": torch.zeros(n, text_len, dtype=torch.long, device=device),
        "text_lens": torch.full((n,), text_len, dtype=torch.long, device=device),
        "codes": torch.zeros(n, code_len, dtype=torch.long, device=device),
        "code_lens": torch.full((n,), code_len, dtype=torch.long, device=device),
    }
