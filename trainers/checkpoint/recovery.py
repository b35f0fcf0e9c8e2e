"""`--resume auto` past damaged checkpoints: the newest intact one, the damaged ones moved aside, never deleted.

A checkpoint that cannot be read, is truncated, or fails its checksums (trainers/checkpoint/integrity.py)
must not block a run that still has an intact older checkpoint, nor be silently resumed. The
candidates, newest first, are the file `CheckpointManager.find_resume` picks, then every other
`model_step{N}.pth` by step, then `latest.pth` if it is a file of its own (keep 0). Each file is
read once, however many names it has: `latest.pth` is normally a hard link to the newest step file,
so when one of them is damaged both are.

When an intact one is found, each damaged file is renamed `NAME.corrupt` (`NAME.corrupt-2`, ... if
taken) in the run directory, its bytes kept, so that resume and rotation no longer see it; a
`latest.pth` that referred to damaged data is pointed at the intact file (the data stays under the
step file's new name; a `latest.pth` that was the only name of its data is renamed aside too).
When none is intact nothing is renamed (the run directory is left exactly as it was) and the
resume stops, listing every file tried and why it failed.

Finding the checkpoint only reads files (it runs before any model is built and before the run
directory is locked); moving the damaged ones aside (`set_aside`) waits for the lock, so a resume that
is refused later, or a second trainer, changes nothing. A checkpoint written in a format newer than
this trainer reads is not damaged: the resume stops instead of falling back.

`repair_latest` points a `latest.pth` left behind (a kill between a save's rename and its link) at the step
file the resume chose, also when the run has nothing left to train; the tools find the same checkpoint with
`newest_intact(..., mmap=True, quiet=True)` (trainers/tools/run_files.py) and move nothing.
"""
from __future__ import annotations

import logging
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from trainers.checkpoint import schema
from trainers.checkpoint.step_files import CheckpointManager, distinct_files
from trainers.errors import UserError
from trainers.files import file_identity, fsync_dir
from trainers.torch_files import CheckpointError

log = logging.getLogger("train")

ASIDE_SUFFIX = ".corrupt"


class NoIntactCheckpoint(UserError):
    """Every checkpoint of the run directory is damaged (exit 2)."""

    def __init__(self, message: str, tried: list[tuple[Path, str]]) -> None:
        super().__init__(message)
        self.tried = tried  # (file, why), newest first


@dataclass(frozen=True)
class Damaged:
    path: Path
    reason: str
    moved_to: list[Path] = field(default_factory=list)  # the new names of its data's names in the run directory


@dataclass(frozen=True)
class Found:
    checkpoint: schema.Checkpoint
    path: Path
    damaged: list[tuple[Path, str]]  # newer files that failed, and why: for set_aside()


def newest_intact(run_dir: Path, first: Path | None = None, mmap: bool = False, quiet: bool = False) -> Found | None:
    """The newest checkpoint of `run_dir` that reads and verifies (None: the run has none).

    `first` is the file `find_resume` chose, when the caller already asked. Each damaged file newer
    than the one returned gets a WARNING saying which and why (not with `quiet`: a tool says it in its
    own words, from `Found.damaged`); nothing is renamed here. `mmap`: tensors mapped, not read into
    memory (the checksums still read every one), for a tool that reads the checkpoint it exports.
    """
    manager = CheckpointManager(run_dir, keep=0)
    first = first or manager.find_resume()
    if first is None:
        return None
    tried: list[tuple[Path, str]] = []
    steps = [path for _, path in reversed(manager.step_files())]
    for path in distinct_files([Path(first), *steps, manager.latest_path()]):  # the module's order
        try:
            ckpt = schema.read(path, mmap=mmap, verify=True)
        except schema.UnknownFormat:
            raise
        except CheckpointError as exc:
            if not quiet:
                log.warning("checkpoint %s in %s is damaged and cannot be resumed:", described(run_dir, path),
                            manager.run_dir)
                for line in textwrap.wrap(exc.reason, 88):  # it may quote torch's own error at length
                    log.warning("  %s", line)
            tried.append((path, exc.reason))
            continue
        if tried and not quiet:
            log.warning("--resume auto: resuming from %s, the newest intact checkpoint,", path.name)
            log.warning("instead of the damaged %s;", ", ".join(p.name for p, _ in tried))
            log.warning("the steps after it are trained again (with the same result)")
        return Found(ckpt, path, tried)
    lines = [f"--resume auto: no intact checkpoint in {run_dir}; tried, newest first:",
             *[f"  {described(run_dir, p)}: {reason}" for p, reason in tried],
             "Nothing was renamed or deleted. Put an intact copy (from a backup) into the run directory, pass "
             "--resume PATH of one, or start a new run with another --output-dir"]
    raise NoIntactCheckpoint("\n".join(lines), tried)


def described(run_dir: Path, path: Path) -> str:
    """`latest.pth (= model_step40.pth)` for a name shared with a step file of `run_dir`, else the name."""
    twins = [p.name for p in _names_of(CheckpointManager(run_dir, keep=0), file_identity(path)) if p != path]
    return f"{path.name} (= {', '.join(twins)})" if twins else path.name


def _names_of(manager: CheckpointManager, ident: tuple[int, int] | None) -> list[Path]:
    """The step files and latest.pth in the run directory that name the file `ident`."""
    names = [path for _, path in manager.step_files()] + [manager.latest_path()]
    return [p for p in names if ident is not None and file_identity(p) == ident]


def set_aside(run_dir: Path, damaged: list[tuple[Path, str]], intact: Path) -> list[Damaged]:
    """Rename the damaged files `newest_intact` found and point latest.pth at `intact`. Hold the run's lock."""
    if not damaged:
        return []
    manager, tried = CheckpointManager(run_dir, keep=0), damaged
    # Every name is resolved before anything is renamed or relinked.
    latest = manager.latest_path()
    latest_ident = file_identity(latest)
    plan = []
    for path, reason in tried:
        ident = file_identity(path)
        steps = [p for p in _names_of(manager, ident) if p != latest]
        plan.append((path, reason, ident, steps))
    latest_is_bad = latest_ident is not None and any(ident == latest_ident for _, _, ident, _ in plan)
    # A latest.pth that is the only name of its data is moved aside like a step file; one that is a second
    # name (hard link) or a symlink is pointed at the intact file, the data staying under its step file's name.
    latest_alone = latest_is_bad and not latest.is_symlink() and os.stat(latest).st_nlink == 1
    damaged = []
    try:
        moved_latest = _move_aside(latest) if latest_alone else None
        if latest_is_bad:
            manager.point_latest_at(intact)
            log.warning("%s now refers to %s", latest.name, intact.name)
        for path, reason, ident, steps in plan:
            moved = [_move_aside(p) for p in steps]
            if moved_latest is not None and ident == latest_ident:
                moved.append(moved_latest)
            damaged.append(Damaged(path, reason, moved))
    except OSError as err:
        raise UserError(f"could not move a damaged checkpoint in {manager.run_dir} aside ({err}); move the "
                        "checkpoints named above out of the run directory yourself, then resume again") from None
    fsync_dir(manager.run_dir)
    return damaged


def repair_latest(run_dir: Path, resumed: Path) -> None:
    """Point latest.pth at `resumed`, the newest complete checkpoint `--resume auto` chose, where it names an
    older one (a kill between a save's rename and its link) or none. Every reader of latest.pth (export, inspect,
    the experiment API) then reads what a resume reads, also when the resume finds nothing left to train.
    Call after every refusal, holding the run's lock; a `resumed` that is not a step file of `run_dir` is left."""
    manager = CheckpointManager(run_dir, keep=0)
    if resumed.parent.resolve() != manager.run_dir.resolve() or resumed.name not in [p.name for _, p in
                                                                                   manager.step_files()]:
        return
    latest = manager.latest_path()
    if file_identity(latest) == file_identity(resumed):
        return
    before = _described_latest(manager)
    try:
        manager.point_latest_at(resumed)
    except OSError as err:
        raise UserError(f"could not point {latest} at {resumed.name}, the newest complete checkpoint ({err}); fix the "
                        "run directory's permissions or free disk space, then resume again (nothing was trained)"
                        ) from None
    log.info("%s %s, behind %s (a save stopped before its link)", latest.name, before, resumed.name)
    log.info("%s now refers to %s", latest.name, resumed.name)


def _described_latest(manager: CheckpointManager) -> str:
    latest = manager.latest_path()
    if not os.path.lexists(latest):
        return "was missing"
    twins = [p.name for p in _names_of(manager, file_identity(latest)) if p != latest]
    return f"named {twins[0]}" if twins else ("was a dangling symlink" if not latest.exists() else "named another file")


def _move_aside(path: Path) -> Path:
    target, n = path.with_name(path.name + ASIDE_SUFFIX), 1
    while os.path.lexists(target):
        n += 1
        target = path.with_name(f"{path.name}{ASIDE_SUFFIX}-{n}")
    os.rename(path, target)
    log.warning("renamed the damaged %s to %s: its bytes are kept,", path.name, target.name)
    log.warning("and resume and rotation no longer see it; delete it once you no longer need it")
    return target
