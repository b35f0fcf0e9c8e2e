"""IndexTTS2's text front end and the SentencePiece model that turns its output into text ids.

front_end() (trainers/data/text_front_end.py) is what IndexTTS2's TextTokenizer.encode applies before
SentencePiece, language normalisation aside (SKIPPED_NORMALISATION says why); Tokenizer encodes manifest
texts through it, and load_tokenizer() refuses a model that can emit the start/stop text ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

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
    path: Path
    sp: spm.SentencePieceProcessor
    start: int
    stop: int

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode([front_end(t) for t in texts], out_type=int)

    def unknown_chars(self, texts: Sequence[str]) -> list[str]:
        """Characters that SentencePiece turns into <unk> on their own, in code-point order."""
        chars = sorted({c for t in texts for c in front_end(t) if not c.isspace()})
        unk = self.sp.unk_id()
        return [c for c, ids in zip(chars, self.sp.encode(chars, out_type=int)) if unk in ids]

    def looks_lower_case(self) -> bool:
        """Cased letters in its text pieces, none upper-case: trained on text that was not upper-cased."""
        sp = self.sp
        cased = {c for i in range(sp.get_piece_size())
                 if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))
                 for c in sp.id_to_piece(i) if c.islower() or c.isupper()}
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
    return Tokenizer(path, sp, start, stop)
