"""The text vocabulary: the tokenizer's size, and whether one tokenizer extends another.

The text embedding and head are indexed by tokenizer ids, so a run is tied to its tokenizer:
a checkpoint's rows only mean something with the pieces it was trained with. Which tokenizer a
model family uses is its `TokenizerAdapter` (trainers/families); IndexTTS2's is SentencePiece.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import sentencepiece as spm

from trainers.errors import UserError

log = logging.getLogger("train")


@dataclass(frozen=True)
class Vocabulary:
    text_tokens: int       # pieces of the run's tokenizer: rows 0..text_tokens-1 (+ the extra row)
    base_text_tokens: int  # pieces of the vocabulary training started from (the base checkpoint's)

    @property
    def extended(self) -> bool:
        return self.text_tokens > self.base_text_tokens

    def to_dict(self) -> dict[str, int]:
        return {"text_tokens": self.text_tokens, "base_text_tokens": self.base_text_tokens}


class TokenizerAdapter(Protocol):
    """A model family's tokenizer: what --tokenizer names, its size, whether a file is of its kind, whether one
    extends another, what its size must be beside the config's gpt.number_text_tokens (a problem, or None), the
    library's own tokenizer object (for the experiment API)."""

    kind: str  # what --tokenizer takes, for messages: "SentencePiece model"
    # Whether a fresh start re-encodes the manifests' first texts with it (trainers/data/tokenizer_fit.py).
    checks_manifest_text: bool

    def size(self, path: str | None) -> int: ...

    def recognises(self, path: str) -> bool: ...

    def config_size_problem(self, size: int, configured: int | None) -> str | None: ...

    def check_extends(self, old_path: str | None, new_path: str, checkpoint: Path) -> None: ...

    def load(self, path: str) -> Any: ...


@dataclass(frozen=True)
class SentencePieceTokenizer:
    """IndexTTS2's tokenizer (bpe.model)."""

    kind: str = "SentencePiece model"
    checks_manifest_text: bool = True

    def size(self, path: str | None) -> int:
        """Pieces of the SentencePiece model at `path` (the number of text tokens of the run)."""
        if not path or not Path(path).is_file():
            raise UserError(f"--tokenizer {path}: file not found")
        try:
            return spm.SentencePieceProcessor(model_file=path).get_piece_size()
        except Exception as exc:
            raise UserError(f"--tokenizer {path}: not a SentencePiece model ({exc})") from None

    def recognises(self, path: str) -> bool:
        try:
            self.load(path)
            return True
        except Exception:  # noqa: BLE001 - sentencepiece raises several types for what is not a model
            return False

    def config_size_problem(self, size: int, configured: int | None) -> str | None:
        return None  # the tokenizer's size is the model's, whatever the config says (a larger one extends it)

    def check_extends(self, old_path: str | None, new_path: str, checkpoint: Path) -> None:
        """A larger tokenizer must keep every piece of the one the checkpoint was trained with, at its id."""
        if not old_path or not Path(old_path).is_file():
            log.info("the tokenizer %s was trained with is not available, so it cannot be checked that %s "
                     "extends it", checkpoint, new_path)
            return
        old, new = self.load(old_path), self.load(new_path)
        for i in range(min(old.get_piece_size(), new.get_piece_size())):
            if old.id_to_piece(i) != new.id_to_piece(i):
                raise UserError(
                    f"--tokenizer {new_path} is not an extension of {old_path}, which {checkpoint} was "
                    f"trained with: id {i} is {new.id_to_piece(i)!r} there but {old.id_to_piece(i)!r} in the "
                    "original. Extend the original with tools/tokenizer/extend_bpe.py so existing ids keep "
                    "their meaning")

    def load(self, path: str) -> spm.SentencePieceProcessor:
        return spm.SentencePieceProcessor(model_file=path)
