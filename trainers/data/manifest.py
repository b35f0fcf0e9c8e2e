"""Parse and validate training manifests (JSONL) before training starts (a line's checks: manifest_lines).

Every problem in every given manifest is collected and reported in one ManifestError, so a data set can be
fixed in one pass instead of one crash per run. The samples become a SampleTable (trainers.data.sample_table);
a manifest is read line by line, so a large one is never held in memory as text.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from trainers.config.manifest_flags import manifest_flag
from trainers.data.manifest_lines import DataLimits, FileContext, Validator, check_line
from trainers.data.sample_table import Sample, SampleTable, StringPool

__all__ = ["DataLimits", "ManifestError", "ManifestSpec", "Sample", "SampleTable", "load_manifests",
           "manifests_fingerprint", "parse_manifest_spec", "validate_manifests", "warn_duplicate_ids"]

logger = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 30
_HASH_CHUNK = 1 << 20


class ManifestError(ValueError):
    """One or more manifest problems; str() lists one problem per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = self.problems[:MAX_LISTED_PROBLEMS]
        if len(self.problems) > MAX_LISTED_PROBLEMS:
            shown.append(f"... and {len(self.problems) - MAX_LISTED_PROBLEMS} more problems")
        super().__init__("\n".join(shown))

    def __reduce__(self):  # keep `problems` intact across pickling (worker processes)
        return (type(self), (self.problems,))


@dataclass(frozen=True)
class ManifestSpec:
    path: Path
    lang: str | None


def parse_manifest_spec(spec: str) -> ManifestSpec:
    """Split "PATH::LANG" into a ManifestSpec; without "::" the language is None (a replay share, PATH::LANG@SHARE,
    is the mixing's: trainers/data/mixing.py)."""
    one = manifest_flag(spec)
    lang = None if one.lang is None else one.lang.strip()
    if lang == "":
        raise ManifestError(
            [f"{spec}: empty language after '::'; write PATH::LANG (e.g. data/train.jsonl::am) or drop the suffix"])
    if not one.path.strip():
        raise ManifestError([f"{spec}: empty manifest path; write PATH or PATH::LANG"])
    return ManifestSpec(path=Path(one.path), lang=lang)


def _lines(spec: ManifestSpec, flag: str, out: list[str]) -> Iterator[tuple[int, bytes]]:
    """(number, bytes without the newline) of each line; the reason the file cannot be read goes to `out`.

    Split on b"\n" only: str.splitlines() would also break on U+2028 etc., which JSON allows
    unescaped inside strings (and a newline byte never occurs inside a UTF-8 sequence).
    """
    try:
        with open(spec.path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                yield number, raw[:-1] if raw.endswith(b"\n") else raw
    except FileNotFoundError:
        out.append(f"{flag} {spec.path}: file not found; check the path")
    except IsADirectoryError:
        out.append(f"{flag} {spec.path}: is a directory; pass the .jsonl manifest file")
    except OSError as exc:
        out.append(f"{flag} {spec.path}: cannot read ({exc.strerror or exc}); check the file and its permissions")


def _decode(path: Path, number: int, raw: bytes) -> tuple[str | None, str | None]:
    """(text, None), or (None, the line's `file:line` problem) for bytes that are not UTF-8."""
    skip = len(codecs.BOM_UTF8) if number == 1 and raw.startswith(codecs.BOM_UTF8) else 0  # some editors write one
    try:
        return raw[skip:].decode("utf-8"), None
    except UnicodeDecodeError as exc:
        column = skip + exc.start
        return None, (f"{path}:{number}: not UTF-8 text (byte 0x{raw[column]:02x} at byte {column + 1} of the line); "
                      "save the manifest as UTF-8, e.g. iconv -f LATIN1 -t UTF-8 (with the encoding it was written in)")


def _load_one(spec: ManifestSpec, check: Validator) -> None:
    name = str(spec.path)
    ctx = FileContext(name=name, base=os.path.dirname(os.path.abspath(spec.path)), lang=spec.lang, check=check)
    first_problem, seen_lines, not_utf8, unreadable = len(check.problems), 0, False, []
    for number, raw in _lines(spec, check.flag, unreadable):
        text, problem = _decode(spec.path, number, raw)
        if problem:
            if not not_utf8:  # a file in another encoding: its lines' other problems would only be noise
                del check.problems[first_problem:]
                not_utf8 = True
            check.problems.append(problem)
            continue
        if not_utf8 or not text.strip():
            continue
        seen_lines += 1
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            check.problems.append(f"{name}:{number}: invalid JSON ({exc.msg} at column {exc.colno}); write one "
                                  "complete JSON object per line")
            continue
        check_line(obj, ctx, number)
    check.problems += unreadable
    if seen_lines == 0 and not unreadable and not not_utf8:
        check.problems.append(f"{check.flag} {spec.path}: manifest has no samples; check the file or drop this manifest")


def repeated_ids(hashes: np.ndarray, ids: StringPool) -> tuple[int, int]:
    """(how many samples repeat the id of an earlier sample, the first of them or -1), found from each id's
    hash without a set of every id: only ids that share a hash are compared as strings."""
    order = np.argsort(hashes, kind="stable")  # equal hashes form one run, in sample order
    ordered = hashes[order]
    count, first = 0, -1
    runs: dict[int, set[str]] = {}
    for k in (np.flatnonzero(ordered[1:] == ordered[:-1]) + 1).tolist():
        group = runs.get(int(ordered[k]))
        if group is None:  # k is the second member of its run
            group = runs[int(ordered[k])] = {ids[int(order[k - 1])]}
        index = int(order[k])
        if ids[index] in group:
            count, first = count + 1, index if first < 0 else min(first, index)
        else:
            group.add(ids[index])
    return count, first


def warn_duplicate_ids(table: SampleTable, duplicates: tuple[int, int]) -> None:
    count, first = duplicates
    if count:
        logger.warning(
            "%d samples repeat an id already used by an earlier sample (first at %s, id %r); "
            "unique ids make logs and per-sample errors unambiguous",
            count,
            table.source(first),
            table.ids[first],
        )


@dataclass
class Validated:
    table: SampleTable
    duplicates: tuple[int, int]
    folders: dict[str, np.ndarray]


def validate_manifests(specs: Sequence[ManifestSpec], limits: DataLimits, flag: str) -> Validated:
    """Parse and validate all manifests (warning of repeated ids); one ManifestError lists every problem."""
    check = Validator(limits=limits, flag=flag)
    if not specs:
        check.problems.append(f"{flag}: no manifest given; pass at least one PATH or PATH::LANG")
    for spec in specs:
        _load_one(spec, check)
    if check.problems:
        raise ManifestError(check.problems)
    if check.dropped_ids and limits.forms.dropped_note:  # once, when the manifests are checked
        note = limits.forms.dropped_note.format(samples=check.samples_with_dropped, ids=check.dropped_ids)
        first, *more = note.splitlines()  # a log line each
        logger.info("%s: %s", flag, first)
        for line in more:
            logger.info("%s", line)
    table = check.table.build()
    duplicates = repeated_ids(np.frombuffer(check.table.id_hashes, dtype=np.int64), table.ids)
    warn_duplicate_ids(table, duplicates)
    folders = check.folders.arrays(table.folders.strings(), check.table.file_index)
    return Validated(table, duplicates, folders)


def load_manifests(
    specs: Sequence[ManifestSpec], limits: DataLimits, *, flag: str = "--train-manifest"
) -> SampleTable:
    return validate_manifests(specs, limits, flag).table


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
