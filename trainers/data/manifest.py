"""Parse and validate training manifests (JSONL) before training starts.

Every problem in every given manifest is collected and reported in one
ManifestError, so a data set can be fixed in one pass instead of one crash
per run. Feature files are only checked for existence here; their contents
are checked lazily by trainers.data.features when a sample is loaded.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from trainers.data.manifest_lines import DataLimits, FileContext, Sample, Validator, check_line

__all__ = ["DataLimits", "ManifestError", "ManifestSpec", "Sample", "load_manifests", "manifests_fingerprint",
           "parse_manifest_spec"]

logger = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 30
_LANG_SEPARATOR = "::"
_HASH_CHUNK = 1 << 20


class ManifestError(ValueError):
    """One or more manifest problems; str() lists one problem per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(format_problems(self.problems))

    def __reduce__(self):  # keep `problems` intact across pickling (worker processes)
        return (type(self), (self.problems,))


def format_problems(problems: Sequence[str], limit: int = MAX_LISTED_PROBLEMS) -> str:
    """Join problems one per line, listing at most `limit` of them."""
    lines = list(problems[:limit])
    if len(problems) > limit:
        lines.append(f"... and {len(problems) - limit} more problems")
    return "\n".join(lines)


@dataclass(frozen=True)
class ManifestSpec:
    path: Path
    lang: str | None


def parse_manifest_spec(spec: str) -> ManifestSpec:
    """Split "PATH::LANG" into a ManifestSpec; without "::" the language is None."""
    path_part, sep, lang = spec.rpartition(_LANG_SEPARATOR)
    if not sep:
        path_part, lang_value = spec, None
    else:
        lang_value = lang.strip()
        if not lang_value:
            raise ManifestError(
                [f"{spec}: empty language after '::'; write PATH::LANG (e.g. data/train.jsonl::am) or drop the suffix"]
            )
    if not path_part.strip():
        raise ManifestError([f"{spec}: empty manifest path; write PATH or PATH::LANG"])
    return ManifestSpec(path=Path(path_part), lang=lang_value)


def _read_text(spec: ManifestSpec, flag: str, out: list[str]) -> str | None:
    """Read a manifest as UTF-8 text, or record why it cannot be read."""
    try:
        data = spec.path.read_bytes()
    except FileNotFoundError:
        out.append(f"{flag} {spec.path}: file not found; check the path")
        return None
    except IsADirectoryError:
        out.append(f"{flag} {spec.path}: is a directory; pass the .jsonl manifest file")
        return None
    except OSError as exc:
        out.append(f"{flag} {spec.path}: cannot read ({exc.strerror or exc}); check the file and its permissions")
        return None
    try:
        return data.decode("utf-8-sig")  # tolerate a BOM written by some editors
    except UnicodeDecodeError:
        out.extend(_non_utf8_lines(spec.path, data))
        return None


def _non_utf8_lines(path: Path, data: bytes) -> list[str]:
    """`file:line` of every line that is not UTF-8 (a newline byte never occurs inside a UTF-8
    sequence, so the bytes split into the same lines as the text)."""
    problems = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        skip = len(codecs.BOM_UTF8) if number == 1 and raw.startswith(codecs.BOM_UTF8) else 0
        try:
            raw[skip:].decode("utf-8")
        except UnicodeDecodeError as exc:
            column = skip + exc.start
            problems.append(f"{path}:{number}: not UTF-8 text (byte 0x{raw[column]:02x} at byte {column + 1} of the "
                            "line); save the manifest as UTF-8, e.g. iconv -f LATIN1 -t UTF-8 (with the encoding it "
                            "was written in)")
    return problems


def _load_one(spec: ManifestSpec, check: Validator) -> None:
    text = _read_text(spec, check.flag, check.problems)
    if text is None:
        return
    name = str(spec.path)
    ctx = FileContext(name=name, base=os.path.dirname(os.path.abspath(spec.path)), lang=spec.lang, check=check)
    seen_lines = 0
    # Split on "\n" only: str.splitlines() would also break on U+2028 etc.,
    # which JSON allows unescaped inside strings.
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        seen_lines += 1
        src = f"{name}:{number}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            check.problems.append(f"{src}: invalid JSON ({exc.msg} at column {exc.colno}); write one complete JSON object per line")
            continue
        check_line(obj, ctx, src)
    if seen_lines == 0:
        check.problems.append(f"{check.flag} {spec.path}: manifest has no samples; check the file or drop this manifest")


def _warn_duplicate_ids(samples: Sequence[Sample]) -> None:
    seen: set[str] = set()
    duplicates = 0
    example = None
    for sample in samples:
        if sample.id in seen:
            duplicates += 1
            example = example or sample
        else:
            seen.add(sample.id)
    if duplicates:
        logger.warning(
            "%d samples repeat an id already used by an earlier sample (first at %s, id %r); "
            "unique ids make logs and per-sample errors unambiguous",
            duplicates,
            example.source,
            example.id,
        )


def load_manifests(
    specs: Sequence[ManifestSpec], limits: DataLimits, *, flag: str = "--train-manifest"
) -> list[Sample]:
    """Parse and validate all manifests; raise one ManifestError listing every problem."""
    check = Validator(limits=limits, flag=flag)
    if not specs:
        check.problems.append(f"{flag}: no manifest given; pass at least one PATH or PATH::LANG")
    for spec in specs:
        _load_one(spec, check)
    if check.problems:
        raise ManifestError(check.problems)
    _warn_duplicate_ids(check.samples)
    return check.samples


def manifests_fingerprint(specs: Sequence[ManifestSpec]) -> str:
    """sha256 over each manifest's language and bytes, in order.

    The location is deliberately left out so a moved data folder (paths inside
    are relative) still matches a checkpoint's recorded fingerprint.
    """
    digest = hashlib.sha256()
    digest.update(f"manifests:{len(specs)}\n".encode())
    problems = []
    for spec in specs:
        lang = "<none>" if spec.lang is None else f"={spec.lang}"
        digest.update(f"lang{lang}\n".encode())
        try:
            with open(spec.path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                digest.update(f"bytes:{size}\n".encode())  # length prefix keeps file boundaries unambiguous
                while chunk := handle.read(_HASH_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            problems.append(f"{spec.path}: cannot read manifest for fingerprinting ({exc.strerror or exc}); check the path")
    if problems:
        raise ManifestError(problems)
    return digest.hexdigest()
