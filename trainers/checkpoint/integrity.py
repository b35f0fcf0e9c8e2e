"""Checksums of a checkpoint's content, so that a damaged file is refused instead of changing the result.

torch's zip reader does not check the CRCs of the records it reads, and `weights_only=True` only
restricts which types the pickle may build: a flipped byte in tensor data, or an edited `step`,
loads silently. The schema therefore stores, in the file itself, a record of what it wrote:

    "integrity": {"algorithm": "sha256",
                  "tensors": {"model/gpt.h.0.attn.c_attn.weight": hex, "optim/optimizer/state/0/exp_avg": hex, ...},
                  "fields":  {"format": hex, "progress/": hex, "progress/step": hex, "run/config": hex, ...}}

* one digest per tensor, wherever it sits (every section, nested at any depth), named by its
  path of keys; it covers the dtype, the shape and the values (the tensor's own elements in
  row-major order, not the storage it may share with others), so a tensor that changed dtype or
  shape is caught as well as one that changed a value;
* one digest per field of each section (`progress/step`, `data/epoch`, `rng/python`, ...) over a
  canonical encoding of its value (types kept apart: 1, 1.0 and True differ; floats bit-exact;
  dict keys sorted; tensors inside stand as a placeholder, their values being covered above),
  plus one per section over its key names (`progress/`), so an added or removed key is caught;
* every top-level key except the record itself is covered, including `format`.

The record is plain strings in dicts, so `torch.load(weights_only=True)` still reads the file and
upstream inference still takes its "model" key. Checking recomputes the same digests from the
loaded content and names what differs. Tensors are hashed in threads (hashlib releases the GIL
for large buffers): about 2 GB/s per core with SHA-NI.
"""
from __future__ import annotations

import hashlib
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import torch

ALGORITHM = "sha256"
RECORD_KEY = "integrity"
MAX_WORKERS = 8
MAX_LISTED = 5  # problems named in one message


def compute(content: Mapping[str, Any]) -> dict[str, Any]:
    """The integrity record of a checkpoint's content (every top-level key but the record's own)."""
    tensors, fields = _collect(content)
    return {"algorithm": ALGORITHM, "tensors": _hash_tensors(tensors), "fields": fields}


def problems(content: Mapping[str, Any], record: Any) -> list[str]:
    """What in `content` does not match `record` ([] when everything does), in words."""
    if record is None:
        return [f"the {RECORD_KEY!r} section with the checksums is missing"]
    if not _well_formed(record):
        return [f"the {RECORD_KEY!r} section with the checksums is malformed"]
    if record["algorithm"] != ALGORITHM:
        return [f"the integrity record uses algorithm {record['algorithm']!r}, which this trainer does not know"]
    tensors, fields = _collect(content)
    found = _compare("field", record["fields"], fields)
    return found + _compare("tensor", record["tensors"], _hash_tensors(tensors))


def fields_digest(content: Mapping[str, Any]) -> str:
    """One sha256 over the digests of every field (tensors left out, so nothing large is read): which state a
    checkpoint holds, for a record that must name it (a step, its history, RNG and data position)."""
    _, fields = _collect(content)
    return _digest("".join(f"{name}={fields[name]};" for name in sorted(fields)).encode())


def summary(found: list[str]) -> str:
    listed = "; ".join(found[:MAX_LISTED])
    more = f"; and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
    return listed + more


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 over the dtype, the shape and the tensor's values in row-major order."""
    h = hashlib.new(ALGORITHM)
    h.update(f"{t.dtype}{list(t.shape)}".encode())
    h.update(_tensor_bytes(t))  # empty for a tensor without elements: the digest of its dtype and shape alone
    return h.hexdigest()


def _well_formed(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("algorithm"), str)
            and all(isinstance(record.get(k), dict) and all(isinstance(x, str) for x in record[k].values())
                    for k in ("tensors", "fields")))


def _compare(kind: str, stored: Mapping[str, str], computed: Mapping[str, str]) -> list[str]:
    found = []
    for name in sorted(stored.keys() | computed.keys()):
        if name not in computed:
            found.append(f"{kind} {name} is missing")
        elif name not in stored:
            found.append(f"{kind} {name} is not covered by the checksums (added after the file was written)")
        elif stored[name] != computed[name]:
            found.append(f"{kind} {name} differs from what was written")
    return found


def _collect(content: Mapping[str, Any]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """(path, tensor) of every tensor, and the digest of every field."""
    tensors: list[tuple[str, torch.Tensor]] = []
    fields: dict[str, str] = {}

    def add(path: str, value: Any) -> None:
        """A tensor is hashed on its own; anything else is one field (tensors inside it still hashed apart)."""
        if isinstance(value, torch.Tensor):
            tensors.append((path, value))
        else:
            out = bytearray()
            _encode(value, path, out, tensors)
            fields[path] = _digest(bytes(out))

    for key, value in _sorted_items(content):
        if key == RECORD_KEY:
            continue
        name = _segment(key)
        if isinstance(value, Mapping):
            fields[f"{name}/"] = _digest(_encode_keys(value))
            for sub, item in _sorted_items(value):
                add(f"{name}/{_segment(sub)}", item)
        else:
            add(name, value)
    return tensors, fields


def _hash_tensors(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    unique: dict[str, torch.Tensor] = {}
    for path, t in tensors:  # keys that print alike (0 and "0") get distinct names, in a fixed order
        name, n = path, 1
        while name in unique:
            n += 1
            name = f"{path}~{n}"
        unique[name] = t
    workers = min(MAX_WORKERS, os.cpu_count() or 1)
    if workers <= 1 or len(unique) <= 1:
        return {name: tensor_digest(t) for name, t in unique.items()}
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="checkpoint-hash") as pool:
        # Largest first, so one big tensor at the end does not leave the other threads idle.
        order = sorted(unique.items(), key=lambda item: -item[1].numel() * item[1].element_size())
        digests = dict(zip((name for name, _ in order), pool.map(lambda item: tensor_digest(item[1]), order)))
    return {name: digests[name] for name in unique}


def _tensor_bytes(t: torch.Tensor) -> Any:
    """The tensor's values as a byte buffer, whatever its dtype, layout or device."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg().cpu()  # cpu(): the tensor itself where it is there already
    t = t.contiguous().reshape(-1)  # one dimension: 0-dim tensors cannot change element size by view
    return t.view(torch.uint8).numpy()


def _digest(data: bytes) -> str:
    return hashlib.new(ALGORITHM, data).hexdigest()


def _segment(key: Any) -> str:
    return key if isinstance(key, str) else repr(key)


def _sorted_items(mapping: Mapping[Any, Any]) -> Iterable[tuple[Any, Any]]:
    keyed = []
    for key, value in mapping.items():
        out = bytearray()
        _encode(key, "", out, [])
        keyed.append((bytes(out), key, value))
    keyed.sort(key=lambda item: item[0])
    return [(key, value) for _, key, value in keyed]


def _encode_keys(mapping: Mapping[Any, Any]) -> bytes:
    out = bytearray(b"K")
    for key, value in _sorted_items(mapping):
        _encode(key, "", out, [])
        out += b"T" if isinstance(value, torch.Tensor) else b"V"
    return bytes(out)


def _encode(value: Any, path: str, out: bytearray, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Append a canonical, type-tagged encoding of `value`; tensors are collected, not encoded."""
    if isinstance(value, torch.Tensor):
        tensors.append((path, value))
        out += b"T"
    elif value is None:
        out += b"N"
    elif isinstance(value, bool):  # before int: bool is an int subclass
        out += b"B1" if value else b"B0"
    elif isinstance(value, int):
        text = str(value).encode()
        out += b"I" + _length(text) + text
    elif isinstance(value, float):
        out += b"F" + struct.pack("<d", value) if not math.isnan(value) else b"Fnan"
    elif isinstance(value, str):
        text = value.encode("utf-8", "surrogatepass")
        out += b"S" + _length(text) + text
    elif isinstance(value, (bytes, bytearray)):
        out += b"Y" + _length(value) + bytes(value)
    elif isinstance(value, Mapping):
        out += b"D" + _length(value)
        for key, item in _sorted_items(value):
            _encode(key, "", out, [])
            _encode(item, f"{path}/{_segment(key)}", out, tensors)
    elif isinstance(value, (list, tuple)):  # torch.Size too; a list and a tuple of the same items do not differ
        out += b"L" + _length(value)
        for i, item in enumerate(value):
            _encode(item, f"{path}/{i}", out, tensors)
    else:  # torch.dtype, torch.device, and anything else weights_only allows: its type and repr
        text = f"{type(value).__module__}.{type(value).__qualname__}:{value!r}".encode()
        out += b"O" + _length(text) + text


def _length(value: Any) -> bytes:
    return struct.pack("<Q", len(value))
