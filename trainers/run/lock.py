"""One trainer per run directory.

Two trainers on one directory overwrite each other's checkpoints and delete each other's
in-progress files. The trainer holds two OS locks for as long as it runs; the kernel drops both
when the process dies, so a SIGKILLed trainer never leaves a stale lock behind.

- An flock on the run directory itself: a directory cannot be deleted while it holds files, so
  this lock cannot be removed from under its holder (a lock file can: `rm .trainer.lock` used to
  let a second trainer in). flock locks are shared with forked children, so every forked child
  (the data loader's workers) closes its copy at once: otherwise a worker outliving a killed
  trainer would keep the run locked.
- A POSIX record lock on RUN_DIR/.trainer.lock, which also records who holds the run (pid, host,
  start time) for the refusal message. On network filesystems that do not support flock on a
  directory (NFS emulates flock with record locks, which need a writable file) this one alone
  keeps a second trainer out, as before.

When the trainer locks and what a refused start leaves behind: trainers/run/setup.py, `abandon`.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import socket
import time
import weakref
from pathlib import Path

from trainers.errors import UserError

LOCK_NAME = ".trainer.lock"
_BUSY = (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK)


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self.created: list[Path] = []  # the directories acquire() made, innermost first
        self._found: set[str] | None = None  # what the directory held before (None: not known)
        self._made_file = False
        self._previous: tuple[bytes, int, int] | None = None  # an existing lock file's bytes, atime, mtime

    @property
    def existed(self) -> bool:
        """Whether the run directory was there before this lock."""
        return self.path.parent not in self.created

    def acquire(self) -> "RunLock":
        run_dir = self.path.parent
        self.created = [d for d in (run_dir, *run_dir.parents) if not d.exists()]
        self._found = set() if self.created else _listing(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._dir_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise UserError(f"cannot use the run directory {run_dir}: {exc.strerror or exc}; check that it "
                            "is writable and the disk has space (nothing was trained)") from None
        try:
            self._lock_directory()  # first: a refused trainer creates no lock file
            self._lock_file()
        except BaseException:
            self.release()
            raise
        return self

    def _lock_directory(self) -> None:
        assert self._dir_fd is not None
        try:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _BUSY:
                raise self._busy(_holder_details(self.path)
                                 or f"its {LOCK_NAME} was deleted or replaced while it runs") from None
            os.close(self._dir_fd)  # this filesystem cannot flock a directory: the lock file alone guards it
            self._dir_fd = None
            return
        # The hook stays registered for the process's life; the lock need not (a weak reference).
        os.register_at_fork(after_in_child=functools.partial(_close_in_child, weakref.ref(self)))

    def _lock_file(self) -> None:
        self._made_file = not self.path.exists()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot use the run directory {self.path.parent}: {exc.strerror or exc}; check that it "
                            "is writable and the disk has space (nothing was trained)") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if exc.errno not in _BUSY:
                raise UserError(f"cannot lock the run directory {self.path.parent}: {exc.strerror}") from None
            raise self._busy(_describe(holder)) from None
        if not self._made_file:
            st = os.fstat(fd)
            self._previous = (os.pread(fd, 1 << 16, 0), st.st_atime_ns, st.st_mtime_ns)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd

    def _busy(self, holder: str) -> UserError:
        return UserError(f"another trainer is using {self.path.parent} ({holder}); two trainers on one run directory "
                         "would overwrite each other's checkpoints. Wait for it to finish, or stop it (it saves on "
                         "SIGTERM) and then resume with --resume auto (nothing was changed)")

    def release(self) -> None:
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                os.close(fd)  # closing the file drops its lock
        self._fd = self._dir_fd = None

    def abandon(self) -> None:
        """Release after a start that stopped before writing anything of the run: a lock file it made goes, with
        the directories acquire() made, where nothing else was added to them; one it found gets its bytes and
        times back, so a refused start leaves the directory byte for byte as it was."""
        run_dir = self.path.parent
        untouched = self._fd is not None and self._found is not None and _listing(run_dir) == self._found
        if untouched and self._made_file:
            try:
                self.path.unlink()
            except OSError:
                untouched = False
        elif untouched and self._previous is not None:
            content, atime, mtime = self._previous
            try:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, content, 0)
                os.utime(self._fd, ns=(atime, mtime))
            except OSError:
                pass  # the holder line is only information for a refusal message
        self.release()
        if untouched and self._made_file:
            for folder in self.created:
                try:
                    folder.rmdir()  # only while empty: a trainer that got in since keeps its directory
                except OSError:
                    break


def _close_in_child(ref: weakref.ref[RunLock]) -> None:
    """In a forked child: close the child's copy of the directory lock (the parent keeps holding it)."""
    lock = ref()
    if lock is not None and lock._dir_fd is not None:
        try:
            os.close(lock._dir_fd)
        except OSError:
            pass
        lock._dir_fd = None


def _listing(folder: Path) -> set[str] | None:
    """The names in `folder` but the lock file (None where it cannot be listed)."""
    try:
        return set(os.listdir(folder)) - {LOCK_NAME}
    except OSError:
        return None


def _holder_details(path: Path) -> str | None:
    try:
        return _describe(path.read_text(encoding="utf-8", errors="replace").strip(), default=None)
    except OSError:
        return None


def _describe(holder: str, default: str | None = "a process that left no details") -> str | None:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return default
