"""Errors that end a run with a documented exit status, and the statuses themselves.

Kept free of heavy imports so the flag parser (and `--help`) can use it before torch loads.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_UNEXPECTED = 1  # a traceback is printed
EXIT_USAGE = 2  # bad flags, data, config or run directory
EXIT_DIVERGED = 3
EXIT_SAVE_FAILED = 4
EXIT_OUT_OF_MEMORY = 5
EXIT_PEER_LOST = 6  # torchrun: another process of the run failed or stopped answering; nothing more was saved
EXIT_HOST_MEMORY = 7  # host memory (RAM) ran out for a checkpoint's copy; the previous checkpoint is intact
# A stop signal exits with 128 + its number, the shell convention: 129 SIGHUP, 130 SIGINT, 143 SIGTERM.


class UserError(Exception):
    """A problem with the user's flags, files or run directory; printed without a traceback (exit 2)."""


class CheckpointWriteError(RuntimeError):
    """Saving failed (disk full, permissions); training stops rather than run on unsaved (exit 4)."""


class LogWriteError(CheckpointWriteError):
    """A log file (TensorBoard events, sample_ids.tsv) could not be written (disk full); exit 4."""


class TrainingDiverged(RuntimeError):
    """Weights, optimizer state or a validation loss became non-finite; nothing is saved (exit 3)."""


class HostMemoryError(Exception):
    """Host memory (RAM, pinned or not) could not be allocated for the copy of a checkpoint (exit 7).

    Not a RuntimeError: torch's text for a failed pinned allocation ("CUDA error: out of memory")
    must never be read as a GPU out-of-memory error, whose advice is to free GPU memory."""


class DistributedFailure(Exception):
    """This process cannot go on with the others (a collective failed, or the gradients of a step
    could not be summed). Nothing more is saved: the newest complete checkpoint stands."""

    def __init__(self, message: str, exit_status: int = EXIT_PEER_LOST) -> None:
        super().__init__(message)
        self.exit_status = exit_status
