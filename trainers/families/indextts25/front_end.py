"""IndexTTS-2.5's text front end: text and language -> the text ids the model sees, as upstream's infer_v2_5 makes
them (shared/reference/indextts25-gpt.md, section 3), for `indextts-retokenize` and the demo.

In upstream's order: punctuation mapped (its char_rep_map, matched in its order); language normalisation (SKIPPED
here, see SKIPPED); lower case for ja, zh, zhen and en, UPPER case for es, other languages as written;
pronunciation annotations `<word|PRON>` rewritten; the Japanese morpheme split (SKIPPED); every `<|...|>`
upper-cased; then `encode("<|lang|> " + text, allowed_special="all")`. Upstream appends a stop id and its model
drops every id 0 and 1 from the content; here ids 0 and 1 are dropped, as the trainer's data path drops them.
"""
from __future__ import annotations

import re
from typing import Any

# Upstream's TextNormalizer.char_rep_map, in its order (its regex tries the keys in this order).
PUNCTUATION: tuple[tuple[str, str], ...] = (
    ("：", ","), ("；", ","), (";", ","), ("，", ","), ("。", "."), ("！", "!"), ("？", "?"), ("\n", " "), ("·", "-"),
    ("、", ","), ("...", "…"), (",,,", "…"), ("，，，", "…"), ("……", "…"), ("“", "'"), ("”", "'"), ('"', "'"),
    ("‘", "'"), ("’", "'"), ("（", "'"), ("）", "'"), ("(", "'"), (")", "'"), ("《", "'"), ("》", "'"), ("【", "'"),
    ("】", "'"), ("[", "'"), ("]", "'"), ("—", "-"), ("～", "-"), ("~", "-"), ("「", "'"), ("」", "'"), (":", ","),
)
_PUNCTUATION = dict(PUNCTUATION)
_PUNCTUATION_PATTERN = re.compile("|".join(re.escape(key) for key, _ in PUNCTUATION))
LOWER_CASED = ("ja", "zh", "zhen", "en")
UPPER_CASED = ("es",)
_ANNOTATION = re.compile(r"<([^|>\n]+)\|([^>\n]+)>")
_SPECIAL = re.compile(r"<\|([^|]+)\|>")
_CJK = re.compile(r"[\u4e00-\u9fff]")
_KANA = (re.compile(r"[\u3040-\u309F]+"), re.compile(r"[\u30A0-\u30FF]+"))

SKIPPED = (
    "language normalisation SKIPPED: IndexTTS-2.5 inference normalises zh, zhen and en with WeTextProcessing and ja "
    "and es with nemo_text_processing (numbers, dates, units...); neither is a dependency here, so write such text "
    "as the normaliser would leave it (or pass text_normalization=False to inference too); the Japanese morpheme "
    "split (JapaneseG2PProcessor) is SKIPPED as well")
APPLIED = (
    "front end applied (IndexTTS-2.5): punctuation map, casing by language (lower: ja zh zhen en; UPPER: es; others "
    "as written), <word|PRON> annotations, <|...|> upper-cased, '<|lang|> ' prefix, tiktoken with every special "
    "token allowed, ids 0 and 1 dropped")


def _annotation(match: re.Match) -> str:
    word, pronunciation = match.group(1), match.group(2).upper()
    if any(kana.fullmatch(pronunciation) for kana in _KANA):
        return f" {pronunciation} "
    token = "SPECIAL_TOKEN_2" if _CJK.search(word) else "SPECIAL_TOKEN_1"
    return f"<|{token}|>{pronunciation}<|{token}|>"


def front_end(text: str, lang: str) -> str:
    """The string upstream's infer_v2_5 encodes for `text` in language `lang`, normalisation aside."""
    code = lang.lower()
    text = _PUNCTUATION_PATTERN.sub(lambda m: _PUNCTUATION[m.group()], text)
    if code in LOWER_CASED:
        text = text.lower()
    if code in UPPER_CASED:
        text = text.upper()
    text = _ANNOTATION.sub(_annotation, text)
    text = _SPECIAL.sub(lambda m: f"<|{m.group(1).upper()}|>", text)
    return f"<|{code}|> " + text


def text_ids(encoding: Any, text: str, lang: str) -> list[int]:
    """The ids the model sees: the front end's string encoded, ids 0 and 1 dropped."""
    return [i for i in encoding.encode(front_end(text, lang), allowed_special="all") if i not in (0, 1)]
