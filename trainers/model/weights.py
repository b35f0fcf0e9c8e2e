"""Load an official (or raw) gpt.pth into the model, resizing the text vocabulary if needed.

The text embedding and text head have Nt+1 rows: ids 0..Nt-1 are tokens and row Nt is an
extra row no token id reaches. With a larger tokenizer (N > Nt pieces) ids 0..Nt-1 keep their
base rows, ids Nt..N-1 are new, and the extra row moves to row N, so the layout stays the
one upstream inference expects for number_text_tokens = N.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trainers.model.gpt_model import split_state_dict
from trainers.config.settings import UserError

log = logging.getLogger(__name__)

TEXT_ROW_KEYS = ("text_embedding.weight", "text_head.weight", "text_head.bias")
MODEL_NAMESPACES = ("gpt.", "text_", "mel_", "speed_emb.", "final_norm.")


@dataclass
class BaseWeights:
    carried: dict[str, torch.Tensor]   # group B and unknown keys, written back unchanged
    base_text_tokens: int              # Nt of the base checkpoint (text_embedding rows - 1)
    dropped: list[str] = field(default_factory=list)
    new_text_rows: int = 0


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of an official-format file: {"model": sd, ...} or a raw sd."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--base-checkpoint {path}: file not found") from None
    except Exception as exc:  # corrupt file, or one that needs pickled code
        raise UserError(f"--base-checkpoint {path}: cannot be read with torch.load(weights_only=True): {exc}") from None
    state = obj.get("model", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"--base-checkpoint {path}: not a state dict (expected tensors, or a dict with a 'model' state dict)")
    return state


def load_base_weights(path: Path, model: nn.Module) -> BaseWeights:
    trained, carried, dropped = split_state_dict(read_state_dict(path))
    own = model.state_dict()
    # Keys in the model's own namespaces that it lacks (e.g. extra layers) mean the config does
    # not match; anything else is unknown to us and is carried through rather than lost.
    unexpected = sorted(k for k in set(trained) - set(own) if k.startswith(MODEL_NAMESPACES))
    for key in sorted(set(trained) - set(own) - set(unexpected)):
        log.warning("base checkpoint key %s is not part of the trained model; it is carried into saved checkpoints unchanged", key)
        carried[key] = trained.pop(key)
    missing = sorted(set(own) - set(trained))
    if "text_embedding.weight" not in trained:
        raise UserError(f"--base-checkpoint {path}: no text_embedding.weight; is this an IndexTTS2 gpt.pth?")
    base_tokens = trained["text_embedding.weight"].shape[0] - 1
    new_tokens = own["text_embedding.weight"].shape[0] - 1
    if new_tokens < base_tokens:
        raise UserError(
            f"the tokenizer has {new_tokens} pieces but --base-checkpoint {path} has {base_tokens} text tokens; "
            "use the tokenizer the checkpoint was trained with, or an extension of it"
        )
    mismatched = [
        f"  {k}: checkpoint {tuple(trained[k].shape)}, model {tuple(own[k].shape)}"
        for k in sorted(set(trained) & set(own))
        if _shape_mismatch(k, trained[k].shape, own[k].shape)
    ]
    if missing or mismatched or unexpected:
        lines = [f"--base-checkpoint {path} does not fit the model built from --config:"]
        lines += [f"  missing: {k}" for k in missing] + mismatched
        lines += [f"  not in the model: {k}" for k in unexpected]
        lines.append("check that --config matches the checkpoint (model_dim, layers, heads, max_*_tokens, number_mel_codes)")
        raise UserError("\n".join(lines))
    for key in TEXT_ROW_KEYS:
        trained[key] = resize_text_rows(trained[key], new_tokens)
    model.load_state_dict(trained, strict=True)
    if new_tokens > base_tokens:
        log.info("text vocabulary extended from %d to %d tokens: new rows start at the mean of the base rows",
                 base_tokens, new_tokens)
    return BaseWeights(carried=carried, base_text_tokens=base_tokens, dropped=dropped,
                       new_text_rows=new_tokens - base_tokens)


def _shape_mismatch(key: str, ckpt: torch.Size, model: torch.Size) -> bool:
    # Text rows may differ in number (vocabulary extension), never in width.
    return ckpt[1:] != model[1:] if key in TEXT_ROW_KEYS else ckpt != model


def resize_text_rows(base: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Rows for `new_tokens` tokens + the extra row, from a tensor with base_tokens + 1 rows."""
    base_tokens = base.shape[0] - 1
    if new_tokens == base_tokens:
        return base
    # New ids start at the mean of the base token rows: a neutral point that keeps the first
    # logits of a new token ordinary, instead of random rows that can dominate the softmax.
    mean = base[:base_tokens].float().mean(dim=0, keepdim=True).to(base.dtype)
    new_rows = mean.expand(new_tokens - base_tokens, *base.shape[1:])
    return torch.cat([base[:base_tokens], new_rows, base[base_tokens:]], dim=0).clone()
