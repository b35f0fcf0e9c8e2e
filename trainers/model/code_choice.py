"""Choosing the next mel code from the mel head's logits: greedy, or sampled from a caller's generator.

The steps follow the order in which upstream's HF `generate` applies them (transformers 4.52, which
IndexTTS2 pins): repetition penalty, then temperature, top-k, top-p, then a draw. Sampling reads only the
`torch.Generator` it is given, never the global RNG, so generating samples during training consumes
none of training's random state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

# One generator for the batch (its rows draw in turn), or one per row: a row's draws then do not depend on
# the other rows, so each sample's codes are those it gets alone (as greedy codes are).
Generators = Union[torch.Generator, Sequence[torch.Generator]]

# Upstream feeds `generate` placeholder ids of 1 for every prompt position (its `fake_inputs`), plus
# the start code; HF's repetition penalty counts them as already generated, so mel code 1 and the
# start code are always penalised there. We do the same, so a penalty gives upstream's codes.
UPSTREAM_PLACEHOLDER_ID = 1


@dataclass(frozen=True)
class Sampling:
    """Sampled generation; top_k 0 and top_p 1.0 switch those filters off.

    infer_v2's defaults are temperature 0.8, top_k 30, top_p 0.8 (with repetition_penalty 10 and beam
    search, see trainers/model/generation.py). Unlike HF, top_k is not 50 when left out: it is off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling temperature must be positive, got {self.temperature}; use greedy "
                             "generation (no Sampling) for the most likely codes")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k must be 0 (off) or a positive number of codes, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}; 1.0 switches it off")


def first_seen(batch: int, vocabulary: int, start_code: int, device: torch.device) -> torch.Tensor:
    """[B, V] bool: the codes upstream's penalty counts before the first step (placeholder and start)."""
    seen = torch.zeros(batch, vocabulary, dtype=torch.bool, device=device)
    seen[:, [UPSTREAM_PLACEHOLDER_ID, start_code]] = True
    return seen


def penalise(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty: a seen code's logit is divided by the penalty if positive, else multiplied."""
    scaled = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, scaled, logits)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely codes whose probabilities sum to at least p (always the most likely one)."""
    if p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, dim=-1)  # ascending, as HF does, so ties drop the same codes
    tail = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = tail <= 1 - p
    drop[..., -1] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def choose(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float, sampling: Sampling | None,
           generator: Generators | None) -> torch.Tensor:
    """The next code of each row of `logits` [B, V]: [B] int64."""
    if seen is not None and penalty != 1.0:
        logits = penalise(logits, seen, penalty)
    if sampling is None:
        return logits.argmax(dim=-1)  # the first of equal maxima, as HF's greedy search
    logits = _top_p(_top_k(logits.float() / sampling.temperature, sampling.top_k), sampling.top_p)
    probs = logits.softmax(dim=-1)
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.cat([torch.multinomial(row.unsqueeze(0), 1, generator=g) for row, g in zip(probs, generator)]).squeeze(1)
