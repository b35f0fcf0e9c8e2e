"""Crash-safe checkpoint writing, rotation and resume discovery.

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
after its bytes were fsynced, so a process killed at any moment leaves either
the previous checkpoint or the new one, never a partial file.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

LATEST_NAME = "latest.pth"
BEST_NAME = "best.pth"  # the checkpoint of the best validation so far: never rotated, never resumed by "auto"

# (event, step). Events, in order: "tmp_written", "renamed", "linked".
CheckpointEvent = Callable[[str, int], None]

# Strict: no leading zeros, so "model_step01.pth" cannot alias step 1.
_STEP_FILE_RE = re.compile(r"^model_step(0|[1-9][0-9]*)\.pth$")
_TEMP_FILE_RE = re.compile(r"^\.(?:model_step(?:0|[1-9][0-9]*)|latest|best)\.pth\.tmp-[0-9]+$")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable or not a checkpoint."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"could not load checkpoint {path}: {reason}; resume from an older model_step*.pth in "
                         f"{Path(path).parent} or pass another checkpoint path")


def _temp_path(path: Path) -> Path:
    # Same directory as the target so os.replace never crosses filesystems.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _fsync_dir(directory: Path) -> None:
    """Persist directory entries (renames, new links) to disk."""
    if os.name != "posix":
        return  # Directories cannot be opened for fsync on Windows.
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:
        # Some network/fuse filesystems reject fsync on directories; the
        # rename itself is still atomic there, only its durability is weaker.
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        logger.debug("Filesystem does not support fsync on directory %s", directory)
    finally:
        os.close(fd)


def _emit(on_event: CheckpointEvent | None, event: str, step: int) -> None:
    if on_event is not None:
        on_event(event, step)


def _write_durably(obj: Any, tmp: Path) -> None:
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        # An ordinary failure (disk full, unpicklable object) should not
        # leave a stray temp file behind; a SIGKILL cannot get here.
        tmp.unlink(missing_ok=True)
        raise


def atomic_torch_save(
    obj: Any,
    path: Path,
    *,
    step: int = -1,
    on_event: CheckpointEvent | None = None,
) -> None:
    """Write ``obj`` to ``path`` so that ``path`` is either old or complete.

    Emits "tmp_written" once the temp file is fsynced and "renamed" once it is
    in place under ``path``. An exception raised by ``on_event`` is treated
    like a kill at that point: the temp file is left for
    ``CheckpointManager.clean_stale_temporaries``.
    """
    path = Path(path)
    tmp = _temp_path(path)
    _write_durably(obj, tmp)
    _emit(on_event, "tmp_written", step)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    _emit(on_event, "renamed", step)


def load_checkpoint(path: Path, mmap: bool = False) -> dict:
    """Load a checkpoint (or any torch file holding a dict) on CPU with ``weights_only=True``.

    Raises CheckpointError naming the file and the reason for any failure; callers that read
    files the user named (a base checkpoint, a file to inspect) phrase their own advice from
    ``CheckpointError.reason``. With ``mmap`` tensors are mapped from the file instead of read,
    so a reader that needs only the metadata of a multi-GB checkpoint reads a few kilobytes.
    """
    path = Path(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(path, "file not found") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, not a .pth file") from None
    except Exception as err:  # truncated or corrupt file, or one that needs pickled code
        # First sentence only: torch's weights_only message goes on to advise weights_only=False.
        first = re.split(r"(?<=\.)\s", (str(err).strip().splitlines() or [""])[0])[0]
        raise CheckpointError(path, f"cannot be read with torch.load(weights_only=True) ({type(err).__name__}: "
                                    f"{first}); the file may be truncated or corrupt") from None
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"holds a {type(obj).__name__}, not a state dict or checkpoint")
    return obj


def os_error_in_chain(exc: BaseException) -> OSError | None:
    """The ``OSError`` (disk full, permissions) that ``exc`` is or was caused by, if any.

    torch's serializer may report a failed write as a ``RuntimeError`` raised while handling
    the ``OSError``; a trainer that maps write failures to an exit status should look here
    rather than at the type alone."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _parse_step(name: str) -> int | None:
    match = _STEP_FILE_RE.match(name)
    return int(match.group(1)) if match else None


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
        """Replace best.pth with `state` (same atomic, durable protocol; outside rotation)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(state, self.best_path(), step=step, on_event=self.on_event)
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
            _emit(self.on_event, "linked", step)
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
                logger.info(
                    "%s is newer than %s (step %d): the previous run was killed "
                    "before it updated latest.pth. Resuming from %s.",
                    newest[1].name, latest, latest_step, newest[1],
                )
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

    # -- internals ---------------------------------------------------------

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
        link_tmp = _temp_path(latest)
        link_tmp.unlink(missing_ok=True)
        self._make_link(target, link_tmp)
        os.replace(link_tmp, latest)
        # rename() between two names of one inode succeeds without doing
        # anything, which would leave the temp name behind.
        link_tmp.unlink(missing_ok=True)
        _fsync_dir(self.run_dir)

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

    def _rotate(self) -> None:
        """Delete step files beyond the newest ``keep``; runs only after
        latest.pth refers to the complete new checkpoint."""
        files = self.step_files()
        excess = files[: max(0, len(files) - self.keep)]
        if not excess:
            return
        protected = self._latest_step(files) if self.latest_path().exists() else None
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
