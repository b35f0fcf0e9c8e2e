"""Room on the run directory's disk for the checkpoints a run keeps: checked before the first step, and before
each save.

A disk that fills up is otherwise found at the next save, which fails (exit 4) and loses every step trained
since the one before: with the default --save-interval that is a thousand steps. The size of a checkpoint is
known before the first step (the model's tensors, AdamW's two moments per trained parameter, a few small
sections), and so is how many of them the saving scheme holds at once (`files_at_peak`). A start without room
for them is refused (exit 2, the bytes needed and free named, nothing trained); before each save, a disk that
has since filled up is warned about, with the figures and what to do.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from trainers.checkpoint.step_files import BEST_NAME, CheckpointManager, distinct_files
from trainers.errors import UserError

log = logging.getLogger("train")

MiB = 2 ** 20
# What a checkpoint holds beside the tensor bytes: per tensor its record in the file (zip entry, pickle, checksum;
# measured 330 bytes) and per file the small sections (settings, RNG states: 19 KB with a short history). Generous:
# the estimate is an upper bound (tests/test_disk_space.py compares it with files written).
PER_TENSOR = 768
PER_FILE = 64 * 1024
GROWTH = 16 * 1024  # added to a real checkpoint's size for the next ones: the history grows (about 250 bytes a line)


def checkpoint_bytes(saved: Iterable[torch.Tensor], trained: Iterable[torch.Tensor]) -> int:
    """An upper bound on one checkpoint file's size: the model section's tensors (`saved`), AdamW's two
    moments and step count per trained parameter, the file's own overhead (its history: PER_FILE, GROWTH)."""
    saved, trained = list(saved), list(trained)
    tensors = sum(t.numel() * t.element_size() for t in saved)
    moments = sum(2 * p.numel() * p.element_size() + 4 for p in trained)
    return tensors + moments + PER_TENSOR * (len(saved) + 3 * len(trained)) + PER_FILE


def saves_to_come(step: int, total_steps: int, save_interval: int) -> int:
    """The checkpoints one invocation writes from `step` to `total_steps`: every --save-interval steps, and at
    the end (or at a stop signal instead)."""
    if total_steps <= step:
        return 0
    return total_steps // save_interval - step // save_interval + (1 if total_steps % save_interval else 0)


def files_at_peak(keep: int, step_files: int, best: bool) -> int:
    """Checkpoint files the saving scheme holds at once, at its fullest, when `step_files` model_step files will
    have been written in all (those there already and those to come):

    - the kept ones: `keep` model_step files (latest.pth is a hard link to the newest, no bytes of its own;
      with --keep-checkpoints 0 latest.pth is the one file);
    - the temporary of the save in flight, written in full before it is renamed and before rotation deletes
      the oldest;
    - best.pth when the run validates: a file of its own, replaced through a temporary too.
    """
    if step_files <= 0:
        return 0
    slots = max(keep, 1)
    during_a_save = min(slots + 1, step_files) + (1 if best else 0)
    during_a_best_save = min(slots, step_files) + 2 if best else 0
    return max(during_a_save, during_a_best_save)


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on the disk of `folder`."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def sized(n: int) -> str:
    return f"{n} bytes ({n / MiB:.1f} MiB)" if n < 2 ** 30 else f"{n} bytes ({n / 2 ** 30:.2f} GiB)"


@dataclass
class DiskRoom:
    """What the run's checkpoints need on the run directory's disk, and whether it is there."""

    run_dir: Path
    keep: int  # --keep-checkpoints
    best: bool  # the run validates, so it keeps best.pth too
    checkpoint_size: int  # one file: the estimate before the first save, then the last one written (+ GROWTH)
    total_steps: int  # where this invocation stops
    save_interval: int

    def shortfall(self, to_come: int) -> tuple[int, int, int]:
        """(bytes still to be written at the fullest, free bytes, files at the fullest), given `to_come` saves
        of this invocation; the checkpoint files there now that the scheme keeps count toward them."""
        files = CheckpointManager(self.run_dir, keep=0)
        paths = [p for _, p in files.step_files()][-self.keep:] if self.keep else [files.latest_path()]
        kept = distinct_files([*paths, files.best_path()])
        step_files = len([p for p in kept if p.name != BEST_NAME])
        peak = files_at_peak(self.keep, step_files + to_come, self.best)
        there = sum(p.stat().st_size for p in kept)
        return max(0, peak * self.checkpoint_size - there), free_bytes(self.run_dir), peak

    def what(self, peak: int) -> str:
        kept = f"{self.keep} model_step files" if self.keep else "latest.pth"
        return (f"{peak} checkpoint files of up to {sized(self.checkpoint_size)} at once: {kept}"
                f"{', best.pth' if self.best else ''} and the one being written")

    def refuse_if_short(self, step: int) -> None:
        """Before the first step (the run at `step`): UserError (exit 2) unless the disk has room for what the run
        keeps."""
        needed, free, peak = self.shortfall(saves_to_come(step, self.total_steps, self.save_interval))
        if needed > free:
            raise UserError(
                f"not enough disk space for this run's checkpoints in {self.run_dir}: they need {sized(needed)} more "
                f"({self.what(peak)}), and the disk has {sized(free)} free. Free disk space, lower "
                "--keep-checkpoints, or pass an --output-dir on a larger disk (nothing was trained)")

    def warn_if_short(self, step: int) -> None:
        """Before the save of `step`: a warning, with the figures, when the disk has filled up since the start."""
        try:
            needed, free, peak = self.shortfall(max(1, saves_to_come(step - 1, self.total_steps, self.save_interval)))
        except OSError:
            return  # the save itself reports what is wrong with the directory
        if needed > free:
            log.warning("disk space: saving step %d and the checkpoints after it need %s more in %s (%s), but the "
                        "disk has %s free: a save may fail (exit 4, the steps since the previous save lost). Free "
                        "disk space now; the run goes on", step, sized(needed), self.run_dir, self.what(peak),
                        sized(free))

    def written(self, path: Path) -> None:
        """A checkpoint was written: later checks use its real size, with room for the history to grow."""
        with contextlib.suppress(OSError):
            self.checkpoint_size = path.stat().st_size + GROWTH
