"""Comparing a checkpoint's text rows with the base checkpoint it started from (tools/inspect_checkpoint.py --base).

Row layout (see trainers/model/weights.py): a file with Nt text tokens has Nt+1 text rows, the
last being an extra row no token id reaches. A vocabulary extended from Nb to N tokens keeps
rows 0..Nb-1, puts new pieces at Nb..N-1 and moves the extra row (base row Nb) to row N.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainers.checkpoint import schema
from trainers.errors import UserError
from trainers.model.weights import TEXT_ROW_KEYS

# Rows per float64 chunk: bounds memory (about 40 MB at width 1280) while staying vectorised.
ROW_CHUNK = 4096


@dataclass
class LoadedFile:
    path: Path
    kind: str                      # "trainer", "official" ({"model": sd}) or "raw" (a bare sd)
    state: dict[str, torch.Tensor]
    checkpoint: schema.Checkpoint | None = None  # for trainer checkpoints
    stripped_prefix: bool = False


def compare_with_base(ck: LoadedFile, base: LoadedFile) -> dict[str, Any]:
    check_compatible(ck, base)
    nb = base.state["text_embedding.weight"].shape[0] - 1
    drift: dict[str, Any] = {}
    changed = torch.zeros(nb + 1, dtype=torch.bool)
    max_diff, same_dtype = 0.0, True
    for key in TEXT_ROW_KEYS:
        missing = [name for name, f in (("checkpoint", ck), ("base", base)) if key not in f.state]
        if missing:
            drift[key] = {"skipped": f"not in the {' or '.join(missing)}"}
            continue
        drift[key], rows_changed = row_drift(ck.state[key], base.state[key])
        changed |= rows_changed
        key_max = drift[key]["max_abs_diff"]
        max_diff = max(max_diff, key_max) if not math.isnan(key_max) else key_max
        same_dtype &= ck.state[key].dtype == base.state[key].dtype
    rows_changed = int(changed.sum())
    return {
        "base": str(base.path),
        "base_text_tokens_in_base_file": nb,
        "drift": drift,
        "base_rows_unchanged": rows_changed == 0,
        "base_rows_changed": rows_changed,
        "base_rows_max_abs_diff": max_diff,
        "base_rows_same_dtype": same_dtype,
        "other_tensors": other_tensor_changes(ck.state, base.state),
        "notes": base_notes(ck, nb),
    }


def check_compatible(ck: LoadedFile, base: LoadedFile) -> None:
    for key in TEXT_ROW_KEYS:
        if key not in ck.state or key not in base.state:
            continue
        a, b = ck.state[key], base.state[key]
        if a.shape[1:] != b.shape[1:]:
            raise UserError(f"--base {base.path}: {key} has shape {tuple(b.shape)} but {ck.path} has "
                            f"{tuple(a.shape)} (different width); pass the base checkpoint of the same model size")
        if a.shape[0] < b.shape[0]:
            raise UserError(f"{ck.path} has {a.shape[0] - 1} text tokens in {key} but --base {base.path} has "
                            f"{b.shape[0] - 1}; the base does not match this checkpoint, pass the gpt.pth "
                            "the run started from")


def row_drift(ck: torch.Tensor, base: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """Exact per-row comparison of the base rows; ck has N+1 rows, base Nb+1 rows, N >= Nb. The facts of one
    tensor, and which base rows (0..Nb) changed, for the union over the tensors."""
    nb, n = base.shape[0] - 1, ck.shape[0] - 1
    changed = torch.zeros(nb + 1, dtype=torch.bool)
    max_diff = 0.0
    # Rows 0..Nb-1 keep their ids; the extra row moved from Nb to N.
    spans = [(s, min(s + ROW_CHUNK, nb), s) for s in range(0, nb, ROW_CHUNK)] + [(n, n + 1, nb)]
    for start, stop, base_start in spans:
        rows_changed, chunk_max = compare_rows(ck[start:stop], base[base_start:base_start + stop - start])
        changed[base_start:base_start + stop - start] = rows_changed
        max_diff = chunk_max if math.isnan(chunk_max) else max(max_diff, chunk_max)
    new = ck[nb:n]
    mean_abs = float(new.double().abs().mean()) if new.numel() else None
    facts = {"max_abs_diff": max_diff, "rows_changed": int(changed.sum()), "rows_compared": nb + 1,
             "new_rows": n - nb, "new_rows_mean_abs": mean_abs}
    return facts, changed


def compare_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(row changed?, max |a - b|) in float64, which holds every fp16/bf16/fp32 value exactly."""
    a64 = a.double().reshape(a.shape[0], -1)
    b64 = b.double().reshape(b.shape[0], -1)
    differs = (a64 != b64).any(dim=1)   # per-row torch.equal, vectorised
    diff = (a64 - b64).abs()
    return differs, float(diff.max()) if diff.numel() else 0.0


def other_tensor_changes(ck: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Overview of the non-text-row tensors: how many moved and the largest relative change."""
    common = sorted((set(ck) & set(base)) - set(TEXT_ROW_KEYS))
    comparable = [k for k in common if ck[k].shape == base[k].shape]
    differ, largest, largest_key = 0, 0.0, None
    for key in comparable:
        a, b = ck[key], base[key]
        if a.dtype == b.dtype and torch.equal(a, b):
            continue
        a64, b64 = a.double(), b.double()
        diff_norm = float(torch.linalg.vector_norm(a64 - b64))
        if diff_norm == 0.0:
            continue  # same values stored in another dtype
        differ += 1
        base_norm = float(torch.linalg.vector_norm(b64))
        if base_norm == 0.0:
            continue  # e.g. a bias that started at zero: any change is "infinitely" relative
        rel = diff_norm / base_norm
        if largest_key is None or rel > largest:
            largest, largest_key = rel, key
    return {
        "compared": len(comparable),
        "differ": differ,
        "largest_relative_change": largest if largest_key else 0.0,
        "largest_relative_change_key": largest_key,
        "only_in_checkpoint": len(set(ck) - set(base)),
        "only_in_base": len(set(base) - set(ck)),
        "shape_mismatches": len(common) - len(comparable),
    }


def base_notes(ck: LoadedFile, nb: int) -> list[str]:
    notes = []
    recorded = ck.checkpoint.base_text_tokens if ck.checkpoint else None
    if recorded is not None and int(recorded) != nb:
        # The row layout is then not the one compared here, so any drift verdict is suspect.
        notes.append(f"the checkpoint records base_text_tokens {recorded} but the base file has {nb} text tokens; "
                     "is this the base the run started from?")
    return notes


