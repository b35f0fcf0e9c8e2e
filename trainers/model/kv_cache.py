"""Running the GPT blocks of UnifiedVoiceGPT one chunk of positions at a time, with per-layer keys and values
kept from earlier chunks (a KV cache), for generation.

The blocks' own modules compute everything but the attention (layer norms, c_attn, c_proj, the MLP), so
LoRA adapters and any later change to those modules apply here too. Samples of a batch are left-padded to
a common length; a padded position is masked out as a key for every query, and attends only to itself as a
query so that its (unused) output stays finite: a fully masked row would give NaN, and NaN times a zero
attention weight is still NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainers.model.gpt_model import Attention, UnifiedVoiceGPT


@dataclass
class KVCache:
    """Keys and values of every layer, [B, heads, capacity, head_dim] each, filled up to `length`."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pad: torch.Tensor  # [B] left-padding positions of each sample
    length: int = 0

    @classmethod
    def empty(cls, model: UnifiedVoiceGPT, pad: torch.Tensor, capacity: int, dtype: torch.dtype) -> "KVCache":
        cfg = model.cfg
        shape = (pad.shape[0], cfg.heads, capacity, cfg.model_dim // cfg.heads)
        zeros = [torch.zeros(shape, dtype=dtype, device=pad.device) for _ in range(2 * cfg.layers)]
        return cls(zeros[:cfg.layers], zeros[cfg.layers:], pad)

    def allowed(self, chunk: int) -> torch.Tensor:
        """[B, 1, chunk, length + chunk] bool: which keys each new query may attend to."""
        end = self.length + chunk
        query = torch.arange(self.length, end, device=self.pad.device).view(1, chunk, 1)
        key = torch.arange(end, device=self.pad.device).view(1, 1, end)
        real_key = key >= self.pad.view(-1, 1, 1)
        return ((key <= query) & (real_key | (key == query))).unsqueeze(1)


def _attend(attn: Attention, x: torch.Tensor, cache: KVCache, layer: int, allowed: torch.Tensor) -> torch.Tensor:
    b, s, d = x.shape
    q, k, v = attn.c_attn(x).split(d, dim=2)
    q, k, v = (t.view(b, s, attn.heads, d // attn.heads).transpose(1, 2) for t in (q, k, v))
    end = cache.length + s
    cache.keys[layer][:, :, cache.length:end] = k
    cache.values[layer][:, :, cache.length:end] = v
    y = F.scaled_dot_product_attention(q, cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end],
                                       attn_mask=allowed)
    return attn.c_proj(y.transpose(1, 2).reshape(b, s, d))


def last_logits(model: UnifiedVoiceGPT, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the chunk x [B, S, D] through the blocks after what `cache` holds (and add it there); return the
    mel logits [B, Nm] at the chunk's last position: gpt.ln_f, final_norm, mel_head, as upstream inference."""
    allowed = cache.allowed(x.shape[1])
    for i, block in enumerate(model.gpt.h):
        x = x + _attend(block.attn, block.ln_1(x), cache, i, allowed)
        x = x + block.mlp(block.ln_2(x))
    cache.length += x.shape[1]
    return model.mel_head(model.final_norm(model.gpt.ln_f(x[:, -1])))
