"""The summed cross-entropy of the heads, in two formulations with the same gradient.

`F.cross_entropy` (the default) runs NLLLoss, which torch's documentation lists among the ops
without a deterministic CUDA implementation; under --deterministic, where such an op stops the
run, the loss is log_softmax, a gather of each target's column and a sum instead: gather's
backward has a deterministic CUDA kernel in that mode. Both give bit-identical gradients; the
loss values differ only in the order of the final sum (a few ulps, measured on the CPU in
tests/test_deterministic.py). The default stays F.cross_entropy, so runs saved before keep
their logged losses bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """sum_i -log softmax(logits[i])[targets[i]] over rows of [N, C] logits (every target valid)."""
    if not deterministic:
        return F.cross_entropy(logits, targets, reduction="sum")
    return -F.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).sum()
