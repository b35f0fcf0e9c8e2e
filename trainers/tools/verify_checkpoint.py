"""`tools/inspect_checkpoint.py --verify`: whether a checkpoint matches the checksums written with it.

"ok", "corrupt" (which tensor or field differs, or why the file cannot be read) or "not
verifiable" (checkpoint formats 1 and 2 and official gpt.pth files carry no checksums).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from trainers.checkpoint import schema
from trainers.errors import UserError
from trainers.torch_files import CheckpointError, load_checkpoint


def verify(path: Path) -> dict[str, Any]:
    """{"file", "format", "integrity", "problems"}: the integrity as the module says, and what failed or why the
    file cannot be verified."""
    result: dict[str, Any] = {"file": str(path), "format": None}
    try:
        obj = load_checkpoint(path)
    except CheckpointError as exc:
        if not path.is_file():
            raise UserError(f"{path}: {exc.reason}") from None
        return {**result, "integrity": "corrupt", "problems": [exc.reason]}
    if not schema.is_trainer_checkpoint(obj):
        return {**result, "integrity": "not verifiable",
                "problems": ["not a checkpoint of this trainer (an official gpt.pth or a raw state dict): it carries "
                             "no checksums"]}
    result["format"] = obj["format"]
    try:
        ckpt = schema.parse(obj, path)
    except schema.UnknownFormat as exc:
        return {**result, "integrity": "not verifiable", "problems": [exc.reason]}
    except schema.IntegrityError as exc:
        return {**result, "integrity": "corrupt", "problems": exc.problems}
    except CheckpointError as exc:  # loads and matches no checksums, but is not a complete checkpoint
        return {**result, "integrity": "corrupt", "problems": [exc.reason]}
    if not ckpt.verified:
        return {**result, "integrity": "not verifiable",
                "problems": [f"written before checksums existed (format {ckpt.format_version})"]}
    return {**result, "integrity": "ok", "problems": []}


def render_verify(result: dict[str, Any]) -> list[str]:
    fmt = f" (format {result['format']})" if result["format"] else ""
    lines = [f"file: {result['file']}{fmt}"]
    if result["integrity"] == "ok":
        return lines + ["integrity: ok (every tensor and field matches the checksums written with it)"]
    if result["integrity"] == "not verifiable":
        return lines + [f"integrity: not verifiable: {'; '.join(result['problems'])}"]
    return lines + [f"integrity: CORRUPT ({len(result['problems'])} problem(s)); resume from an older "
                    "model_step*.pth, or let --resume auto pick the newest intact one",
                    *[f"  {p}" for p in result["problems"]]]
