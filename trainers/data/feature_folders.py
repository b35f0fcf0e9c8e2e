"""Has any feature file been removed since the manifests were checked? Answered per folder, not per file.

Checking a manifest stats every feature file it names (about 3.5 us each, warm: 10 s for the three
million files of a million paired samples, far more on a cold or network disk). A resume that reuses
the checked manifests (trainers.data.manifest_cache) instead compares the folders holding those
files: removing, renaming or replacing a file changes its folder's modification and change times,
so an unchanged folder still holds every file it held. Each folder is stat'ed before the first file
in it, so a change made during the check shows too. A folder whose modification and change times
both lie within RACY_WINDOW_NS of the check's start is not trusted: a change within the file
system's timestamp granularity would leave both as they were (a change sets both to the current
time, so one older time is enough to tell it). Files reached through a symbolic link live in a
folder that is not watched, so they are stat'ed again on every resume. When a folder changed, the
caller checks every file again.

Not covered, by design: a file whose permissions or contents changed in place; both are reported
with the sample's manifest:line when it is loaded (trainers.data.features), like any bad contents.
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field

import numpy as np

RACY_WINDOW_NS = 2_000_000_000  # FAT's granularity; ext4, xfs, btrfs and NFSv4 keep nanoseconds


# No .npy file holding an array is shorter: the format pads its header (magic, version, length and the
# descr/fortran_order/shape dict, itself over 48 bytes) to a multiple of 64 bytes (16 in numpy before 1.14),
# and the array's bytes follow. A shorter file is empty or cut off in its header, which the stat taken here
# shows for free; a file cut off later is found when the sample is loaded (trainers.data.features).
MIN_NPY_BYTES = 64


def file_state(path: str) -> tuple[str, bool]:
    """(what is wrong with `path` or "" for a readable regular file (symlinks followed) long enough to be a
    .npy file, whether it is a link)."""
    try:
        info = os.lstat(path)
        linked = stat.S_ISLNK(info.st_mode)
        if linked:
            info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "file not found", False
    except OSError as exc:
        return f"cannot be reached ({exc.strerror or exc})", False
    if stat.S_ISDIR(info.st_mode):
        return "is a directory, not a file", linked
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a device, pipe or socket)", linked
    if not os.access(path, os.R_OK):
        return "is not readable (permission denied)", linked
    if info.st_size < MIN_NPY_BYTES:
        return f"{TOO_SHORT} ({info.st_size} bytes; a .npy file is at least {MIN_NPY_BYTES})", linked
    return "", linked


TOO_SHORT = "is empty or cut off"


def _folder_stat(folder: str) -> tuple[int, int, int, int]:
    try:
        s = os.stat(folder or ".")
    except OSError:
        return (-1, -1, -1, -1)  # gone or unreachable: never equal to a real stat
    return (s.st_dev, s.st_ino, s.st_mtime_ns, s.st_ctime_ns)


@dataclass
class FolderRecord:
    """The stat of every folder holding a feature file, taken before its files were checked."""

    started_ns: int = field(default_factory=time.time_ns)
    stats: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    linked: list[str] = field(default_factory=list)  # feature files that are symbolic links

    def note(self, folder: str) -> None:
        if folder not in self.stats:
            self.stats[folder] = _folder_stat(folder)

    def arrays(self, folders: list[str], file_index: dict[str, int]) -> dict[str, np.ndarray]:
        """The record aligned with a table's folder pool: [dev, ino, mtime, ctime] per folder, the linked files."""
        flat = np.array([self.stats.get(f, (-1, -1, -1, -1)) for f in folders], dtype=np.int64).reshape(-1)
        linked = np.array(sorted(file_index[p] for p in self.linked if p in file_index), dtype=np.int64)
        return {"folder_stat": flat, "linked_files": linked, "checked_at": np.array([self.started_ns], np.int64)}


def changed_since(folders: list[str], record: dict[str, np.ndarray], linked_paths: list[str]) -> str | None:
    """Why the recorded check may no longer hold (a folder changed or was too new to trust, a linked file
    is gone), or None when every feature file is still where it was."""
    stats = record["folder_stat"].reshape(-1, 4)
    if len(stats) != len(folders) or len(record["checked_at"]) != 1:
        return "the record does not match the table"
    horizon = int(record["checked_at"][0]) - RACY_WINDOW_NS
    for folder, saved in zip(folders, stats.tolist()):
        if min(saved[2], saved[3]) >= horizon:  # a change sets both to "now": one older time tells it apart
            return f"{folder or '.'} changed within {RACY_WINDOW_NS // 10**9} s of the last check"
        if _folder_stat(folder) != tuple(saved):
            return f"{folder or '.'} changed (a file was added, removed or renamed)"
    for path in linked_paths:
        problem, _ = file_state(path)
        if problem:
            return f"{path} {problem}"
    return None
