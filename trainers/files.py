"""Generic file helpers, at the bottom of the package (tests/test_layers.py): durable directory
entries, atomic text and byte writes, which file a name is, checksums, and the OSError behind an exception."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable

logger = logging.getLogger(__name__)


def temp_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: `.NAME.tmp-PID` in the same directory, so
    os.replace never crosses filesystems."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_fsynced(tmp: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Create `tmp`, fill it with `write(file)` and fsync it, for the caller to rename into place. An ordinary
    failure (disk full, an unpicklable object) leaves no stray temporary; a SIGKILL cannot get here."""
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so a reader (or a kill) never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write_fsynced(tmp, lambda f: f.write(text.encode("utf-8")))
    os.replace(tmp, path)


def write_bytes_atomically(path: Path, data: bytes, on_written: Callable[[], None] | None = None) -> None:
    write_atomically(path, lambda f: f.write(data), on_written)


def write_atomically(path: Path, write: Callable[[BinaryIO], Any],
                     on_written: Callable[[], None] | None = None) -> None:
    """Replace `path` durably with what `write(file)` writes: a temporary (temp_path) beside it, fsynced,
    renamed over `path`, the directory fsynced. A kill at any moment leaves the old file (or none) or the
    complete new one, and possibly the temporary, for the writer's owner to clean. `on_written` runs between
    the temporary's fsync and the rename (the tests stop a process there; an exception it raises is such a
    kill)."""
    tmp = temp_path(path)
    write_fsynced(tmp, write)
    if on_written is not None:
        on_written()
    try:
        os.replace(tmp, path)
    except OSError:  # e.g. a directory where the file goes: nothing half-done is left either
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def file_identity(path: Path) -> tuple[int, int] | None:
    """The file behind a name (following a symlink): equal for two names of one file; None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dict_sha256(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def fsync_dir(directory: Path) -> None:
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
