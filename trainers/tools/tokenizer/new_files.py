"""Temporary files beside an output, created with the mode any new file gets: 0666 less the umask.

The tokenizer tools write every output to a temporary file and rename it into place; the rename
keeps the temporary's mode. tempfile.mkstemp creates 0600 files whatever the umask, so outputs
made that way could not be read by the group or others where a plain open() gives 0644 (umask
022). os.open with 0666 lets the kernel apply the umask, as it does for every other file.
"""
from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

ATTEMPTS = 100


def create_beside(path: Path) -> tuple[int, Path]:
    """A new, empty file ".NAME.<random>.tmp" in `path`'s folder, open for writing: its descriptor and path."""
    for _ in range(ATTEMPTS):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue  # another writer's temporary: draw another name
    raise FileExistsError(errno.EEXIST, f"no free temporary name after {ATTEMPTS} attempts", str(path.parent))
