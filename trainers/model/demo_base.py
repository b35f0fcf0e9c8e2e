"""A tiny, deterministic stand-in for the official gpt.pth, for the demo and the tests.

It has the official layout: group-A weights at demo scale, a few small group-B tensors the
trainer must carry through unchanged, and keys the loader must drop.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.torch_files import atomic_torch_save

BASE_NAME = "base_gpt.pth"


def _indextts2_extras(d: int) -> dict[str, torch.Tensor]:
    """IndexTTS2's tensors beside the model's: the conditioning encoders (carried) and keys upstream drops."""
    return {
        "conditioning_encoder.embed.pos_enc.pe": torch.randn(1, 40, 16),
        "conditioning_encoder.encoders.0.feed_forward.w_1.weight": torch.randn(32, 16),
        "perceiver_encoder.latents": torch.randn(32, d),
        "emo_conditioning_encoder.embed.pos_enc.pe": torch.randn(1, 40, 16),
        "emo_perceiver_encoder.latents": torch.randn(1, d),
        "emovec_layer.weight": torch.randn(d, 16),
        "emo_layer.weight": torch.randn(d, d),
        "emo_layer.bias": torch.randn(d),
        "inference_model.lm_head.weight": torch.randn(4, d),  # dropped on load, as upstream
        "gpt.wte.weight": torch.randn(4, d),
    }


def ensure_demo_base(root: Path, cfg: GPTConfig, seed: int = 0, model: type[UnifiedVoiceGPT] = UnifiedVoiceGPT,
                     extras: Callable[[int], dict[str, torch.Tensor]] = _indextts2_extras) -> Path:
    """The base checkpoint of a demo folder, made on first use: `model`'s weights (a model family's GPT) and
    `extras(model_dim)`, tensors it carries or upstream drops, drawn after the weights from the same seed."""
    path = root / BASE_NAME
    if path.exists():
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state = dict(model(cfg).state_dict())
        state.update(extras(cfg.model_dim))
    root.mkdir(parents=True, exist_ok=True)
    atomic_torch_save({"model": state}, path)
    return path
