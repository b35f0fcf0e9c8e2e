"""Were the manifests' text ids made with --tokenizer? Checked on a fresh start, before anything is built.

The text ids of a manifest mean pieces of the tokenizer they were made with. Another SentencePiece model
of the same size passes every other check (the ids are in range), the run trains, and the model learns
text ids that the tokenizer inference uses would never produce; a resume refuses the tokenizer change,
but only after the first run. Manifests of the usual preprocessing keep each line's text (`target_text`
in a paired line, `text` in a single-utterance line): here the first FIRST_LINES lines with a text of
every manifest are encoded again with --tokenizer, through IndexTTS2's front end (and, for a preprocessing
that skipped it, as written), and compared with their stored ids.

The preprocessing's text normaliser (numbers, dates, punctuation) is not reproduced, so a line with a
number may differ from its ids even with the right tokenizer. The start is refused only when most
checked lines differ AND the ids differ throughout (mean similarity of the id sequences below
MIN_SIMILARITY): the signature of another tokenizer, not of a normalised word here and there. Lines
without a text, or whose ids file cannot be read, are skipped (the per-sample checks report the latter).
Cost: reading FIRST_LINES lines and as many small .npy files per manifest, and encoding them: milliseconds.
"""
from __future__ import annotations

import difflib
import json
import logging
import os
from dataclasses import dataclass
from itertools import islice
from typing import Iterator, Sequence

import numpy as np
import sentencepiece as spm

from trainers.data.manifest import ManifestSpec
from trainers.errors import UserError
from trainers.data.text_front_end import front_end

log = logging.getLogger("train")

FIRST_LINES = 8  # lines with a text checked per manifest
MIN_SIMILARITY = 0.5  # mean difflib ratio of stored vs encoded ids below which the ids are another tokenizer's
# (text field, its ids file field), per manifest form
TEXT_FIELDS = (("target_text", "target_text_ids_path"), ("text", "text_ids_path"))


@dataclass(frozen=True)
class Checked:
    source: str
    text: str
    stored: list[int]
    encoded: list[int]
    similarity: float

    @property
    def matches(self) -> bool:
        return self.similarity == 1.0


def _lines_with_text(spec: ManifestSpec) -> Iterator[tuple[str, str, str]]:
    """(manifest:line, text, ids file path) of each line that carries a text, read as they are asked for."""
    base = os.path.dirname(os.path.abspath(spec.path))
    with open(spec.path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                obj = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
            except (UnicodeDecodeError, ValueError):
                continue
            if not isinstance(obj, dict):
                continue
            for text_key, ids_key in TEXT_FIELDS:
                text, ids_path = obj.get(text_key), obj.get(ids_key)
                if isinstance(text, str) and text.strip() and isinstance(ids_path, str) and ids_path:
                    yield f"{spec.path}:{number}", text, os.path.join(base, ids_path)
                    break


def _stored_ids(path: str) -> list[int] | None:
    try:
        ids = np.load(path, allow_pickle=False)
    except Exception:  # noqa: BLE001 - the per-sample check reports an unreadable file with its line
        return None
    if not isinstance(ids, np.ndarray) or not np.issubdtype(ids.dtype, np.integer):
        return None
    return ids.reshape(-1).tolist()


def check_line(sp: spm.SentencePieceProcessor, source: str, text: str, stored: list[int]) -> Checked:
    """The line's ids against --tokenizer's encodings of its text: IndexTTS2's front end, stripped, as written."""
    best: tuple[float, list[int]] = (-1.0, [])
    for variant in dict.fromkeys((front_end(text), text.strip(), text)):
        encoded = sp.encode(variant, out_type=int)
        ratio = 1.0 if encoded == stored else difflib.SequenceMatcher(None, stored, encoded, autojunk=False).ratio()
        best = max(best, (ratio, encoded), key=lambda pair: pair[0])
    return Checked(source, text, stored, best[1], best[0])


def check_text_ids(specs: Sequence[ManifestSpec], tokenizer: str) -> list[Checked]:
    """Refuse (UserError) manifests whose text ids --tokenizer does not produce; returns the lines checked."""
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    checked = []
    for spec in specs:
        for source, text, ids_path in islice(_lines_with_text(spec), FIRST_LINES):
            stored = _stored_ids(ids_path)
            if stored is not None:
                checked.append(check_line(sp, source, text, stored))
    if not checked:
        log.info("--tokenizer: the manifests carry no text (target_text / text) to check their text ids with")
        return checked
    matching = sum(c.matches for c in checked)
    mean = sum(c.similarity for c in checked) / len(checked)
    if 2 * matching >= len(checked) or mean >= MIN_SIMILARITY:
        return checked
    first = next(c for c in checked if not c.matches)
    raise UserError("\n".join([
        f"--tokenizer {tokenizer} does not make the manifests' text ids ({matching} of {len(checked)} lines checked "
        f"match, mean similarity {mean:.2f}):",
        f"  {first.source}: the text {first.text!r} is stored as ids {_short(first.stored)}, the tokenizer gives "
        f"{_short(first.encoded)}",
        "the ids were made with another tokenizer: training on them teaches ids that inference never produces.",
        "Pass the tokenizer they were made with, or make them again with tools/tokenizer/retokenize_manifest.py; if",
        "your preprocessing changes the text before tokenizing (a front end of its own), pass --no-tokenizer-check.",
        "Nothing was written"]))


def _short(ids: list[int], shown: int = 8) -> str:
    return "[" + ", ".join(map(str, ids[:shown])) + (", ...]" if len(ids) > shown else "]")
