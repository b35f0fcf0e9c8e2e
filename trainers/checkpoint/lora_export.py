"""Exporting a LoRA run's checkpoint (tools/export_checkpoint.py): the merged model in the upstream layout, or
the adapters alone as an adapter file (trainers/model/lora_file.py).

A LoRA checkpoint (checkpoint format 4) holds the adapters and the text rows the run trained, and names its base
by path and sha256. The merged model is that base with the adapters folded in (W + alpha/rank x A @ B) and the
trained rows in place: the same tensors an AdapterFile merges, so the export and indextts-merge-lora agree.
"""
from __future__ import annotations

from pathlib import Path

import torch

from trainers.checkpoint import schema
from trainers.errors import UserError
from trainers.files import file_sha256
from trainers.model.lora import LoraSettings, is_adapter_key
from trainers.model.lora_file import AdapterFile
from trainers.model.weights import read_state_dict

ADAPTER_NAME = "lora_adapter.pth"


def adapter_file_of(ckpt: schema.Checkpoint) -> AdapterFile:
    lora = ckpt.lora
    assert lora is not None
    settings = LoraSettings(int(lora["rank"]), float(lora["alpha"]), tuple(lora["targets"]), float(lora["dropout"]))
    adapters = {k: v for k, v in ckpt.model.items() if is_adapter_key(k)}
    replaced = {k: v for k, v in ckpt.model.items() if not is_adapter_key(k)}
    return AdapterFile(settings, str(lora["base"]), str(lora["base_sha256"]), adapters, replaced)


def merged_state(ckpt: schema.Checkpoint, path: Path, base: Path | None) -> dict[str, torch.Tensor]:
    """The base the checkpoint names (or `base`, which must be the same file by sha256) with the adapters merged."""
    adapter = adapter_file_of(ckpt)
    base_path = base or Path(adapter.base_path)
    where = "--base" if base else f"its base {base_path} (saved with the run)"
    if not base_path.is_file():
        raise UserError(f"{path} is a LoRA checkpoint: {where} is not there; pass --base with that file "
                        f"(sha256 {adapter.base_sha256[:16]}...)")
    sha = file_sha256(base_path)
    if sha != adapter.base_sha256:
        raise UserError(f"{path} is a LoRA checkpoint trained on {adapter.base_path} (sha256 {adapter.base_sha256[:16]}"
                        f"...), but {where} has sha256 {sha[:16]}...: pass --base with the file the run was trained on")
    state = read_state_dict(base_path, flag="--base")
    try:
        return adapter.merged(state)
    except ValueError as exc:
        raise UserError(f"{path} does not fit its base {base_path}: {exc}") from None
