"""Batches of similar lengths, their size from the device's memory, and what happens when memory runs out.

Clips are sorted longest first and cut into batches of at most `batch_size` clips of the longest length: a batch
holds at most batch_size x (its first clip's samples) of audio, so batches of shorter clips hold more of them.
The batch size is --batch-size, or on a GPU the largest that fits, found by trying it as the trainer's
micro-batch probe does (trainers/hardware/batch_probe.py: doubling, then bisection) on clips of the longest
length, within MEMORY_MARGIN of the free memory; on a CPU it is CPU_BATCH.

Out of memory (torch.OutOfMemoryError, or cuBLAS/cuDNN failing to allocate) in a batch: the batch is redone in
two halves and every later batch is formed with half the audio, so the run goes on; one clip alone that does
not fit ends the run (OutOfMemoryStop, exit 5). INDEXTTS_PREPARE_OOM_ABOVE=N makes every encode of more than
N clips raise torch.OutOfMemoryError, so the tests run this on a CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from trainers.hardware.batch_probe import MEMORY_MARGIN, largest_fitting
from trainers.hardware.oom_recovery import OutOfMemoryStop, is_out_of_memory, oom_message, release_memory
from trainers.tools.prepare.backend import Clip, FeatureBackend, Features, check_features

OOM_VAR = "INDEXTTS_PREPARE_OOM_ABOVE"
CPU_BATCH = 16
MAX_BATCH = 256  # clips per batch at most, and the probe's ceiling


@dataclass
class Encoder:
    """A backend's encode over batches, with out-of-memory halving; `budget` is the samples a batch may hold."""

    backend: FeatureBackend
    device: torch.device
    budget: int
    on_halved: Callable[[str], None] = lambda line: None
    oom_above: int | None = field(default_factory=lambda: int(os.environ[OOM_VAR]) if os.environ.get(OOM_VAR) else None)

    def encode(self, clips: Sequence[Clip]) -> list[Features]:
        """Features of every clip, each equal to encode([clip]) alone; halves on out-of-memory."""
        if not clips:
            return []
        failed = None
        try:
            if self.oom_above is not None and len(clips) > self.oom_above:
                raise torch.OutOfMemoryError(f"CUDA out of memory ({OOM_VAR}={self.oom_above})")
            features = self.backend.encode(clips)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(exc):
                raise
            failed = oom_message(exc)
        if failed is None:
            check_features(self.backend, clips, features)
            return features
        _release(self.device)  # outside the handler: its traceback held the failed batch's tensors
        longest = max(c.waveform.shape[0] for c in clips)
        if len(clips) == 1:
            raise OutOfMemoryStop(f"out of memory with one clip of {longest / self.backend.audio_rate:.1f} s "
                                  f"({clips[0].id}; {failed}): use a GPU with more memory, or leave out clips this "
                                  "long")
        self.budget = max(1, min(self.budget, len(clips) * longest) // 2)
        self.on_halved(f"out of memory with {len(clips)} clips, redone in halves; later batches hold half "
                       f"({failed[:30]})")
        half = len(clips) // 2
        return self.encode(clips[:half]) + self.encode(clips[half:])


def next_batch(lengths: Sequence[int], start: int, budget: int) -> int:
    """The end of the batch beginning at `start` of clips sorted longest first: as many as keep
    count x lengths[start] within `budget` (at least one, at most MAX_BATCH; a clip of unknown length, -1, alone)."""
    end = start + 1
    if lengths[start] < 0:  # a length known only once decoded: alone
        return end
    while (end < len(lengths) and lengths[end] >= 0 and end - start < MAX_BATCH
           and (end - start + 1) * max(lengths[start], 1) <= budget):
        end += 1
    return end


def probe_batch_size(encoder: Encoder, longest: int, device: torch.device) -> int:
    """The largest batch of `longest`-sample clips whose encode fits in MEMORY_MARGIN of the free GPU memory (on a
    CPU: that does not run out of memory, which only an injected error does)."""
    cuda = device.type == "cuda"
    free = torch.cuda.mem_get_info(device)[0] * MEMORY_MARGIN if cuda else 0
    rng = np.random.default_rng(0)
    wave = (0.1 * rng.standard_normal(longest)).astype(np.float32)
    clip = Clip("probe", wave, encoder.backend.audio_rate, encoder.backend.audio_rate, 1)

    def fits(n: int) -> bool:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        try:
            if encoder.oom_above is not None and n > encoder.oom_above:
                raise torch.OutOfMemoryError("injected")
            encoder.backend.encode([clip] * n)
            ok = not cuda or torch.cuda.max_memory_allocated(device) - before <= free
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            ok = False
        _release(device)
        return ok

    return max(1, largest_fitting(fits, MAX_BATCH))


def _release(device: torch.device) -> None:
    """Return a failed batch's memory to the GPU (a CPU's allocator needs no collection: it would only cost time)."""
    if device.type == "cuda":
        release_memory(device)
