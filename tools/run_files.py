"""Finding checkpoints in a run directory, for the tools (export, plots) that read finished or running runs.

    latest.pth          the newest complete checkpoint (trainers/checkpoint/files.py)
    model_step{N}.pth   the last --keep-checkpoints checkpoints
    best.pth            the checkpoint with the best validation loss (written by the trainer from a
                        later version on; absent in older runs)
"""
from __future__ import annotations

import logging
from pathlib import Path

from trainers.checkpoint.files import CheckpointManager

BEST_NAME = "best.pth"


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, chosen as `--resume auto` does, without its log lines.

    That is latest.pth, unless a newer model_step{N}.pth exists (a kill between writing it and
    updating latest.pth). Resume's log messages speak of resuming, which would confuse a reader
    of a tool's output, so they are silenced here.
    """
    if not run_dir.is_dir():
        return None
    logger = logging.getLogger("trainers.checkpoint.files")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return CheckpointManager(run_dir, keep=0).find_resume()
    finally:
        logger.setLevel(level)


def step_checkpoints(run_dir: Path) -> dict[int, Path]:
    """The run's model_step{N}.pth files by step."""
    return dict(CheckpointManager(run_dir, keep=0).step_files())
