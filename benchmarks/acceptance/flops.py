"""Model FLOPs of a training step, and the GPU's peak, for model FLOPs utilisation (MFU).

FLOPs per sample, forward and backward (3 x the forward's 2 per multiply-add), counting matrix products only:
* 6 x (parameters of the transformer blocks) x sequence positions: the usual 6 N T, with N the weights every
  position multiplies (embedding lookups are not products, so the tables are not in N);
* attention: 12 x layers x model_dim x positions^2, PaLM's convention (appendix B of Chowdhery et al. 2022),
  which counts the whole score matrix; a causal kernel computes about half of it, so the MFU is that of
  the usual definition, comparable with published figures;
* the heads, on the positions they read: 6 x model_dim x (text vocabulary + 1) x text targets, and
  6 x model_dim x mel codes x mel targets: for IndexTTS-2.5 a text head of 60,510 columns (5x 2.0's 12,001),
  whose logits its chunked loss computes again in backward (trainers/model/cross_entropy.py): that recomputation
  is hardware work, not model FLOPs, so it is not counted (as activation checkpointing is not);
* the conditioning prefix: IndexTTS-2.5's speaker projection, 6 x 192 x model_dim (one position); 2.0's prefix
  is sums and table lookups, as are 2.5's language embedding and both families' position tables.

Peak dense tensor-core FLOP/s (no sparsity) from NVIDIA's data sheets, in the precision --amp auto picks
there: bf16, or fp16 where the GPU has no bf16 (T4, V100). The A10G is AWS's variant of the A10, whose data
sheet the figure is from; AWS runs it at lower clocks, so its MFU here is a lower bound.
"""
from __future__ import annotations

import re

from trainers.families.indextts25.model import SPEAKER_DIM, IndexTTS25Config
from trainers.model.gpt_model import GPTConfig

# How the model FLOPs are counted, in the words the acceptance run prints beside every MFU.
MFU_RULE = ("model FLOPs per sample = 6 x block params x positions + 12 x layers x width x positions^2 (PaLM's "
            "attention) + 6 x width x vocab x targets (heads; 2.5's text head 60,510 wide, its recomputation in "
            "backward not counted) + 6 x 192 x width (2.5's speaker projection); dense bf16 peak from NVIDIA's data "
            "sheet")

# (pattern on torch.cuda.get_device_name(), peak TFLOP/s, precision, source); first match wins.
PEAKS: tuple[tuple[str, float, str, str], ...] = (
    (r"H100.*PCIe", 756.0, "bf16", "NVIDIA H100 data sheet, PCIe"),
    (r"H100.*NVL", 835.0, "bf16", "NVIDIA H100 data sheet, NVL"),
    (r"H100|H200", 989.0, "bf16", "NVIDIA H100/H200 data sheets, SXM"),
    (r"A100", 312.0, "bf16", "NVIDIA A100 data sheet"),
    (r"\bL4\b", 121.0, "bf16", "NVIDIA L4 data sheet"),
    (r"A10G", 125.0, "bf16", "NVIDIA A10 data sheet (A10G: AWS's lower-clocked A10)"),
    (r"\bA10\b", 125.0, "bf16", "NVIDIA A10 data sheet"),
    (r"\bT4\b", 65.0, "fp16", "NVIDIA T4 data sheet"),
    (r"V100.*PCIE", 112.0, "fp16", "NVIDIA V100 data sheet, PCIe"),
    (r"V100", 125.0, "fp16", "NVIDIA V100 data sheet, SXM2"),
)


def peak_flops(device_name: str) -> tuple[float, str, str] | None:
    """(peak FLOP/s, precision, source) of a GPU by its CUDA name; None for a GPU not in the table."""
    for pattern, tflops, precision, source in PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return tflops * 1e12, precision, source
    return None


def block_parameters(cfg: GPTConfig) -> int:
    """Weights and biases of one transformer block: attention (qkv, projection), MLP, two LayerNorms."""
    d = cfg.model_dim
    return (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d


def conditioning_products(cfg: GPTConfig) -> int:
    """Multiply-adds of one sample's conditioning prefix: 2.5's speaker projection (192 -> model_dim); none in 2.0."""
    return SPEAKER_DIM * cfg.model_dim if isinstance(cfg, IndexTTS25Config) else 0


def flops_per_sample(cfg: GPTConfig, text_len: int, code_len: int, positions: int) -> float:
    """Model FLOPs of forward and backward over one sample of these lengths (see the module docstring); `cfg` of
    either family (its config class says which)."""
    trunk = 6 * cfg.layers * block_parameters(cfg) * positions
    attention = 12 * cfg.layers * cfg.model_dim * positions ** 2
    heads = 6 * cfg.model_dim * ((cfg.number_text_tokens + 1) * (text_len + 1) + cfg.number_mel_codes * (code_len + 1))
    return float(trunk + attention + heads + 6 * conditioning_products(cfg))


def mfu(samples_per_second: float, sample_flops: float, peak: float) -> float:
    return samples_per_second * sample_flops / peak
