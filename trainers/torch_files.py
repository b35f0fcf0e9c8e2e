"""Torch files on disk: a save that leaves the old file or the complete new one, never a part, and a
load that runs no pickled code and names the file and the reason when it fails."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch

from trainers.files import write_atomically

# (event, step). Events, in order: "tmp_written", "renamed", "linked".
CheckpointEvent = Callable[[str, int], None]


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable or not a checkpoint."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"could not load checkpoint {path}: {reason}; resume from an older model_step*.pth in "
                         f"{Path(path).parent} or pass another checkpoint path")


def atomic_torch_save(obj: Any, path: Path, *, step: int = -1,
                      on_event: CheckpointEvent | None = None) -> None:
    """Write ``obj`` to ``path`` so that ``path`` is either old or complete (files.write_atomically), emitting
    "tmp_written" once the temporary is fsynced and "renamed" once it is in place. An exception raised by
    ``on_event`` is treated like a kill at that point: the temporary is left for
    ``CheckpointManager.clean_stale_temporaries``."""
    emit = on_event or (lambda event, step: None)
    write_atomically(Path(path), lambda f: torch.save(obj, f), lambda: emit("tmp_written", step))
    emit("renamed", step)


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
