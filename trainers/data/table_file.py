"""A SampleTable in one file: a JSON header, then the arrays, each 64-byte aligned, read by memory map.

    magic (16 bytes) | header length (8 bytes, little endian) | header (JSON) | padding | arrays

The arrays are the table's and the caller's extras (int64). The header holds the format, the
caller's key and metadata, each array's dtype, shape and offset,
and the sha256 of everything after it. Reading checks all of it and the table's own consistency
(every index inside its pool, offsets in order), so a damaged, truncated or foreign file is
refused with the reason (TableFileError) and never used. Writing is atomic: a temporary file in
the same folder, fsynced, then renamed over the old one, so a reader (another process of a
torchrun job, a later resume) sees the old file or the new one, never a mix.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from trainers.data.sample_table import PATH_ROLES, POOLS, SAMPLE_COLUMNS, SampleTable

MAGIC = b"IDXTTS2-SAMPLES\x01"
FORMAT = 1
_ALIGN = 64
_LENGTH_BYTES = 8
_DTYPES = {**{c: "<i4" for c in SAMPLE_COLUMNS}, "file_folder": "<i4",
           **{f"{p}_data": "|u1" for p in POOLS}, **{f"{p}_offsets": "<i8" for p in POOLS}}


class TableFileError(ValueError):
    """The file is not an intact table file of this format: why, in words."""


def write_table(path: Path, table: SampleTable, key: str, meta: dict[str, Any],
                extras: dict[str, np.ndarray] | None = None) -> None:
    """Write `table`, `extras` (1-D int64 arrays), `key` and JSON-able `meta` to `path`, atomically."""
    arrays, entries, offset = [], [], 0
    named = {**{n: (table.arrays[n], d) for n, d in _DTYPES.items()}, **{n: (a, "<i8") for n, a in (extras or {}).items()}}
    for name, (values, dtype) in named.items():
        a = np.ascontiguousarray(values, dtype=dtype)
        entries.append([name, a.dtype.str, list(a.shape), offset])
        arrays.append(a)
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    padded = [part for a in arrays for part in (memoryview(a).cast("B"), bytes(-a.nbytes % _ALIGN))]
    body = hashlib.sha256()
    for part in padded:
        body.update(part)
    header = json.dumps({"format": FORMAT, "key": key, "meta": meta, "arrays": entries, "body_bytes": offset,
                         "body_sha256": body.hexdigest()}).encode()
    head = MAGIC + len(header).to_bytes(_LENGTH_BYTES, "little") + header
    head += bytes(-len(head) % _ALIGN)
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(head)
        f.writelines(padded)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header and where the arrays start; raises OSError or TableFileError."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + _LENGTH_BYTES)
        if len(start) < len(MAGIC) + _LENGTH_BYTES or start[:len(MAGIC)] != MAGIC:
            raise TableFileError("not a sample table file of this trainer (wrong magic bytes)")
        length = int.from_bytes(start[len(MAGIC):], "little")
        if length > 1 << 24:
            raise TableFileError(f"header length {length} is not plausible")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TableFileError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TableFileError(f"format {header.get('format') if isinstance(header, dict) else '?'}, this trainer "
                             f"reads format {FORMAT}")
    body = len(MAGIC) + _LENGTH_BYTES + length
    return header, body + (-body % _ALIGN)


def map_table(path: Path) -> SampleTable:
    """The table in `path`, mapped read-only (how a spawned loader worker gets its parent's table)."""
    return map_file(path)[1]


def map_file(path: Path, verify: bool = False,
             extras: tuple[str, ...] = ()) -> tuple[dict[str, Any], SampleTable, dict[str, np.ndarray]]:
    """The header, the table and the named extras in `path`, the arrays mapped read-only from the file
    (so every process mapping it shares the same pages).

    verify: check the body checksum and the table's consistency first (TableFileError if either fails).
    """
    header, body = read_header(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = header.get("body_bytes")
    if not isinstance(size, int) or len(mapped) != body + size:
        raise TableFileError(f"{len(mapped)} bytes, the header describes {body + size if isinstance(size, int) else '?'}"
                             " (truncated or appended to)")
    if verify and hashlib.sha256(memoryview(mapped)[body:]).hexdigest() != header.get("body_sha256"):
        raise TableFileError("its contents do not match their checksum (damaged)")
    arrays = _arrays(mapped, body, header, {**_DTYPES, **{n: "<i8" for n in extras}})
    table = SampleTable({n: arrays[n] for n in _DTYPES}, backing=Path(path), reopen=map_table)
    if verify:
        check_consistent(table)
    return header, table, {n: arrays[n] for n in extras}


def _arrays(mapped: mmap.mmap, body: int, header: dict[str, Any], dtypes: dict[str, str]) -> dict[str, np.ndarray]:
    entries = {e[0]: e for e in header.get("arrays", []) if isinstance(e, list) and len(e) == 4}
    arrays = {}
    for name, dtype in dtypes.items():
        if name not in entries:
            raise TableFileError(f"array {name} is missing")
        _, stored, shape, start = entries[name]
        if stored != np.dtype(dtype).str or not (isinstance(shape, list) and len(shape) == 1):
            raise TableFileError(f"array {name} has dtype {stored} shape {shape}")
        count = shape[0]
        inside = isinstance(count, int) and isinstance(start, int) and count >= 0 and start >= 0
        if not inside or body + start + count * np.dtype(dtype).itemsize > len(mapped):
            raise TableFileError(f"array {name} lies outside the file")
        arrays[name] = np.frombuffer(mapped, dtype=dtype, count=count, offset=body + start)
    return arrays


def check_consistent(table: SampleTable) -> None:
    """Every index inside its pool and every pool's offsets in order: what indexing the table relies on."""
    a, n = table.arrays, len(table.arrays["line"])
    problems = [f"column {c} has {len(a[c])} rows, not {n}" for c in SAMPLE_COLUMNS if len(a[c]) != n]
    for pool in POOLS:
        data, offsets = a[f"{pool}_data"], a[f"{pool}_offsets"]
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(data) or np.any(np.diff(offsets) < 0):
            problems.append(f"pool {pool} has offsets out of order")
    sizes = {"manifest": len(table.manifest_names), "lang": len(table.lang_names), "speaker": len(table.speakers)}
    sizes.update({role: len(table.files) for role in PATH_ROLES})
    lowest = {"manifest": 0, **{role: 0 for role in PATH_ROLES}, "lang": -1, "speaker": -1}
    for column, size in sizes.items():
        values = a[column]
        if n and (values.min() < lowest[column] or values.max() >= size):
            problems.append(f"column {column} points outside its pool of {size}")
    if len(table.ids) != n or len(a["file_folder"]) != len(table.files):
        problems.append("the id or file pool does not match the table")
    elif len(table.files) and (a["file_folder"].min() < 0 or a["file_folder"].max() >= len(table.folders)):
        problems.append("a file points outside the folder pool")
    if n and (a["text_len"].min() < 1 or a["code_len"].min() < 1):
        problems.append("a sample has an empty text or code sequence")
    if problems:
        raise TableFileError("; ".join(problems))
