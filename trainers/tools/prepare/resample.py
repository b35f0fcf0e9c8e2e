"""Band-limited resampling by a windowed sinc, computed with torch (no torchaudio: no wheel exists for the torch
this project pins; shared/reference/features.md section 5).

The method is the common polyphase one (the one torchaudio.transforms.Resample uses by default: a Hann-windowed
sinc of 6 zero crossings, cut-off at 0.99 of the lower Nyquist frequency): the ratio is reduced by the rates'
greatest common divisor to orig -> new, and each of the `new` output phases is a dot product of the input with
its own kernel, stepping `orig` input samples at a time. An output holds ceil(n * new / orig) samples.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

ZERO_CROSSINGS = 6  # of the sinc on each side of a kernel's centre
ROLLOFF = 0.99  # cut-off, as a fraction of the lower rate's Nyquist frequency


@lru_cache(maxsize=16)
def _kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """The `new` phase kernels [new, 1, 2 * width + orig] (float64 computed, float32 kept) and `width`."""
    base = min(orig, new) * ROLLOFF
    width = math.ceil(ZERO_CROSSINGS * orig / base)
    offsets = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    t = (-torch.arange(new, dtype=torch.float64)[:, None] / new + offsets[None, :]) * base
    t = t.clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t))
    return (sinc * window * (base / orig)).to(torch.float32)[:, None, :], width


def resampled_length(samples: int, orig_rate: int, new_rate: int) -> int:
    """How many samples `resample` returns for `samples` at orig_rate (ceil(n * new / orig))."""
    return -(-samples * new_rate // orig_rate)


def resample(waveform: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """A mono float32 waveform [N] at `orig_rate` as float32 at `new_rate` (a copy; the same array's values when
    the rates are equal)."""
    if orig_rate == new_rate:
        return np.asarray(waveform, dtype=np.float32)
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, width = _kernel(orig, new)
    x = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))[None, None, :]
    x = torch.nn.functional.pad(x, (width, width + orig))
    with torch.no_grad():
        y = torch.nn.functional.conv1d(x, kernel, stride=orig)  # [1, new, frames]: phase-major
    out = y[0].transpose(0, 1).reshape(-1)[: resampled_length(waveform.shape[0], orig_rate, new_rate)]
    return out.numpy().astype(np.float32, copy=False)
