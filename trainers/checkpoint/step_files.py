"""A run directory's checkpoint files: saving the next one, latest.pth, rotation, finding the newest.

Layout of a run directory:

* ``model_step{N}.pth`` -- one file per save, the newest ``keep`` are kept.
* ``latest.pth`` -- a hard link (or, where hard links are unsupported, a
  relative symlink) to the newest complete ``model_step`` file. With
  ``keep == 0`` it is a regular file written directly.
* ``.model_step{N}.pth.tmp-{pid}`` / ``.latest.pth.tmp-{pid}`` -- temporaries
  of an in-progress save; a leftover one means that save was killed.
* ``model_step{N}.pth.corrupt`` (``.corrupt-2``, ...) -- a checkpoint that
  ``--resume auto`` found damaged and moved aside, its bytes kept
  (trainers/checkpoint/recovery.py); resume, rotation and cleanup ignore it.

Every file becomes visible under its final name only through ``os.replace``
after its bytes were fsynced (trainers/torch_files.py), so a process killed at any moment leaves either
the previous checkpoint or the new one, never a partial file.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from trainers.files import file_identity, fsync_dir, temp_path
from trainers.torch_files import CheckpointEvent, atomic_torch_save

logger = logging.getLogger(__name__)

LATEST_NAME = "latest.pth"
BEST_NAME = "best.pth"  # the checkpoint of the best validation so far: never rotated, never resumed by "auto"

# Strict: no leading zeros, so "model_step01.pth" cannot alias step 1.
_STEP_FILE_RE = re.compile(r"^model_step(0|[1-9][0-9]*)\.pth$")
_TEMP_FILE_RE = re.compile(r"^\.(?:model_step(?:0|[1-9][0-9]*)|latest|best)\.pth\.tmp-[0-9]+$")


def _parse_step(name: str) -> int | None:
    match = _STEP_FILE_RE.match(name)
    return int(match.group(1)) if match else None


def distinct_files(paths: Iterable[Path]) -> list[Path]:
    """The paths that exist, each file once under the first of its names (latest.pth links to a step file)."""
    first_names: dict[tuple[int, int], Path] = {}
    for path in paths:
        ident = file_identity(path)
        if ident is not None:
            first_names.setdefault(ident, path)
    return list(first_names.values())


@dataclass
class CheckpointManager:
    """Saves ``model_step{N}.pth`` files, keeps ``latest.pth`` pointing at
    the newest one and deletes all but the newest ``keep``."""

    run_dir: Path
    keep: int
    on_event: CheckpointEvent | None = None
    # Per-manager memory that hard links failed, so the fallback is logged once.
    _hardlinks_ok: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.keep < 0:
            raise ValueError(f"keep must be >= 0, got {self.keep}")

    def latest_path(self) -> Path:
        return self.run_dir / LATEST_NAME

    def best_path(self) -> Path:
        return self.run_dir / BEST_NAME

    def save_best(self, state: dict, step: int) -> Path:
        """Replace best.pth with `state` (same atomic, durable protocol; outside rotation). Its events are
        "best_tmp_written" and "best_renamed", so a step's own file events name its model_step file alone."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        on_event = self.on_event
        atomic_torch_save(state, self.best_path(), step=step,
                          on_event=(lambda event, at: on_event(f"best_{event}", at)) if on_event else None)
        return self.best_path()

    def step_path(self, step: int) -> Path:
        return self.run_dir / f"model_step{step}.pth"

    def step_files(self) -> list[tuple[int, Path]]:
        """All ``model_step{N}.pth`` files in the run dir, sorted by step."""
        if not self.run_dir.is_dir():
            return []
        found = []
        for entry in self.run_dir.iterdir():
            step = _parse_step(entry.name)
            if step is not None and entry.is_file():
                found.append((step, entry))
        return sorted(found)

    def save(self, state: dict, step: int) -> Path:
        """Save ``state`` for ``step`` and return the file written.

        Events: "tmp_written", "renamed", "linked" (keep > 0); with keep == 0
        only "tmp_written" and "renamed", the latter meaning latest.pth is in
        place.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.keep == 0:
            target = self.latest_path()
            atomic_torch_save(state, target, step=step, on_event=self.on_event)
        else:
            self._warn_if_newer_steps_exist(step)
            target = self.step_path(step)
            atomic_torch_save(state, target, step=step, on_event=self.on_event)
            self.point_latest_at(target)
            if self.on_event is not None:
                self.on_event("linked", step)
        self._rotate()
        return target

    def find_resume(self) -> Path | None:
        """The newest complete checkpoint, or None if the run has none."""
        files = self.step_files()
        newest = files[-1] if files else None
        latest = self.latest_path()
        if latest.is_symlink() and not latest.exists():
            logger.warning(
                "%s is a symlink to a missing file; ignoring it. Delete it if no "
                "model_step file can be used.", latest,
            )
        elif latest.exists():
            latest_step = self._latest_step(files)
            if newest is not None and latest_step is not None and newest[0] > latest_step:
                # Expected after a kill between the two renames of a save: not an alarm.
                logger.info("%s is newer than %s (step %d), resuming from it:", newest[1].name, latest, latest_step)
                logger.info("the previous run was killed before it updated latest.pth")
                return newest[1]
            return latest
        if newest is not None:
            logger.warning(
                "%s is missing; resuming from the newest step file %s.", latest, newest[1]
            )
            return newest[1]
        return None

    def clean_stale_temporaries(self) -> list[Path]:
        """Delete temp files of killed saves. Call before saving, not during."""
        if not self.run_dir.is_dir():
            return []
        removed = []
        for entry in sorted(self.run_dir.iterdir()):
            if not _TEMP_FILE_RE.match(entry.name):
                continue
            # The link temp may be a (possibly dangling) symlink.
            if not (entry.is_symlink() or entry.is_file()):
                continue
            entry.unlink(missing_ok=True)
            logger.info("Removed %s left behind by an interrupted checkpoint save.", entry)
            removed.append(entry)
        return removed

    def _latest_step(self, files: list[tuple[int, Path]]) -> int | None:
        """Step of the model_step file latest.pth refers to, without loading it."""
        latest = self.latest_path()
        if latest.is_symlink():
            return _parse_step(Path(os.readlink(latest)).name)
        latest_stat = latest.stat()
        for step, path in reversed(files):
            try:
                if os.path.samestat(latest_stat, path.stat()):
                    return step
            except FileNotFoundError:
                continue  # Deleted concurrently by rotation; not the one we want.
        # A regular file of its own (keep == 0); its step is unknown.
        return None

    def point_latest_at(self, target: Path) -> None:
        """Atomically make latest.pth refer to ``target`` without copying bytes."""
        latest = self.latest_path()
        link_tmp = temp_path(latest)
        link_tmp.unlink(missing_ok=True)
        self._make_link(target, link_tmp)
        os.replace(link_tmp, latest)
        # rename() between two names of one inode succeeds without doing
        # anything, which would leave the temp name behind.
        link_tmp.unlink(missing_ok=True)
        fsync_dir(self.run_dir)

    def _make_link(self, target: Path, link: Path) -> None:
        if self._hardlinks_ok:
            try:
                os.link(target, link)
                return
            except OSError as err:
                self._hardlinks_ok = False
                logger.warning(
                    "Hard links are not supported in %s (%s); latest.pth will be "
                    "a relative symlink instead. Keep the run directory together "
                    "when copying it.", self.run_dir, err,
                )
        try:
            os.symlink(target.name, link)
        except OSError:
            logger.error(
                "Could not point %s at %s (neither a hard link nor a symlink "
                "could be created). latest.pth still names the previous "
                "checkpoint; resume will pick %s from the step files.",
                self.latest_path(), target.name, target.name,
            )
            raise

    def apply_keep(self, step: int) -> None:
        """Rotation without a save, for a resume that has nothing to train: the directory ends as a save with
        this ``keep`` leaves it. Only where latest.pth names ``model_step{step}``, the newest step file (what
        ``--resume auto`` resumed); with ``keep == 0`` that file goes too where latest.pth is a hard link, which
        keeps its bytes (a symlink would dangle)."""
        files = self.step_files()
        latest = self.latest_path()
        if not files or files[-1][0] != step or not latest.exists() or self._latest_step(files) != step:
            return
        self._rotate(protect_latest=self.keep > 0 or latest.is_symlink())

    def _rotate(self, protect_latest: bool = True) -> None:
        """Delete step files beyond the newest ``keep``; runs only after
        latest.pth refers to the complete new checkpoint."""
        files = self.step_files()
        excess = files[: max(0, len(files) - self.keep)]
        if not excess:
            return
        protected = self._latest_step(files) if protect_latest and self.latest_path().exists() else None
        for step, path in excess:
            if step == protected:
                continue
            try:
                path.unlink(missing_ok=True)
                logger.info("Deleted old checkpoint %s (keep=%d).", path, self.keep)
            except OSError as err:
                logger.warning(
                    "Could not delete old checkpoint %s: %s. Delete it by hand "
                    "to free disk space.", path, err,
                )

    def _warn_if_newer_steps_exist(self, step: int) -> None:
        newer = [path.name for s, path in self.step_files() if s > step]
        if newer:
            logger.warning(
                "Saving step %d while newer checkpoints exist in %s (%s). After a "
                "crash, resume would prefer the newer files; move them elsewhere "
                "if they belong to an abandoned run.",
                step, self.run_dir, ", ".join(newer),
            )
