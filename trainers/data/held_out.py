"""Is the validation set held out from training? Checked once per fresh start, before anything is built.

Validation on training samples measures memorising: its losses look better than the model is, and best.pth
and early stopping follow them. A --val-manifest that is one of the --train-manifest files (under any name,
link or ::LANG) validates on nothing held out, so it is refused. Validation samples that are also training
samples are counted and said with an example, not refused: a partial overlap can be deliberate (a few shared
sentences, a memorisation check) and validation still measures the rest.

Two samples are the same when they have the same id, or the same target codes file (a paired line's
id names its target and its prompt: the same target with another prompt is the same utterance to learn).
Prompt features (condition, emo_vec) are not compared: a speaker's prompts are rightly shared by both sets.
Cost: one pass over the ids and codes-file names of both tables as bytes (no file is read), once per
fresh start, nothing per step.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np

from trainers.data.manifest import ManifestSpec
from trainers.data.sample_table import SampleTable
from trainers.errors import UserError
from trainers.files import file_identity

log = logging.getLogger("train")


def refuse_same_file(train: Sequence[ManifestSpec], val: Sequence[ManifestSpec]) -> None:
    """A --val-manifest that is a --train-manifest file (compared by file identity, not by name): UserError."""
    for v in val:
        identity = file_identity(v.path)
        for t in train:
            if identity is not None and identity == file_identity(t.path):
                named = "" if str(v.path) == str(t.path) else f" (as {t.path})"
                raise UserError(f"--val-manifest {v.path} is also a --train-manifest{named}: validation would measure "
                                "the samples the model trains on, so best.pth and early stopping would reward "
                                "memorising. Pass a held-out manifest, or leave --val-manifest out (no validation); "
                                "nothing was written")


def warn_overlap(train: SampleTable, val: SampleTable) -> None:
    """Warn (with an example) when validation samples share an id or target codes file with training ones."""
    val_ids: dict[bytes, int] = {}
    for k, key in enumerate(val.ids.as_bytes()):
        val_ids.setdefault(key, k)
    match = np.full(len(val), -1, dtype=np.int64)  # the training sample each validation sample repeats
    for i, key in enumerate(train.ids.as_bytes()):
        k = val_ids.get(key)
        if k is not None and match[k] < 0:
            match[k] = i
    _match_codes_files(train, val, match)
    shared = np.flatnonzero(match >= 0)
    if not len(shared):
        return
    k = int(shared[0])
    every = "every one" if len(shared) == len(val) else f"{len(shared)} of {len(val)}"
    log.warning("validation is not held out: %s validation samples are training samples too", every)
    log.warning("e.g. %s is %s (id %r)", val.source(k), train.source(int(match[k])), val.ids[k])
    log.warning("(the same id or codes file): their losses measure memorising; drop them from one manifest")


def _match_codes_files(train: SampleTable, val: SampleTable, match: np.ndarray) -> None:
    """Mark in `match` the validation samples whose codes file a training sample also names (file names first,
    as bytes; full paths only for the few names that occur in both)."""
    val_files: dict[str, list[int]] = {}
    for k, file in enumerate(val.arrays["codes"].tolist()):
        val_files.setdefault(val.path(file), []).append(k)
    names = {os.path.basename(p).encode("utf-8", "surrogatepass") for p in val_files}
    train_files, first_user = np.unique(train.arrays["codes"], return_index=True)
    files = train_files.tolist()
    for file, name, user in zip(files, train.files.as_bytes(files), first_user.tolist()):
        if name in names:
            for k in val_files.get(train.path(file), ()):
                if match[k] < 0:
                    match[k] = user
