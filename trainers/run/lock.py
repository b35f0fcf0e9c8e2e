"""One trainer per run directory.

Two trainers on one directory overwrite each other's checkpoints and delete each other's
in-progress files. The trainer holds an OS lock (a POSIX record lock on RUN_DIR/.trainer.lock)
for as long as it runs. The kernel drops the lock when the process dies, so a SIGKILLed
trainer never leaves a stale lock behind; data-loading worker processes do not inherit it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from trainers.errors import UserError

LOCK_NAME = ".trainer.lock"


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot use the run directory {self.path.parent}: {exc.strerror or exc}; check that it "
                            "is writable and the disk has space (nothing was trained)") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise UserError(f"cannot lock the run directory {self.path.parent}: {exc.strerror}") from None
            raise UserError(f"another trainer is using {self.path.parent} ({_describe(holder)}); two trainers on one "
                            "run directory would overwrite each other's checkpoints. Wait for it to finish, or stop "
                            "it (it saves on SIGTERM) and then resume with --resume auto (nothing was changed)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = None


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"
