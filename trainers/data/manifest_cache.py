"""The validated-manifest cache: a resume reuses the start's check of its manifests instead of repeating it.

RUN_DIR/data_cache/train.samples (and val.samples) hold the checked samples as a SampleTable file
(trainers.data.table_file), keyed by everything the check depends on:

* the manifests' bytes: their sha256 (manifests_fingerprint, the digest the checkpoint already
  records as the data fingerprint), not their modification times: an mtime survives a copy that
  changed the bytes (cp -p, rsync -t, a restored backup) and changes on a touch that did not, and
  the digest costs one read of the files (0.65 s for a 615 MB manifest of a million lines);
* each manifest's name as given and its folder (feature paths resolve from it), the config's
  length limits, the model family's line forms (other than IndexTTS2's, with the vocabulary size and
  FAMILY_RULES), the flag, and RULES (raise it when a check changes, so old caches are rebuilt);
* the feature files' presence: the stat of each folder holding them (trainers.data.feature_folders);
  when a folder changed, every feature file is stat'ed again before the cache is trusted.

The cache lives in the run directory because the run owns it: it is written under the run's lock,
once every refusal is behind us (a refused start writes nothing), by rank 0 alone, before the other
processes of a torchrun job read it; it moves and is deleted with the run, and never lands in the
user's data folder (which may be read-only or shared by several runs). A missing, foreign, stale
or damaged cache (checksum, sizes or indices wrong) is never used: the manifests are checked in
full, with every file:line message, and the cache is written again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from trainers.data.feature_folders import FolderRecord, changed_since, file_state
from trainers.data.manifest import (
    DataLimits, ManifestError, ManifestSpec, Validated, manifests_fingerprint, validate_manifests, warn_duplicate_ids,
)
from trainers.data.manifest_lines import INDEXTTS2_FORMS
from trainers.data.sample_table import SampleTable
from trainers.data.table_file import TableFileError, map_file, read_header, write_table

log = logging.getLogger("train")

CACHE_DIR = "data_cache"
RULES = 2  # the manifest checks' version: raise it when a check is added or changed (2: .npy too short)
FAMILY_RULES = 2  # the same for the checks of a family other than IndexTTS2 (ManifestForms' own checks)
_FOLDER_ARRAYS = ("folder_stat", "linked_files", "checked_at")


def cache_path(run_dir: Path, flag: str) -> Path:
    return run_dir / CACHE_DIR / ("val.samples" if flag == "--val-manifest" else "train.samples")


@dataclass
class CheckedManifests:
    """The samples of one flag's manifests, their fingerprint, and the cache file to write (None: it is current)."""

    table: SampleTable
    fingerprint: str
    write: _CacheWrite | None = None

    def save(self) -> None:
        """Write the cache; call with the run directory locked, once the start can no longer be refused."""
        if self.write is not None:
            self.write.save()
            self.write = None


@dataclass
class _CacheWrite:
    path: Path
    key: str
    checked: Validated
    fingerprint: str  # of the manifests checked: a refused resume compares their samples with today's
    refresh: bool = False  # the reused check with a new record of its folders: said when it was reused

    def save(self) -> None:
        started = time.monotonic()
        meta = {"samples": len(self.checked.table), "duplicates": list(self.checked.duplicates),
                "fingerprint": self.fingerprint}
        try:
            write_table(self.path, self.checked.table, self.key, meta, self.checked.folders)
        except OSError as exc:
            log.warning("could not write the validated-manifest cache %s (%s): training goes on, and the next start "
                        "checks the manifests again; free disk space or fix the run directory's permissions",
                        self.path, exc.strerror or exc)
            return
        (log.debug if self.refresh else log.info)("manifest check cached in %s (%d samples, %.2f s); a resume "
                                                  "reuses it", _in_run(self.path), len(self.checked.table),
                                                  time.monotonic() - started)


def cache_key(specs: Sequence[ManifestSpec], limits: DataLimits, flag: str, fingerprint: str) -> str:
    where = [[str(s.path), os.path.dirname(os.path.abspath(s.path))] for s in specs]
    described = {"rules": RULES, "flag": flag, "fingerprint": fingerprint, "manifests": where,
                 "limits": [limits.max_text_tokens, limits.max_mel_tokens, limits.prefix_len]}
    if limits.forms is not INDEXTTS2_FORMS:  # the forms caches were written with before families: keys unchanged
        # A family's own checks may read the vocabulary's size (its language tokens); FAMILY_RULES: its checks'
        # version (2: archives lacking an array a role reads, text ids beginning with another language's token).
        described["forms"] = [limits.forms.name, limits.text_tokens, FAMILY_RULES]
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def read_manifests(specs: Sequence[ManifestSpec], limits: DataLimits, flag: str,
                   cache: Path | None, said: set[str] | None = None) -> CheckedManifests:
    """The checked samples of `specs`: from `cache` when it matches, else checked in full (ManifestError).
    said: why feature files were stat'ed again, already said by this start (the flags share folders)."""
    try:
        fingerprint = manifests_fingerprint(specs)
    except ManifestError:  # unreadable: the full check says so with the flag and what to do
        fingerprint = ""
    key = cache_key(specs, limits, flag, fingerprint) if fingerprint and cache is not None else ""
    if key:
        reused = _reuse(cache, key, set() if said is None else said)
        if reused is not None:
            return CheckedManifests(reused.table, fingerprint, _CacheWrite(cache, key, reused, fingerprint, True)
                                    if reused.folders is not None else None)
    checked = validate_manifests(specs, limits, flag)
    fingerprint = fingerprint or manifests_fingerprint(specs)
    return CheckedManifests(checked.table, fingerprint, _CacheWrite(cache, key, checked, fingerprint) if key else None)


def _reuse(path: Path, key: str, said: set[str]) -> Validated | None:
    """The cached check if it holds (folders None: the cache is current, else the refreshed folder record)."""
    try:
        header, _ = read_header(path)
    except FileNotFoundError:
        return None
    except (OSError, TableFileError) as exc:
        return _distrust(path, str(exc))
    if header.get("key") != key:
        log.info("manifests: checking in full (%s: other manifests, places or limits)", _in_run(path))
        return None
    try:
        _, table, record = map_file(path, verify=True, extras=_FOLDER_ARRAYS)
        duplicates = tuple(int(x) for x in header["meta"]["duplicates"])
    except (OSError, TableFileError, KeyError, TypeError, ValueError) as exc:
        return _distrust(path, str(exc))
    reused = Validated(table, (duplicates[0], duplicates[1]), None)
    folders = table.folders.strings()
    why = changed_since(folders, record, [table.path(int(k)) for k in record["linked_files"]])
    again = "features unchanged"
    if why is not None:
        if why not in said:  # once per start: the flags' manifests often share their feature folders
            log.info("stat'ing the feature files again: %s", why)
            said.add(why)
        reused.folders = _recheck_files(table, folders)
        if reused.folders is None:
            return None
        again = f"{len(table.files)} files re-checked"
    warn_duplicate_ids(table, reused.duplicates)
    log.info("manifests: reusing the check of %d samples (%s; %s)", len(table), _in_run(path), again)
    return reused


def _in_run(path: Path) -> str:
    """The cache's name in the run directory (named by the start-up summary), as the log says it."""
    return f"{path.parent.name}/{path.name}"


def _recheck_files(table: SampleTable, folders: list[str]) -> dict[str, np.ndarray] | None:
    """Stat every feature file again; the new folder record, or None when one is missing (full check)."""
    record = FolderRecord()
    for folder in folders:
        record.note(folder)  # before the files, as in the full check
    index = {}
    for k in range(len(table.files)):
        path = table.path(k)
        problem, linked = file_state(path)
        if problem:
            log.info("a feature file changed (%s %s): checking the manifests in full", path, problem)
            return None
        if linked:
            record.linked.append(path)
        index[path] = k
    return record.arrays(folders, index)


def _distrust(path: Path, why: str) -> None:
    log.warning("the validated-manifest cache %s is damaged or unreadable (%s): checking the manifests in full; "
                "the cache is written again", path, why)
