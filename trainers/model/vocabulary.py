"""The text vocabulary: the tokenizer's size, a checkpoint's, and whether one extends the other.

The text embedding and head are indexed by tokenizer ids, so a run is tied to its tokenizer:
a checkpoint's rows only mean something with the pieces it was trained with.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import sentencepiece as spm

from trainers.config.settings import UserError

log = logging.getLogger("train")


def tokenizer_size(path: str | None) -> int:
    """Pieces of the SentencePiece model at `path` (the number of text tokens of the run)."""
    if not path or not Path(path).is_file():
        raise UserError(f"--tokenizer {path}: file not found")
    try:
        return spm.SentencePieceProcessor(model_file=path).get_piece_size()
    except Exception as exc:
        raise UserError(f"--tokenizer {path}: not a SentencePiece model ({exc})") from None


def checkpoint_text_tokens(ckpt: dict[str, Any]) -> int:
    """Text tokens a trainer checkpoint was trained with (its text tables have one row more)."""
    if "text_tokens" in ckpt.get("vocab", {}):
        return int(ckpt["vocab"]["text_tokens"])
    return int(ckpt["model"]["text_embedding.weight"].shape[0]) - 1


def check_extends(old_path: str | None, new_path: str, checkpoint: Path) -> None:
    """A larger tokenizer must keep every piece of the one the checkpoint was trained with, at its id."""
    if not old_path or not Path(old_path).is_file():
        log.info("the tokenizer %s was trained with is not available, so it cannot be checked that %s extends it",
                 checkpoint, new_path)
        return
    old, new = (spm.SentencePieceProcessor(model_file=p) for p in (old_path, new_path))
    for i in range(min(old.get_piece_size(), new.get_piece_size())):
        if old.id_to_piece(i) != new.id_to_piece(i):
            raise UserError(
                f"--tokenizer {new_path} is not an extension of {old_path}, which {checkpoint} was trained with: id {i} "
                f"is {new.id_to_piece(i)!r} there but {old.id_to_piece(i)!r} in the original. Extend the original with "
                "tools/tokenizer/extend_bpe.py so existing ids keep their meaning")
