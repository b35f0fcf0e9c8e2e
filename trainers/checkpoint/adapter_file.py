"""A LoRA adapter file on disk: the content trainers/model/lora_file.py defines, with checksums of it as a checkpoint
carries them (trainers/checkpoint/integrity.py, the "integrity" key), written atomically and verified whenever it is
read, so a damaged file is refused by name instead of being merged into a model that computes garbage.

Files written before adapter files carried checksums have no record: they are read, with a warning that they
cannot be verified (nothing else about them is wrong, and refusing them would strand adapters a user has), and
exporting the adapters again from their run gives a file that can be. A record that is present must match.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Union

import torch

from trainers.checkpoint import integrity
from trainers.errors import UserError
from trainers.model.lora_file import AdapterFile, adapter_file_from, check_format
from trainers.torch_files import CheckpointError, atomic_torch_save, load_checkpoint

UNVERIFIABLE = ("written before adapter files carried checksums, so its content cannot be verified; export the "
                "adapters again from their run (tools/export_checkpoint.py RUN --adapter-only) to get a file that can")


@dataclass(frozen=True)
class ReadAdapter:
    adapter: AdapterFile
    verified: bool  # False: a file of before the checksums (see UNVERIFIABLE)


def content(adapter: AdapterFile) -> dict[str, Any]:
    out = adapter.to_dict()
    out[integrity.RECORD_KEY] = integrity.compute(out)
    return out


def write(adapter: AdapterFile, target: Union[Path, IO[bytes]]) -> None:
    """To a path (atomically: the old file or the complete new one) or an open file (an export's temporary)."""
    if isinstance(target, Path):
        atomic_torch_save(content(adapter), target)
    else:
        torch.save(content(adapter), target)


def read(path: Path, flag: str = "--adapter") -> ReadAdapter:
    """The adapter file at `path`, verified; UserError naming the flag, the file and the tensor or field that differs."""
    try:
        obj = load_checkpoint(Path(path))
    except CheckpointError as exc:
        raise UserError(f"{flag} {path}: {exc.reason}") from None
    check_format(obj, path, flag)
    record = obj.get(integrity.RECORD_KEY)
    if record is not None:
        problems = integrity.problems(obj, record)
        if problems:
            raise UserError(f"{flag} {path}: damaged adapter file, its content does not match the checksums written "
                            f"with it ({integrity.summary(problems)}); nothing was written. Export the adapters again "
                            "from their run (tools/export_checkpoint.py RUN --adapter-only) or use a backup")
    return ReadAdapter(adapter_file_from(obj, path, flag), record is not None)
