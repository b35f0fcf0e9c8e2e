"""The 32-bit integer mixer every dropout mask version (trainers/model/sample_dropout.py, fused_masks.py) is made of.

It works on int64 tensors holding values below 2**32, and its multipliers are below 2**31, so every product stays
below 2**63: no step overflows, in any backend (torch's CPU and CUDA kernels, inductor's C++ and Triton code), so
there is no overflow behaviour for two of them to disagree on.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
SITE_MUL = 0x27D4EB2F  # spreads the sites' numbers before they are added to a sample's key


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Integer mixer on int64 tensors holding values < 2**32 (a bijection of [0, 2**32)).

    Multipliers are below 2**31, so every product stays below 2**63: no signed overflow.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    return x ^ (x >> 16)


def site_key(keys: torch.Tensor, site: int) -> torch.Tensor:
    """The key of each sample's masks at one dropout site: hash32(key + site * SITE_MUL), keys' shape, int64."""
    return hash32((keys + site * SITE_MUL) & MASK32)


def to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 with the same 32 bits (two's complement)."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)
