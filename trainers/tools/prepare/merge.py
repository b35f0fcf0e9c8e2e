"""The end of a preparation: once every utterance of the list has a record (of any shard), one set of manifests.

Who merges: every process that finishes its share looks at all shards' records; the one that finds none missing
writes the manifests (the last shard to finish; two finishing together write the same bytes, one after the other,
under a lock). `--merge` does only this, e.g. after copying the shards' OUT folders together.

Written into OUT, each atomically, in the list's order: train_utterances.jsonl and val_utterances.jsonl (every kept
utterance, its own conditioning), train_pairs.jsonl and val_pairs.jsonl (each target with prompts of its speaker,
pairs.py), skipped.txt (every skipped line, `list:LINE: what; what to do`) and prepare_summary.json (the counts
the closing summary prints). The validation files are written only when utterances are held out; a validation
file of an earlier merge that holds none now is removed.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainers.tools.prepare.inputs import Entry, Listing, Problem
from trainers.tools.prepare.layouts import Layout
from trainers.tools.prepare.pairs import Utterance, draw_pairs, validation_ids
from trainers.tools.prepare.report import skipped_counts, skipped_text
from trainers.tools.prepare.settings import PrepareSettings
from trainers.tools.prepare.store import Store

MANIFESTS = ("train_pairs.jsonl", "val_pairs.jsonl", "train_utterances.jsonl", "val_utterances.jsonl")
SKIPPED_NAME = "skipped.txt"
SUMMARY_NAME = "prepare_summary.json"


@dataclass
class Merged:
    """What the merge wrote, for the closing summary."""

    kept: int
    hours: float
    problems: list[Problem]
    written: dict[str, int]  # manifest name -> lines
    speakers: int
    alone: list[str] = field(default_factory=list)  # one line per speaker left without a prompt
    converted: dict[str, Any] = field(default_factory=dict)
    temporaries: int = 0


def _source_order(problem: Problem) -> tuple[str, int, str]:
    name, _, line = problem.source.rpartition(":")
    return (name, int(line), "") if line.isdigit() else (problem.source, 0, "")


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def missing(store: Store, listing: Listing) -> tuple[list[Entry], dict[str, dict[str, Any]]]:
    """The entries no shard has recorded yet (as the line is now), and the records there are."""
    records = store.records({e.id: e.key() for e in listing.entries})
    return [e for e in listing.entries if e.id not in records], records


def merge(store: Store, listing: Listing, layout: Layout, settings: PrepareSettings) -> Merged | None:
    """Write the manifests if every entry has a record; None (nothing written) while some are missing."""
    store.state.mkdir(parents=True, exist_ok=True)
    lock = os.open(store.state / "merge.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second merger waits, then writes the same bytes again
        absent, records = missing(store, listing)
        if absent:
            return None
        return _write(store, listing, layout, settings, records)
    finally:
        os.close(lock)


def _write(store: Store, listing: Listing, layout: Layout, settings: PrepareSettings,
           records: dict[str, dict[str, Any]]) -> Merged:
    kept = [records[e.id] for e in listing.entries if records[e.id]["status"] == "kept"]
    problems = list(listing.problems) + [
        Problem(e.source, r["reason"], r["what"], r["todo"]) for e in listing.entries
        if (r := records[e.id])["status"] != "kept"]
    problems.sort(key=_source_order)
    held_out = validation_ids([r["id"] for r in kept], settings.val_fraction, settings.seed)
    train = [r for r in kept if r["id"] not in held_out]
    val = [r for r in kept if r["id"] in held_out]
    utterance = {r["id"]: Utterance(r["id"], r["speaker"], r["language"]) for r in kept}
    by_id = {r["id"]: r for r in kept}
    draw = dict(per_target=settings.pairs_per_target, cross_lingual=settings.cross_lingual, seed=settings.seed)
    train_pairing = draw_pairs([utterance[r["id"]] for r in train], [utterance[r["id"]] for r in train], **draw)
    val_pairing = draw_pairs([utterance[r["id"]] for r in val], list(utterance.values()), **draw)
    files = {
        "train_pairs.jsonl": [layout.pair(by_id[t.id], by_id[p.id]) for t, p in train_pairing.pairs],
        "train_utterances.jsonl": [layout.single(r) for r in train],
    }
    if val:
        files["val_pairs.jsonl"] = [layout.pair(by_id[t.id], by_id[p.id]) for t, p in val_pairing.pairs]
        files["val_utterances.jsonl"] = [layout.single(r) for r in val]
    for name, rows in files.items():
        store.write_file(store.out / name, _jsonl(rows), "manifest")
    for name in MANIFESTS:
        if name not in files and (store.out / name).is_file():
            (store.out / name).unlink()  # an earlier merge's validation file: no utterance is held out now
    store.write_file(store.out / SKIPPED_NAME, "".join(f"{p}\n" for p in problems).encode("utf-8"), "manifest")
    alone = []
    for pairing, split in ((train_pairing, "training"), (val_pairing, "validation")):
        for speaker, (ids, other_languages) in sorted(pairing.alone.items()):
            why = ("none other in its language (--cross-lingual)" if other_languages else
                   "none other among the training ones" if split == "training" else "none other")
            alone.append(f"speaker {speaker!r}: {len(ids)} {split} utterance(s) in no pair, no prompt "
                         f"({', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''}): {why}")
    resampled = [r for r in kept if r["source_rate"] != r["rate"]]
    converted = {"resampled": len(resampled), "from_rates": sorted({r["source_rate"] for r in resampled}),
                 "to_rate": resampled[0]["rate"] if resampled else None,
                 "mixed_to_mono": sum(r["source_channels"] > 1 for r in kept)}
    merged = Merged(len(kept), sum(r["seconds"] for r in kept) / 3600, problems,
                    {name: len(rows) for name, rows in files.items()}, len({r["speaker"] for r in kept}), alone,
                    converted)
    summary = {"kept": merged.kept, "hours": round(merged.hours, 4), "skipped": len(problems),
               "skipped_by_reason": skipped_counts(problems), "speakers": merged.speakers,
               "manifests": merged.written, "speakers_without_prompt": alone, "converted": converted,
               "manifest_settings": settings.manifest_settings()}
    store.write_file(store.out / SUMMARY_NAME, (json.dumps(summary, indent=1) + "\n").encode("utf-8"), "manifest")
    merged.temporaries = store.remove_temporaries()
    store.faults.at("merged")
    return merged


def summary_lines(merged: Merged, out: Path) -> list[str]:
    """The closing summary: hours kept, skipped by reason, conversions, pairs, the files written."""
    lines = [f"kept {merged.kept} utterances ({merged.hours:.2f} hours of audio) of {merged.speakers} speaker(s)"]
    if merged.problems:
        lines += textwrap.wrap(f"skipped {len(merged.problems)} lines (each in {SKIPPED_NAME}): "
                               f"{skipped_text(skipped_counts(merged.problems))}", 118, subsequent_indent="  ")
    c = merged.converted
    if c.get("resampled") or c.get("mixed_to_mono"):
        to = f"to {c['to_rate']} Hz " if c["to_rate"] else ""
        lines.append(f"converted: {c['resampled']} resampled {to}(from {', '.join(map(str, c['from_rates'])) or '-'} "
                     f"Hz), {c['mixed_to_mono']} mixed to mono")
    lines += merged.alone
    lines += [f"wrote {name}: {count} lines" for name, count in merged.written.items()]
    if merged.temporaries:
        lines.append(f"removed {merged.temporaries} temporary files of interrupted runs")
    return [re.sub(r"\s+", " ", line) for line in lines]
