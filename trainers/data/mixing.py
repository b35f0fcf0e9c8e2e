"""Replay mixing: training manifests that take a fixed share of every optimizer step.

`--train-manifest F::LANG@SHARE` makes F a *replay* manifest; manifests without a share are the
*target* manifests (the new language). With effective batch E:

* A full step takes r = round(SHARE x E) samples from each replay manifest: the nearest whole
  number, halves rounded up, computed exactly from the decimal written (0.25 x 10 = 2.5 -> 3, with
  no float error deciding a half). The target manifests fill the rest, T = E - sum of the r's.
* The epoch is the target's: the data order (grouped or random, `--train-samples`) numbers the
  target samples only, each step takes the next T of them, and an epoch ends when every target
  sample was trained once (ceil(N_target / T) steps). Its last, shorter step of t < T target
  samples takes round(r x t / T) from each replay manifest (halves up), so the shares hold there too.
* A replay manifest is drawn in cycles: cycle c is a permutation of its samples keyed by (seed,
  the manifest's place among the --train-manifest flags, c), and the draws walk through cycle
  after cycle. No sample is drawn twice before all of its manifest's samples were drawn, and where a
  replay manifest stands is one count (saved in the checkpoint's data section), independent of the
  target's epochs. A manifest with fewer than 2 x r samples can give one sample twice in the step that
  straddles two cycles; one with fewer than r cannot fill its share and is refused.
* A step's samples: the target's, then each replay manifest's, in flag order; in the grouped order the
  whole step is then sorted longest first. Only then is the step cut into micro-batches, and under
  torchrun shared between processes, so which samples make a step depends on (seed, E, the shares,
  the position) only: never on the micro-batch, the process count or a resume.

Refused before anything is written (exit 2, naming the flag): a share that is not a number in (0, 1),
shares that sum to 1 or more or round to leave no target sample, a share that rounds to 0 samples, a
share without ::LANG, all manifests with a share, a replay manifest given twice or smaller than its
share of a step, and a replay manifest whose language the validation does not measure (its forgetting
could not be seen).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence

import numpy as np

from trainers.config.manifest_flags import ManifestFlag, manifest_flag
from trainers.data.manifest import parse_manifest_spec
from trainers.data.sample_table import SampleTable
from trainers.errors import UserError

FLAG = "--train-manifest"
_REPLAY_KEY = 0x4E9A7  # keys the replay cycles apart from every epoch order and the training subset
_LOOKS_LIKE_A_SHARE = re.compile(r"@[-+]?[0-9.][0-9.eE+-]*$")


def _fraction(text: str) -> Fraction | None:
    try:
        return Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        return None


def share_problems(specs: Sequence[str]) -> list[str]:
    """What is wrong with the shares of --train-manifest values, one message each (checked before any file is read)."""
    problems = []
    parsed = [manifest_flag(s) for s in specs]
    for one in parsed:
        if one.share is None:
            if one.lang is None and _LOOKS_LIKE_A_SHARE.search(one.given) and not os.path.exists(one.given):
                problems.append(f"{FLAG} {one.given}: a share follows the language: write PATH::LANG@SHARE (e.g. "
                                f"data/zh.jsonl::zh@0.2); a replay manifest needs its language for validation")
            continue
        if not one.lang.strip():
            problems.append(f"{FLAG} {one.given}: no language before '@{one.share}'; write PATH::LANG@SHARE")
        share = _fraction(one.share)
        if share is None:
            problems.append(f"{FLAG} {one.given}: the share {one.share!r} is not a number; write a fraction of each "
                            "step between 0 and 1, e.g. @0.2")
        elif not 0 < share < 1:
            problems.append(f"{FLAG} {one.given}: the share {one.share} must be > 0 and < 1 (the fraction of each "
                            "step's samples drawn from this manifest)")
    shares = [s for s in (_fraction(p.share) for p in parsed if p.share is not None) if s is not None]
    if shares and all(p.share is not None for p in parsed):
        problems.append(f"{FLAG}: every manifest has a share, so none sets the epoch; give the new language's "
                        "manifest(s) without @SHARE (they fill the rest of each step)")
    elif shares and all(0 < s < 1 for s in shares) and sum(shares) >= 1:
        problems.append(f"{FLAG}: the shares sum to {float(sum(shares)):g}, leaving no room for the target "
                        "manifest(s) without a share; keep their sum below 1")
    paths = [p.path for p in parsed]
    for path in sorted({p.path for p in parsed if p.share is not None and paths.count(p.path) > 1}):
        problems.append(f"{FLAG} {path}: a replay manifest is given twice; give each manifest once")
    return problems


def samples_per_step(share: Fraction, effective_batch: int) -> int:
    """share x effective batch, to the nearest whole sample, halves up: exact, from the decimal written."""
    return int(share * effective_batch + Fraction(1, 2))


@functools.lru_cache(maxsize=8)
def _cycle(seed: int, manifest: int, cycle: int, size: int) -> np.ndarray:
    order = np.random.Generator(np.random.PCG64([seed, _REPLAY_KEY, manifest, cycle])).permutation(size)
    order.setflags(write=False)
    return order


@dataclass(frozen=True)
class Replay:
    """A replay manifest: its place among the --train-manifest flags, its share and its samples (table rows)."""

    manifest: int
    given: str
    share: Fraction
    per_step: int  # samples of a full step
    languages: tuple[str, ...]
    members: np.ndarray = field(compare=False, repr=False)

    def take(self, seed: int, position: int, count: int) -> np.ndarray:
        """The `count` samples after the first `position` drawn from this manifest (cycle after cycle)."""
        size, parts = len(self.members), []
        while count > 0:
            cycle, offset = divmod(position, size)
            part = _cycle(seed, self.manifest, cycle, size)[offset: offset + count]
            parts.append(part)
            position, count = position + len(part), count - len(part)
        return self.members[np.concatenate(parts)] if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Mixing:
    """The replay manifests of a run and the target samples (table rows) that make its epochs."""

    effective_batch: int
    target: np.ndarray = field(compare=False, repr=False)
    replays: tuple[Replay, ...]

    @property
    def target_per_step(self) -> int:
        return self.effective_batch - sum(r.per_step for r in self.replays)

    @property
    def languages(self) -> tuple[str, ...]:
        """The replayed languages (the base languages the forgetting guard watches unless --base-language)."""
        return tuple(dict.fromkeys(lang for r in self.replays for lang in r.languages))

    def counts(self, targets: int, full: int) -> tuple[int, ...]:
        """Samples of each replay manifest in a step with `targets` target samples, of `full` in a full step:
        round(per_step x targets / full), halves up, in integers (so per_step itself in a full step)."""
        return tuple((2 * r.per_step * targets + full) // (2 * full) for r in self.replays)

    def describe(self) -> str:
        """The shares as the run's fingerprint records them: manifest place, language, share (paths left out)."""
        return "; ".join(f"{r.manifest}::{','.join(r.languages)}@{r.share}" for r in self.replays)

    def summary(self) -> str:
        given = [manifest_flag(r.given) for r in self.replays]
        parts = [f"{g.lang}@{g.share}: {r.per_step} of {len(r.members)} samples" for g, r in zip(given, self.replays)]
        return (f"replay per step of {self.effective_batch}: {', '.join(parts)}; target manifests: "
                f"{self.target_per_step} of {len(self.target)} samples")


def _rows_by_flag(parsed: Sequence[ManifestFlag], table: SampleTable) -> np.ndarray:
    """Each training sample's --train-manifest index for replay manifests, -1 for target samples. The table
    numbers manifests by name, in order of first appearance; a replay manifest's name is given once."""
    pool = {name: i for i, name in enumerate(table.manifest_names)}
    flag_of_pool = np.full(len(pool), -1, dtype=np.int64)
    for k, one in enumerate(parsed):
        if one.share is not None:
            flag_of_pool[pool[str(parse_manifest_spec(one.given).path)]] = k
    return flag_of_pool[table.arrays["manifest"]]


def build_mixing(specs: Sequence[str], table: SampleTable, effective_batch: int, validated: Sequence[str],
                 val_count: int) -> Mixing | None:
    """The run's mixing (None without shares); UserError listing every share that cannot be met.

    table: the training samples of `specs` in order; validated: the languages among the first `val_count`
    validation samples ("" for none), what validation measures.
    """
    parsed = [manifest_flag(s) for s in specs]  # their shares are numbers in (0, 1): share_problems checked them
    if all(p.share is None for p in parsed):
        return None
    manifest_of_row = _rows_by_flag(parsed, table)
    codes = table.arrays["lang"]
    problems, replays = [], []
    for k, one in enumerate(parsed):
        if one.share is None:
            continue
        rows, share = np.flatnonzero(manifest_of_row == k), Fraction(one.share)
        per_step = samples_per_step(share, effective_batch)
        langs = tuple(sorted("" if c < 0 else table.lang_names[c] for c in np.unique(codes[rows])))
        if per_step == 0:
            problems.append(f"{FLAG} {one.given}: {share} x effective batch {effective_batch} = "
                            f"{float(share * effective_batch):g} samples, which rounds to 0 per step; raise the "
                            f"share to at least {float(Fraction(1, 2 * effective_batch)):g} or the effective batch")
        elif len(rows) < per_step:
            problems.append(f"{FLAG} {one.given}: its share is {per_step} samples of each step of {effective_batch}, "
                            f"but the manifest holds {len(rows)}; lower the share to at most "
                            f"{float(Fraction(2 * len(rows) - 1, 2 * effective_batch)):g} or add samples")
        missing = [lang or "(none)" for lang in langs if lang not in validated]
        if missing:
            measured = ", ".join(lang or "(none)" for lang in validated) or "none: no --val-manifest"
            problems.append(f"{FLAG} {one.given}: replays language {', '.join(missing)}, which the validation does not "
                            f"measure (its languages among the {val_count} samples validated: {measured}); add "
                            "--val-manifest V::LANG with held-out samples of it (or raise --max-val-batches), or the "
                            "forgetting cannot be seen")
        replays.append(Replay(k, one.given, share, per_step, langs, rows))
    target = np.flatnonzero(manifest_of_row < 0)
    mixing = Mixing(effective_batch, target, tuple(replays))
    if not problems and mixing.target_per_step < 1:
        problems.append(f"{FLAG}: the shares take {effective_batch - mixing.target_per_step} of the "
                        f"{effective_batch} samples of each step, leaving none for the target manifest(s); lower "
                        "them or raise --effective-batch")
    if problems:
        raise UserError("\n".join([*problems, "nothing was written; fix these shares"]))
    return mixing
