"""The summed cross-entropy of the heads, in two formulations with the same gradient.

`F.cross_entropy` (the default) runs NLLLoss, which torch's documentation lists among the ops
without a deterministic CUDA implementation; under --deterministic, where such an op stops the
run, the loss is log_softmax, a gather of each target's column and a sum instead: gather's
backward has a deterministic CUDA kernel in that mode. Both give bit-identical gradients; the
loss values differ only in the order of the final sum (a few ulps, measured on the CPU in
tests/test_deterministic.py). The default stays F.cross_entropy, so runs saved before keep
their logged losses bit for bit.

`chunked_head_cross_entropy` computes a head and its loss a block of rows at a time, recomputing each
block's logits in backward instead of keeping them: for a head as wide as IndexTTS-2.5's text head (60,510
columns) the logits of a micro-batch would otherwise take more memory than anything else of the loss
(benchmarks/family_cost.py measures it). Another order of float sums than one big matmul, so a family uses it
from its first run on (IndexTTS-2.5), never on runs that were trained without it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """sum_i -log softmax(logits[i])[targets[i]] over rows of [N, C] logits (every target valid)."""
    if not deterministic:
        return F.cross_entropy(logits, targets, reduction="sum")
    return -F.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).sum()


def _block_cross_entropy(h: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         deterministic: bool) -> torch.Tensor:
    return summed_cross_entropy(F.linear(h, weight, bias).float(), targets, deterministic)


def chunked_head_cross_entropy(h: torch.Tensor, targets: torch.Tensor, head: torch.nn.Linear, rows: int,
                               deterministic: bool = False) -> torch.Tensor:
    """summed_cross_entropy(head(h).float(), targets), `rows` rows at a time, each block's logits recomputed in
    backward (peak: one block's logits instead of all of them)."""
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], rows):
        block = (h[start:start + rows], targets[start:start + rows], head.weight, head.bias, deterministic)
        total = total + (checkpoint(_block_cross_entropy, *block, use_reentrant=False) if torch.is_grad_enabled()
                         else _block_cross_entropy(*block))
    return total
