"""A LoRA adapter file: the adapters, the whole tensors a LoRA run trains beside them (the text rows of an
extended vocabulary), the settings that give them meaning, and the base they belong to, named by path and
sha256 so that merging into another base is refused by name instead of producing a silently wrong model.

    {"format": "indextts2-lora-adapter/1",
     "lora": {"rank": 8, "alpha": 16.0, "targets": [...], "dropout": 0.05},
     "base": {"path": "/models/IndexTTS-2/gpt.pth", "sha256": "..."},
     "adapters": {"gpt.h.0.attn.c_attn.lora_a": tensor, ...},
     "replaced": {"text_embedding.weight": tensor, ...}}

Tensors and primitives only, so it loads with torch.load(weights_only=True), like every file we write. On disk
the file also carries checksums of this content ("integrity", as a checkpoint does): written and verified by
trainers/checkpoint/adapter_file.py, which every writer and reader of the file goes through.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainers.errors import UserError
from trainers.model.lora import LoraSettings, is_adapter_key, merge_adapters
from trainers.model.weights import strip_module_prefix

FORMAT = "indextts2-lora-adapter/1"


@dataclass
class AdapterFile:
    settings: LoraSettings
    base_path: str
    base_sha256: str
    adapters: dict[str, torch.Tensor]
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)  # whole tensors that replace the base's

    def to_dict(self) -> dict[str, Any]:
        lora = {**asdict(self.settings), "targets": list(self.settings.targets)}
        return {"format": FORMAT, "lora": lora, "base": {"path": self.base_path, "sha256": self.base_sha256},
                "adapters": self.adapters, "replaced": self.replaced}

    def merged(self, base_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base with the adapters folded in and the replaced tensors in place, in the base's layout (a DDP
        "module." prefix on the base's names dropped, as the trainer drops it from a --base-checkpoint)."""
        base_state, _ = strip_module_prefix(base_state)
        unknown = sorted(k for k in self.replaced if k not in base_state)
        if unknown:
            raise UserError(f"the adapter file replaces tensors the base does not have: {', '.join(unknown[:5])}")
        merged = merge_adapters(base_state, self.adapters, self.settings.scale)
        merged.update(self.replaced)
        return merged


def check_format(obj: Mapping[str, Any], path: Path, flag: str = "--adapter") -> None:
    """UserError unless the loaded file says it is an adapter file (a checkpoint passed instead, say)."""
    if obj.get("format") != FORMAT:
        found = obj.get("format", "no format field")
        raise UserError(f"{flag} {path}: not a LoRA adapter file (format {found!r}, expected {FORMAT!r}); pass "
                        "the adapter file, not a checkpoint")


def adapter_file_from(obj: Mapping[str, Any], path: Path, flag: str = "--adapter") -> AdapterFile:
    """The adapter file's content as loaded from `path`; UserError naming the flag, the file and the reason otherwise."""
    check_format(obj, path, flag)
    try:
        lora = obj["lora"]
        settings = LoraSettings(rank=int(lora["rank"]), alpha=float(lora["alpha"]), targets=tuple(lora["targets"]),
                                dropout=float(lora.get("dropout", 0.0)))
        base = obj["base"]
        adapters, replaced = dict(obj["adapters"]), dict(obj.get("replaced", {}))
        base_path, base_sha = str(base["path"]), str(base["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{flag} {path}: damaged adapter file ({type(exc).__name__}: {exc})") from None
    tensors = {**adapters, **replaced}
    if not adapters or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise UserError(f"{flag} {path}: damaged adapter file (its adapters are missing or not tensors)")
    if not all(is_adapter_key(k) for k in adapters):
        raise UserError(f"{flag} {path}: damaged adapter file (adapter names must end in .lora_a or .lora_b)")
    return AdapterFile(settings, base_path, base_sha, adapters, replaced)
