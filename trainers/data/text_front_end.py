"""IndexTTS2's text front end, language normalisation aside: the string its TextTokenizer.encode hands to
SentencePiece. Used to re-make text ids (trainers/tools/tokenizer/retokenize_front_end.py) and to check the
manifests' ids against --tokenizer at a fresh start (trainers/data/tokenizer_fit.py)."""
from __future__ import annotations

import re

CJK_RANGES = ((0x1100, 0x11FF), (0x2E80, 0xA4CF), (0xA840, 0xD7AF), (0xF900, 0xFAFF),
              (0xFE30, 0xFE4F), (0xFF65, 0xFFDC), (0x20000, 0x2FFFF))
_CJK_CHAR = re.compile("([" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in CJK_RANGES) + "])")


def pre_tokenize(text: str) -> str:
    """IndexTTS2's CJK pre-tokeniser: every CJK character its own word, parts upper-cased."""
    parts = (part.strip() for part in _CJK_CHAR.split(text.strip()))
    return " ".join(part.upper() for part in parts if part)


def front_end(text: str) -> str:
    """The string IndexTTS2 hands to SentencePiece for ``text``, language normalisation aside."""
    if not text:
        return ""
    if len(text.strip()) == 1:
        return text  # as is: not stripped, not upper-cased
    return pre_tokenize(text)
