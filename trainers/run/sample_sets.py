"""The codes generated at validations, kept under the run directory for listening later.

    RUN_DIR/samples/step_00000120.npz   one set per validation step: each sample's codes, id, language,
                                        stop flag and reference length, the generation settings and
                                        the gen/* metrics (numpy arrays and one JSON text; no pickle)

A set appears under its name only by an atomic rename of a complete, fsynced file (trainers.files), so
a kill mid-write leaves the complete set or none: at most a `.step_N.npz.tmp-PID` temporary, which the
listing ignores and `clean_temporaries` (the trainer, with the run locked) removes.

Bounded: after each write the newest `keep` sets up to the step just written are kept, with the sets of
the `protect` steps (the best checkpoint's); older ones are removed. Sets of later steps, left by a run
resumed from an earlier checkpoint, are left alone: the run replaces each when it reaches that step.
The folder holds no file a checkpoint tool counts (those are model_step*.pth, latest.pth and best.pth
in the run directory itself: trainers/checkpoint/step_files.py).
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from trainers.errors import UserError
from trainers.files import write_bytes_atomically

log = logging.getLogger("train")

SAMPLES_DIR = "samples"
FORMAT = 1
_SET_RE = re.compile(r"^step_([0-9]{8,})\.npz$")
_TEMP_RE = re.compile(r"^\.step_[0-9]{8,}\.npz\.tmp-[0-9]+$")


@dataclass(frozen=True)
class SampleSet:
    """One validation's generated samples, in the order they were chosen."""

    step: int
    ids: list[str]
    languages: list[str | None]
    codes: list[np.ndarray]  # per sample, int codes without the stop code
    stopped: list[bool]
    ref_lengths: list[int]
    settings: dict[str, Any] = field(default_factory=dict)  # how they were generated (greedy, max_codes...)
    metrics: dict[str, float] = field(default_factory=dict)  # gen/* of trainers.training.generation_metrics


def encode(sample_set: SampleSet) -> bytes:
    """The set as .npz bytes: the codes end to end with their offsets, the rest as arrays and JSON."""
    s = sample_set
    if not len(s.ids) == len(s.languages) == len(s.codes) == len(s.stopped) == len(s.ref_lengths):
        raise ValueError("a sample set needs one id, language, codes, stop flag and reference length per sample")
    codes = [np.asarray(c, dtype=np.int32).reshape(-1) for c in s.codes]
    offsets = np.cumsum([0] + [c.size for c in codes], dtype=np.int64)
    meta = {"format": FORMAT, "step": s.step, "ids": list(s.ids), "languages": list(s.languages),
            "settings": s.settings, "metrics": s.metrics}
    buffer = io.BytesIO()
    np.savez_compressed(buffer, codes=np.concatenate(codes) if codes else np.zeros(0, np.int32), offsets=offsets,
                        stopped=np.asarray(s.stopped, dtype=bool), ref_lengths=np.asarray(s.ref_lengths, np.int64),
                        meta=np.array(json.dumps(meta, sort_keys=True)))
    return buffer.getvalue()


def decode(data: bytes) -> SampleSet:
    """The set in .npz bytes; ValueError (or numpy's errors) for anything that is not a complete set."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in ("codes", "offsets", "stopped", "ref_lengths", "meta")}
    meta = json.loads(str(arrays["meta"]))
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')!r}, this trainer reads format {FORMAT}")
    n, offsets = len(meta["ids"]), arrays["offsets"]
    if not (len(meta["languages"]) == len(arrays["stopped"]) == len(arrays["ref_lengths"]) == n
            and len(offsets) == n + 1 and offsets[-1] == len(arrays["codes"])):
        raise ValueError("its arrays disagree in length")
    codes = [arrays["codes"][offsets[i]: offsets[i + 1]] for i in range(n)]
    return SampleSet(step=int(meta["step"]), ids=meta["ids"], languages=meta["languages"], codes=codes,
                     stopped=arrays["stopped"].tolist(), ref_lengths=arrays["ref_lengths"].tolist(),
                     settings=meta["settings"], metrics=meta["metrics"])


def list_sets(run_dir: Path) -> dict[int, Path]:
    """The complete sample sets of a run directory by step (temporaries of killed writes are not sets)."""
    folder = Path(run_dir) / SAMPLES_DIR
    if not folder.is_dir():
        return {}
    found = {}
    for entry in folder.iterdir():
        match = _SET_RE.match(entry.name)
        if match and entry.is_file():
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


def read_set(path: Path) -> SampleSet:
    """Load one set; a missing or damaged file is a UserError naming it (exit 2 in a command)."""
    try:
        return decode(Path(path).read_bytes())
    except FileNotFoundError:
        raise UserError(f"{path}: no such sample set; list a run's sets with list_sets(RUN_DIR)") from None
    except Exception as exc:  # a truncated zip, a foreign file, a set of another format
        raise UserError(f"{path} is not a readable sample set ({type(exc).__name__}: {exc}); delete it, the "
                        "trainer writes the step's set again when it validates that step") from None


def read_step(run_dir: Path, step: int | None = None) -> SampleSet:
    """The set of `step` (None: the newest) of a run directory; a UserError names the steps there are."""
    sets = list_sets(run_dir)
    if not sets:
        raise UserError(f"{run_dir} holds no sample sets ({SAMPLES_DIR}/step_*.npz): the trainer writes one at each "
                        "validation when generation at validation is on")
    if step is None:
        step = max(sets)
    if step not in sets:
        raise UserError(f"{run_dir} has no sample set of step {step} (steps kept: {', '.join(map(str, sets))}; "
                        "older ones were removed to keep the folder bounded)")
    return read_set(sets[step])


def refuse_unusable_folder(run_dir: Path) -> None:
    """At start-up, before anything is written: a `samples` path that is not a directory (a user's file) cannot
    take the sets of --sample-interval (UserError, exit 2)."""
    folder = Path(run_dir) / SAMPLES_DIR
    if os.path.lexists(folder) and not folder.is_dir():
        raise UserError(f"{folder} is not a directory, so the sample sets of --sample-interval cannot be written there; "
                        "move that file away, or leave out --sample-interval (nothing was trained or written)")


@dataclass
class SampleStore:
    """Writes a run's sample sets and keeps them bounded (see the module docstring)."""

    run_dir: Path
    keep: int

    def __post_init__(self) -> None:
        self.folder = Path(self.run_dir) / SAMPLES_DIR

    def path_of(self, step: int) -> Path:
        return self.folder / f"step_{step:08d}.npz"

    def write(self, sample_set: SampleSet, protect: Iterable[int] = (),
              on_written: Callable[[], None] | None = None) -> Path:
        """Write (or replace) the set of its step, then remove the sets beyond the bound."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path_of(sample_set.step)
        write_bytes_atomically(path, encode(sample_set), on_written)
        self.prune(sample_set.step, protect)
        return path

    def prune(self, step: int, protect: Iterable[int] = ()) -> None:
        """Remove the sets up to `step` but the newest `keep` and those of `protect`."""
        up_to = [s for s in list_sets(self.run_dir) if s <= step]
        kept = set(up_to[-self.keep:]) | set(protect) | {step}
        for path in [self.path_of(s) for s in up_to if s not in kept]:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove the old sample set %s (%s); delete it by hand to free the "
                            "space", path, exc)

    def clean_temporaries(self) -> list[Path]:
        """Remove the temporaries of writes a kill interrupted; call with the run locked, before writing."""
        if not self.folder.is_dir():
            return []
        removed = [entry for entry in sorted(self.folder.iterdir()) if _TEMP_RE.match(entry.name) and entry.is_file()]
        for entry in removed:
            entry.unlink(missing_ok=True)
        if removed:
            log.info("removed %d unfinished sample set(s) left by an interrupted trainer: %s", len(removed),
                     ", ".join(p.name for p in removed))
        return removed


def new_set(step: int, ids: Sequence[str], languages: Sequence[str | None], codes: Sequence[Any],
            stopped: Sequence[bool], ref_lengths: Sequence[int], settings: dict[str, Any] | None = None,
            metrics: dict[str, float] | None = None) -> SampleSet:
    """A SampleSet from the generator's output (codes may be CPU tensors or lists)."""
    return SampleSet(step=step, ids=list(ids), languages=list(languages),
                     codes=[np.asarray(c, dtype=np.int32).reshape(-1) for c in codes],
                     stopped=[bool(x) for x in stopped], ref_lengths=[int(x) for x in ref_lengths],
                     settings=dict(settings or {}),
                     metrics={k: float(v) for k, v in (metrics or {}).items()})
