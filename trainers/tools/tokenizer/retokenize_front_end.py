"""IndexTTS2's text front end and the SentencePiece model that turns its output into text ids; IndexTTS-2.5's
tiktoken file and front end (trainers/families/indextts25/front_end.py) where --tokenizer is one.

front_end() (trainers/data/text_front_end.py) is what IndexTTS2's TextTokenizer.encode applies before
SentencePiece, language normalisation aside (SKIPPED_NORMALISATION says why); Tokenizer encodes manifest
texts through it, and load_tokenizer() refuses a model that can emit the start/stop text ids. TiktokenLines
encodes each line in its language as IndexTTS-2.5 inference does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import sentencepiece as spm

from trainers.data.text_front_end import front_end
from trainers.tools.tokenizer.retokenize_errors import Refusal

SKIPPED_NORMALISATION = (
    "language normalisation SKIPPED: IndexTTS2's TextNormalizer (WeTextProcessing for en/zh: numbers, dates, "
    "contractions, pinyin, punctuation maps; the ja/am rules of forks) is not available and not imitated; "
    "the text must already be written as it would leave the normaliser, or inference will see other ids")
APPLIED_FRONT_END = (
    "front end applied: empty text -> no ids; a single (stripped) character encoded as is; otherwise the CJK "
    "pre-tokeniser (strip, split around CJK characters, UPPER-CASE, join with single spaces), then SentencePiece")


# ----------------------------------------------------------------------------- tokenizer

@dataclass
class Tokenizer:
    sp: spm.SentencePieceProcessor
    family: str = "indextts2"
    applied: str = APPLIED_FRONT_END
    skipped: str = SKIPPED_NORMALISATION

    def size(self) -> int:
        return self.sp.get_piece_size()

    def encode_lines(self, texts: Sequence[str], languages: Sequence[str | None]) -> list[list[int]]:
        return self.sp.encode([front_end(t) for t in texts], out_type=int)

    def counts(self, ids: Sequence[int]) -> tuple[int, int]:
        """(<unk> ids, byte-fallback ids) among `ids`."""
        unk = self.sp.unk_id()
        return sum(1 for i in ids if i == unk), sum(1 for i in ids if self.sp.is_byte(i))

    def unknown_chars(self, texts: Sequence[str]) -> list[str]:
        """Characters that SentencePiece turns into <unk> on their own, in code-point order."""
        chars = sorted({c for t in texts for c in front_end(t) if not c.isspace()})
        unk = self.sp.unk_id()
        return [c for c, ids in zip(chars, self.sp.encode(chars, out_type=int)) if unk in ids]

    def looks_lower_case(self) -> bool:
        sp = self.sp
        text_pieces = (i for i in range(sp.get_piece_size())
                       if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)))
        return lower_case_only(c for i in text_pieces for c in sp.id_to_piece(i))


def lower_case_only(chars: Iterable[str]) -> bool:
    """Cased letters, none upper-case: the characters of a tokenizer trained on text that was not upper-cased
    (extend_bpe asks this of a base model too)."""
    cased = {c for c in chars if c.islower() or c.isupper()}
    return bool(cased) and not any(c.isupper() for c in cased)


def load_tokenizer(path: Path, start: int, stop: int) -> Tokenizer:
    if not path.is_file():
        raise Refusal([f"--tokenizer {path}: no such file; pass the SentencePiece .model the trainer will use"])
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as exc:
        raise Refusal([f"--tokenizer {path} is not a SentencePiece model ({str(exc).strip()}); pass the .model "
                       "file (e.g. checkpoints/bpe.model), not the .vocab"]) from None
    problems = []
    for name, token in (("start", start), ("stop", stop)):
        if token >= sp.get_piece_size() or not sp.is_control(token):
            what = f"has only {sp.get_piece_size()} pieces" if token >= sp.get_piece_size() else \
                f"has {sp.id_to_piece(token)!r} as id {token}, a piece SentencePiece emits for text"
            problems.append(
                f"--tokenizer {path} {what}, but IndexTTS2 reads id {token} as the {name} text token "
                f"(gpt.{name}_text_token), so such ids would be taken for it; use a tokenizer whose ids "
                f"{start} and {stop} are the control pieces <s> and </s>, as the official bpe.model "
                "(SentencePiece training: --bos_id=0 --eos_id=1 --unk_id=2)")
    if problems:
        raise Refusal(problems)
    return Tokenizer(sp)


@dataclass
class TiktokenLines:
    """IndexTTS-2.5's tokenizer (its .tiktoken file) and front end: each line encoded in its language."""

    encoding: object
    applied: str
    skipped: str
    family: str = "indextts25"

    def size(self) -> int:
        return self.encoding.n_vocab

    def encode_lines(self, texts: Sequence[str], languages: Sequence[str | None]) -> list[list[int]]:
        from trainers.families.indextts25.front_end import text_ids
        return [text_ids(self.encoding, t, lang) if lang else [] for t, lang in zip(texts, languages)]

    def counts(self, ids: Sequence[int]) -> tuple[int, int]:
        """(0: a byte-level tokenizer has no <unk>, ids of single non-ASCII bytes: characters broken into bytes)."""
        pieces = self.encoding.decode_tokens_bytes(list(ids)) if ids else []
        return 0, sum(1 for piece in pieces if len(piece) == 1 and piece[0] >= 0x80)

    def unknown_chars(self, texts: Sequence[str]) -> list[str]:
        return []

    def looks_lower_case(self) -> bool:
        return False


def load_any_tokenizer(path: Path, start: int, stop: int) -> Tokenizer | TiktokenLines:
    """A .tiktoken file is IndexTTS-2.5's tokenizer; anything else must be a SentencePiece model."""
    from trainers.families.indextts25.front_end import APPLIED, SKIPPED
    from trainers.families.indextts25.tokenizer import NotTiktoken, encoding, is_tiktoken_file

    if path.is_file() and is_tiktoken_file(path):
        try:
            return TiktokenLines(encoding(path), APPLIED, SKIPPED)
        except NotTiktoken as exc:
            raise Refusal([f"--tokenizer {path}: not a tiktoken file of IndexTTS-2.5 ({exc})"]) from None
    return load_tokenizer(path, start, stop)
