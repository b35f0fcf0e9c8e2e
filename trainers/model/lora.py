"""Low-rank adapters (LoRA) on the GPT blocks' projections, kept apart from the base weights.

An adapted projection computes x @ W + b + scale * (x @ A) @ B, with W and b the base's tensors,
frozen, under their upstream names (`gpt.h.N.attn.c_attn.weight` stays what it was), and A [in, rank],
B [rank, out] beside them as `...c_attn.lora_a` / `...c_attn.lora_b`. B starts at zero, so an adapted
model computes exactly what its base does until the first update. Merging folds the adapters into W
(W + scale * A @ B) and drops the adapter keys, which gives a state dict in the upstream layout.

Our own implementation rather than PEFT's: the blocks use our GPT-2 style Conv1D, which PEFT only
adapts when it is transformers' class (and PEFT brings transformers, accelerate, safetensors and
huggingface_hub); its adapter dropout draws from the global RNG per batch, where ours must be keyed by
sample to keep resumes exact; and the adapter and merge code needed here is a few dozen lines.

The trainer adds them in trainers/run/build.py (add_lora); this module is the model side. Adapter
dropout (LoraSettings.dropout) acts on each adapter's input with masks keyed by sample, at sites of its own
(gpt_model.ADAPTER_SITES), so it is as exact across micro-batch splits and resumes as the model's dropout.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from trainers.config.settings import LORA_TARGET_PATHS
from trainers.model.gpt_model import Conv1D, UnifiedVoiceGPT
from trainers.model.sample_dropout import WidthDropout

TARGET_PATHS = LORA_TARGET_PATHS  # the projections that can carry adapters, by name and path in a block
# All four: adapting every projection of the block, not only the attention's query and value (the LoRA
# paper's choice), is what brings LoRA close to full fine-tuning in QLoRA's comparison (Dettmers et al.,
# 2023); for a new voice or language the MLPs hold much of what has to change.
DEFAULT_TARGETS = tuple(TARGET_PATHS)
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0  # on each adapter's input, keyed by sample (trainers/model/sample_dropout.py)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--lora-rank must be at least 1 to add adapters, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if not self.alpha > 0:
            raise ValueError(f"--lora-alpha must be positive, got {self.alpha}")
        unknown = [t for t in self.targets if t not in TARGET_PATHS]
        if unknown or not self.targets:
            raise ValueError(f"--lora-targets: unknown or empty {unknown or list(self.targets)}; choose from "
                             f"{', '.join(TARGET_PATHS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraConv1D(Conv1D):
    """A Conv1D with an adapter beside its frozen weight; `weight` and `bias` keep their names."""

    def __init__(self, base: Conv1D, rank: int, scale: float, generator: torch.Generator) -> None:
        nn.Module.__init__(self)
        self.weight, self.bias = base.weight, base.bias
        n_in, n_out = base.weight.shape
        self.scale = scale
        # A as nn.Linear's default initialisation would draw it (uniform within 1/sqrt(fan_in)), from the
        # caller's generator so that a run's adapters are a function of its seed alone.
        bound = 1.0 / math.sqrt(n_in)
        a = (torch.rand(n_in, rank, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        self.lora_a = nn.Parameter(a.to(device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(rank, n_out, device=base.weight.device))

    def forward(self, x: torch.Tensor, adapter_drop: WidthDropout | None = None, site: int = 0) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.addmm(self.bias, flat, self.weight)
        dropped = flat if adapter_drop is None else adapter_drop(x, site).reshape(flat.shape)
        out = out + (dropped @ self.lora_a.to(flat.dtype)) @ (self.lora_b.to(flat.dtype) * self.scale)
        return out.view(*x.shape[:-1], -1)


def add_adapters(model: UnifiedVoiceGPT, settings: LoraSettings, seed: int) -> list[str]:
    """Replace the target projections of every block by adapted ones and freeze everything else;
    the caller unfreezes what else trains (new vocabulary rows). Returns the adapted modules' names."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.adapter_dropout = settings.dropout
    generator = torch.Generator().manual_seed(seed)
    adapted = []
    for i, block in enumerate(model.gpt.h):
        for target in settings.targets:
            parent_path, _, attr = TARGET_PATHS[target].rpartition(".")
            parent = block.get_submodule(parent_path)
            base = getattr(parent, attr)
            if isinstance(base, LoraConv1D):
                raise ValueError(f"gpt.h.{i}.{TARGET_PATHS[target]} already carries an adapter")
            setattr(parent, attr, LoraConv1D(base, settings.rank, settings.scale, generator))
            adapted.append(f"gpt.h.{i}.{TARGET_PATHS[target]}")
    return adapted


def is_adapter_key(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone: what a LoRA run trains in the blocks."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if is_adapter_key(k)}


def merge_adapters(state: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
                   scale: float) -> dict[str, torch.Tensor]:
    """The base `state` (upstream names, no adapter keys) with each adapter folded into its weight:
    W + scale * A @ B, computed in fp32 and stored in W's dtype. Every adapter must find its weight."""
    merged = {k: v for k, v in state.items() if not is_adapter_key(k)}
    modules = sorted({k.rsplit(".", 1)[0] for k in adapters})
    for module in modules:
        a, b = adapters.get(f"{module}.lora_a"), adapters.get(f"{module}.lora_b")
        weight = merged.get(f"{module}.weight")
        if a is None or b is None or weight is None:
            raise ValueError(f"adapter {module}: needs lora_a, lora_b and a base {module}.weight")
        if (a.shape[0], b.shape[1]) != tuple(weight.shape) or a.shape[1] != b.shape[0]:
            raise ValueError(f"adapter {module}: shapes {tuple(a.shape)} x {tuple(b.shape)} do not fit the base "
                             f"weight {tuple(weight.shape)}")
        delta = (a.float() @ b.float()) * scale
        merged[f"{module}.weight"] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return merged


def merged_state_dict(model: nn.Module, settings: LoraSettings) -> dict[str, torch.Tensor]:
    """The adapted model as one state dict in the base's layout (the upstream names and shapes)."""
    state = model.state_dict()
    return merge_adapters(state, {k: v for k, v in state.items() if is_adapter_key(k)}, settings.scale)
