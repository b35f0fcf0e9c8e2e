"""What changed in the training manifests since the run last started, for a resume refused on the data change.

The checkpoint records the manifests' sha256 only; two digests say that something changed, not what. The
run's validated-manifest cache (trainers.data.manifest_cache) still holds the samples of its last start
(a refused start writes nothing), with that sha256 in its header: when it matches the checkpoint's, the
samples then and now are compared by (id, text and code lengths, codes file name), and the lines removed,
added and changed are counted with examples, from the manifests as they were and as they are. Cost, on a
refused or allowed data change only: one pass over both tables, no file read but the cache.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from trainers.data.sample_table import SampleTable
from trainers.data.table_file import TableFileError, map_file

SHOWN = 3  # examples per kind of change

Signature = tuple[bytes, int, int, bytes]


def saved_samples(cache: Path, fingerprint: str) -> SampleTable | None:
    """The samples of the run's last start, if its cache holds the manifests of `fingerprint`."""
    try:
        header, table, _ = map_file(cache, verify=True)
    except (OSError, TableFileError):
        return None
    meta = header.get("meta")
    return table if isinstance(meta, dict) and meta.get("fingerprint") == fingerprint else None


def _signatures(table: SampleTable) -> list[Signature]:
    return list(zip(table.ids.as_bytes(), table.text_len.tolist(), table.code_len.tolist(),
                    table.files.as_bytes(table.arrays["codes"].tolist())))


def _unmatched(signatures: list[Signature], other: list[Signature]) -> list[int]:
    """Indices of `signatures` left over once each is paired with an equal one of `other`."""
    left = Counter(other)
    unmatched = []
    for i, s in enumerate(signatures):
        if left[s]:
            left[s] -= 1
        else:
            unmatched.append(i)
    return unmatched


def _examples(table: SampleTable, indices: list[int]) -> list[str]:
    """A line each, under the line that counts them."""
    shown = [f"    {table.source(i)} (id {table.ids[i]!r})" for i in indices[:SHOWN]]
    return shown + (["    ..."] if len(indices) > SHOWN else [])


def _lines(count: int) -> str:
    return f"{count} line" + ("" if count == 1 else "s")


def describe_changes(before: SampleTable, now: SampleTable) -> list[str]:
    """Lines saying how the samples `now` differ from `before` (the manifests as they were at the last start)."""
    old, new = _signatures(before), _signatures(now)
    removed, added = _unmatched(old, new), _unmatched(new, old)
    new_ids = {new[i][0] for i in added}
    changed = [i for i in removed if old[i][0] in new_ids]
    changed_ids = {old[i][0] for i in changed}
    removed = [i for i in removed if old[i][0] not in changed_ids]
    added = [i for i in added if new[i][0] not in changed_ids]
    lines = [f"the training manifests changed since the checkpoint: {len(before)} samples then, {len(now)} now"]
    if removed:
        lines += [f"  {_lines(len(removed))} removed (line numbers as they were), e.g.", *_examples(before, removed)]
    if added:
        lines += [f"  {_lines(len(added))} added, e.g.", *_examples(now, added)]
    if changed:
        lines += [f"  {_lines(len(changed))} changed (same id, other lengths or codes file), e.g.",
                  *_examples(before, changed)]
    if not (removed or added or changed):
        lines.append("  the same samples (ids, lengths, codes files), in another order or with other fields "
                     "(speaker, language, paths): the data order numbers samples by their place")
    return lines


def consequence(step: int, epoch: int) -> list[str]:
    """What continuing with the changed data (--allow-config-change) means for exactness."""
    return [f"continuing (--allow-config-change) trains from step {step} on today's samples:",
            f"the rest of epoch {epoch} is drawn anew over them (a sample may be trained twice or not at all)",
            "and every later epoch differs: the run equals no uninterrupted run on either manifest"]
