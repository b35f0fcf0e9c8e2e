"""IndexTTS-2.5's tokenizer: upstream's `.tiktoken` file through the tiktoken library.

The file (multilingual_zh_ja_yue_char_del.tiktoken in upstream's model folder) holds one mergeable rank a line,
"<base64 of the bytes> <rank>"; upstream's get_encoding appends the 1673 special tokens of languages.py after the
ranks, so the tokenizer has ranks + 1673 ids, which must equal gpt.number_text_tokens (60,509 for the release).
Those specials follow the ranks, so no rank can be added without moving every `<|xx|>` token: the vocabulary
cannot be extended (a new language borrows a code, see languages.py). The file is fingerprinted by its sha256,
as the SentencePiece model of IndexTTS2 is.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.errors import UserError
from trainers.families.indextts25.languages import SPECIAL_TOKENS

# GPT-2's pre-tokenising pattern, as upstream's get_encoding passes it.
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
UPSTREAM_NAME = "multilingual_zh_ja_yue_char_del.tiktoken"  # the name upstream inference opens in model_dir


class NotTiktoken(ValueError):
    """The file is not a tiktoken ranks file; the message says where."""


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """The mergeable ranks of a .tiktoken file, checked: every line "<base64> <rank>", the ranks 0..n-1 once each."""
    ranks: dict[bytes, int] = {}
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                parts = line.split()
                try:
                    if len(parts) != 2:
                        raise ValueError
                    token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                except (ValueError, binascii.Error):
                    raise NotTiktoken(f"line {number} is not '<base64 bytes> <rank>'") from None
                if token in ranks:
                    raise NotTiktoken(f"line {number} repeats the bytes of rank {ranks[token]}")
                ranks[token] = rank
    except UnicodeDecodeError:
        raise NotTiktoken("not a text file") from None
    if not ranks:
        raise NotTiktoken("holds no ranks")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise NotTiktoken(f"its {len(ranks)} ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def is_tiktoken_file(path: str | Path) -> bool:
    """Whether the file starts like a tiktoken ranks file (its first line "<base64> <rank>")."""
    try:
        with open(path, "rb") as f:
            first = f.readline(4096).split()
        return len(first) == 2 and first[1].isdigit() and bool(base64.b64decode(first[0], validate=True))
    except (OSError, ValueError, binascii.Error):
        return False


def encoding(path: str | Path) -> Any:
    """The tiktoken Encoding upstream builds from the file: its ranks, then the 1673 special tokens."""
    import tiktoken

    ranks = read_ranks(path)
    specials = {token: len(ranks) + i for i, token in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(Path(path).name, pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials,
                             explicit_n_vocab=len(ranks) + len(specials))


@dataclass(frozen=True)
class TiktokenTokenizer:
    """The TokenizerAdapter of IndexTTS-2.5 (trainers/model/vocabulary.py)."""

    kind: str = f"tiktoken file (IndexTTS-2.5's {UPSTREAM_NAME})"
    # Not at start: its front end normalises per language with tools this trainer does not run (docs/indextts25.md).
    checks_manifest_text: bool = False

    def size(self, path: str | None) -> int:
        """Its ids: the ranks plus the 1673 special tokens."""
        if not path or not Path(path).is_file():
            raise UserError(f"--tokenizer {path}: file not found")
        try:
            return len(read_ranks(path)) + len(SPECIAL_TOKENS)
        except NotTiktoken as exc:
            raise UserError(f"--tokenizer {path}: not a {self.kind}: {exc}") from None
        except OSError as exc:
            raise UserError(f"--tokenizer {path}: cannot be read ({exc.strerror or exc})") from None

    def recognises(self, path: str) -> bool:
        return is_tiktoken_file(path)

    def check_extends(self, old_path: str | None, new_path: str, checkpoint: Path) -> None:
        raise UserError(f"--tokenizer {new_path} has another number of ids than the tokenizer {checkpoint} was trained "
                        f"with ({old_path}): IndexTTS-2.5's tokenizer cannot be extended (its special tokens, the "
                        "<|xx|> languages among them, follow the ranks and would all move). Train with the tokenizer "
                        "of the checkpoint; a new language borrows a language code (docs/indextts25.md)")

    def load(self, path: str) -> Any:
        return encoding(path)

    def config_size_problem(self, size: int, configured: int | None) -> str | None:
        """Its ids must be gpt.number_text_tokens exactly: upstream sizes the text rows from the config."""
        if configured is None or configured == size:
            return None
        return (f"gpt.number_text_tokens is {configured} but the tokenizer has {size} ids ({size - len(SPECIAL_TOKENS)}"
                f" ranks + {len(SPECIAL_TOKENS)} special tokens); IndexTTS-2.5's must be equal (the release: 60509)")
