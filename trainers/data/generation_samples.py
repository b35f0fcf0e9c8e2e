"""Which validation samples are generated at each validation: a few per language, fixed for the run.

The choice is a pure function of the validation set's sample ids (with their languages) and a seed.
Each id gets a rank, the blake2b digest of (seed, id); each language takes its lowest-ranked ids.
Nothing else enters: not the order the manifests list the samples in, not the table's row numbers,
batch sizes, the number of torchrun processes or the device. So a resume, another machine or another
micro-batch size generates the same samples, and adding a sample to the validation set changes the
choice only where the new id ranks among the chosen.

It is chosen from the whole validation set, not from the --max-val-batches prefix that teacher-forced
validation reads: that prefix's length follows the validation batch size, which the micro-batch
probe may set from the hardware.

Bounds: at most `per_language` samples of each language and `max_total` in all. Languages take turns
(every language gets its first sample before any gets its second), in name order, samples without a
language (one group, None) last; with more languages than `max_total`, the last ones in that order get
none and are named in `left_out` for the caller's warning. An id that appears twice (the manifest check
warns of it) is one candidate, its first row.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from trainers.data.sample_table import SampleTable

PER_LANGUAGE = 4  # defaults: a few per language, a bounded total per validation
MAX_TOTAL = 32


@dataclass(frozen=True)
class GenerationSamples:
    """The chosen samples, grouped by language (in turn order), each group in rank order."""

    indices: tuple[int, ...]  # rows of the table the choice was made from
    ids: tuple[str, ...]
    languages: tuple[str | None, ...]
    left_out: tuple[str | None, ...] = ()  # languages with no sample in the set (max_total too small)


def id_rank(seed: int, sample_id: str) -> bytes:
    """The sort key of one id under `seed`: the same in every process, Python version and machine
    (unlike hash(), which Python salts per process)."""
    text = f"{seed}\n{sample_id}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(text, digest_size=8, person=b"gen-pick").digest()


def choose(ids: Sequence[str], languages: Sequence[str | None], seed: int, per_language: int = PER_LANGUAGE,
           max_total: int = MAX_TOTAL) -> tuple[list[int], list[str | None]]:
    """Positions in `ids` of the chosen samples (grouped by language, each in rank order), and the
    languages left out by `max_total`. See the module docstring for the rule."""
    if per_language < 1 or max_total < 1:
        raise ValueError(f"per_language and max_total must be >= 1, got {per_language} and {max_total}")
    first: dict[str, int] = {}
    for position, sample_id in enumerate(ids):
        first.setdefault(sample_id, position)
    groups: dict[str | None, list[tuple[bytes, str, int]]] = {}
    for sample_id, position in first.items():
        groups.setdefault(languages[position], []).append((id_rank(seed, sample_id), sample_id, position))
    order = sorted(lang for lang in groups if lang is not None) + ([None] if None in groups else [])
    ranked = {lang: [p for _, _, p in sorted(groups[lang])[:per_language]] for lang in order}
    taken: dict[str | None, list[int]] = {lang: [] for lang in order}
    total = 0
    for turn in range(per_language):
        for lang in order:
            if total < max_total and turn < len(ranked[lang]):
                taken[lang].append(ranked[lang][turn])
                total += 1
    chosen = [p for lang in order for p in taken[lang]]
    return chosen, [lang for lang in order if not taken[lang]]


def generation_samples(table: SampleTable, seed: int, per_language: int = PER_LANGUAGE,
                       max_total: int = MAX_TOTAL) -> GenerationSamples:
    """The samples of the validation table to generate at every validation of a run seeded `seed`."""
    ids = table.ids.strings()
    # Each row's language (None: the line had none), without making a Sample per row.
    languages = [table.lang_names[k] if k >= 0 else None for k in table.arrays["lang"].tolist()]
    chosen, left_out = choose(ids, languages, seed, per_language, max_total)
    return GenerationSamples(indices=tuple(chosen), ids=tuple(ids[p] for p in chosen),
                             languages=tuple(languages[p] for p in chosen), left_out=tuple(left_out))
