"""Finding checkpoints in a run directory, for the tools (export, inspect, plots) that read finished or running runs.

    latest.pth          the newest complete checkpoint (trainers/checkpoint/step_files.py)
    model_step{N}.pth   the last --keep-checkpoints checkpoints
    best.pth            the checkpoint with the best validation loss (written by the trainer from a
                        later version on; absent in older runs)

`newest_intact_checkpoint` is the one `--resume auto` would continue (checksums verified, damaged newer
ones passed over), for the export.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from trainers.checkpoint.recovery import Found, NoIntactCheckpoint, newest_intact
from trainers.checkpoint.step_files import BEST_NAME, CheckpointManager
from trainers.errors import UserError
from trainers.torch_files import CheckpointError

STEP = re.compile(r"^(0|[1-9][0-9]*)$")
WHICH_HELP = "for a run directory: latest (default: the newest complete checkpoint), best, or a step number"


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, chosen as `--resume auto` does, without its log lines.

    That is latest.pth, unless a newer model_step{N}.pth exists (a kill between writing it and
    updating latest.pth). Resume's log messages speak of resuming, which would confuse a reader
    of a tool's output, so they are silenced here.
    """
    if not run_dir.is_dir():
        return None
    logger = logging.getLogger(CheckpointManager.__module__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return CheckpointManager(run_dir, keep=0).find_resume()
    finally:
        logger.setLevel(level)


def newest_intact_checkpoint(run_dir: Path) -> Found:
    """The checkpoint `--resume auto` would continue: the newest that reads and matches its checksums (tensors mapped,
    each one read once to verify it), with the damaged newer ones it passed over (`Found.damaged`: file, why).
    UserError when the run has no checkpoint or none is intact; nothing in the run directory is changed."""
    first = newest_checkpoint(run_dir)
    try:
        found = newest_intact(run_dir, first, mmap=True, quiet=True) if first is not None else None
    except NoIntactCheckpoint as exc:
        raise UserError("\n".join([f"{run_dir}: no intact checkpoint; tried, newest first:",
                                   *[f"  {path.name}: {why}" for path, why in exc.tried],
                                   "put an intact copy (from a backup) into the run directory"])) from None
    except CheckpointError as exc:  # a format this version does not read: not damage
        raise UserError(f"{exc.path}: {exc.reason}") from None
    if found is None:
        raise no_checkpoint(run_dir)
    return found


def no_checkpoint(run_dir: Path) -> UserError:
    return UserError(f"{run_dir} holds no checkpoint (no latest.pth or model_step*.pth); is it a run directory of this "
                     "trainer, and has the run saved its first checkpoint?")


def step_checkpoints(run_dir: Path) -> dict[int, Path]:
    """The run's model_step{N}.pth files by step."""
    return dict(CheckpointManager(run_dir, keep=0).step_files())


def checkpoint_path(target: Path, which: str | None) -> Path:
    """`target` itself if it is a file, else the checkpoint of run directory `target` that `which` names.

    which: None or "latest" (the newest complete checkpoint, as `--resume auto` picks it), "best"
    (best.pth) or a step number (model_step{N}.pth). Export and inspect both choose with this.
    """
    if target.is_file():
        if which is not None:
            raise UserError(f"--which {which} applies to a run directory; {target} is a file, which is read as it is")
        return target
    if not target.is_dir():
        raise UserError(f"{target}: no such run directory or checkpoint file")
    which = which or "latest"
    if which == "latest":
        found = newest_checkpoint(target)
        if found is None:
            raise no_checkpoint(target)
        return found
    if which == "best":
        best = target / BEST_NAME
        if not best.is_file():
            raise UserError(f"{target} has no {BEST_NAME}: runs written before the trainer kept the best checkpoint "
                            "do not have one; pass --which latest or --which STEP (a model_step{STEP}.pth) instead")
        return best
    if not STEP.match(which):
        raise UserError(f"--which {which!r}: expected latest, best or a step number such as 4000")
    steps = step_checkpoints(target)
    if int(which) not in steps:
        have = ", ".join(str(s) for s in sorted(steps)) or "none"
        raise UserError(f"{target} has no model_step{which}.pth (steps kept: {have}; older ones were deleted as "
                        "--keep-checkpoints allows)")
    return steps[int(which)]
