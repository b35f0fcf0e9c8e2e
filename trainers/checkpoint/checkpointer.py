"""Saving the run's components as one checkpoint, in the schema's sections, and loading them back.

The components are registered once under their section names; a save asks each for its
state_dict(), the schema assembles and validates the file, and `step_files.CheckpointManager`
writes it atomically and rotates old ones. A resume hands each component its section back,
in one call (`restore`), in the order the schema gives.
"""
from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from trainers.checkpoint import schema
from trainers.checkpoint.disk_space import DiskRoom
from trainers.checkpoint.save_mode import choose_save_mode
from trainers.checkpoint.snapshot import buffer_sizes
from trainers.checkpoint.step_files import CheckpointManager
from trainers.checkpoint.writer import CheckpointWriter
from trainers.errors import CheckpointWriteError, HostMemoryError, TrainingDiverged
from trainers.files import os_error_in_chain
from trainers.hardware.host_memory import host_memory
from trainers.torch_files import CheckpointEvent

log = logging.getLogger("train")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Checkpointer:
    """Saves the components, synchronously or in the background (trainers/checkpoint/writer.py: the file is
    assembled and checksummed in the writer thread too). A background write's error is raised as
    CheckpointWriteError at the next save, or at `wait()` / `close()`, which the trainer calls before it
    exits."""

    def __init__(self, run_dir: Path, keep: int, components: Mapping[str, Stateful], background: bool = False,
                 room: DiskRoom | None = None) -> None:
        missing = set(schema.SECTIONS) - set(components)
        if missing:
            raise ValueError(f"no component for checkpoint section(s) {sorted(missing)}")
        self.run_dir = Path(run_dir)
        self.files = CheckpointManager(self.run_dir, keep)
        self.components = dict(components)
        self.writer = CheckpointWriter(self.files, background=background, static=self._carried())
        self.room = room  # checked before each save: a disk that filled up since the start is warned about

    def save(self, step: int) -> None:
        """Save the checkpoint of `step` (see the class docstring for when it is complete).

        A checkpoint with a non-finite weight or optimizer value is never written (TrainingDiverged):
        it would replace, and rotation would then delete, the good ones before it.
        """
        self._submit(step, lambda state: self.files.save(state, step),
                     lambda path: log.info("saved checkpoint %s (step %d)", path, step))

    def save_best(self, step: int, metric: str, value: float) -> None:
        """Replace best.pth with the checkpoint of `step`, whose validation is the best so far."""
        self._submit(step, lambda state: self.files.save_best(state, step),
                     lambda path: log.info("saved %s: the best validation so far (step %d, %s %.4f)", path.name, step,
                                           metric, value))

    def apply_keep(self, step: int) -> None:
        """A resume with nothing to train, at `step`: the step files beyond --keep-checkpoints go, as at a save."""
        self.files.apply_keep(step)

    def restore(self, ckpt: schema.Checkpoint) -> None:
        """Load every section of `ckpt` into its component, in schema.RESTORE_ORDER: the one place a
        resume restores state. Whatever can refuse the checkpoint has run before (trainers/run/resume.py)."""
        for name in schema.RESTORE_ORDER:
            self.components[name].load_state_dict(ckpt.section(name))
        self.writer.static = list(self._carried())  # the restored ones: never copied at a save

    def _carried(self) -> Any:
        """The model's carried tensors (training never changes them): a background save does not copy them."""
        return getattr(self.components["model"], "carried", {}).values()

    def on_file_event(self, callback: CheckpointEvent) -> None:
        """Call `callback(event, step)` at each checkpoint file event (tmp_written, renamed, linked): for the
        fault-injection harness (trainers/faults.py), which kills the process mid-save."""
        self.files.on_event = callback

    def wait(self) -> None:
        """Until the save in flight is complete (CheckpointWriteError if it failed)."""
        self._as_write_error(self.writer.wait)

    wait_own = wait  # no agreement: under torchrun MainRankCheckpoints forwards it here (rank 0 writes)

    def finish_own_write(self) -> None:
        """On the way out after another error, before the newest checkpoint is named: the write in flight
        (e.g. rank 0's background write when a torchrun peer was lost) ends first; its failure is logged."""
        try:
            self.wait()
        except CheckpointWriteError as exc:
            log.error("%s", exc)

    def write_failed_step(self) -> int | None:
        """The step of a background write that has already ended with an error, without waiting (None: none
        has, or one is still going). `wait()` then raises that error."""
        return self.writer.failed_write_step

    def close(self) -> None:
        self._as_write_error(self.writer.close)

    def _submit(self, step: int, write: Callable[[dict], Path], done: Callable[[Path], None]) -> None:
        for name, component in self.components.items():
            bad = component.non_finite() if hasattr(component, "non_finite") else None
            if bad:
                raise TrainingDiverged(f"{name} tensor {bad} holds non-finite values, so step {step} is not saved")
        if self.room is not None:
            self.room.warn_if_short(step)
        sections = {name: c.state_dict() for name, c in self.components.items()}

        def assemble_and_write(copy: dict) -> Path:
            path = write(schema.assemble(copy))  # checksums too: off the training thread in the background mode
            done(path)
            if self.room is not None:
                self.room.written(path)
            return path

        try:
            self._as_write_error(lambda: self.writer.submit(sections, step, assemble_and_write))
        except HostMemoryError as exc:
            free = "free host memory (close other programs, lower --num-workers)"
            advice = (f"Pass --no-background-saves (a synchronous save holds the copy only while it writes) or {free}"
                      if self.writer.background else f"{free[0].upper()}{free[1:]} or use a machine with more RAM")
            newest = self.newest_name()
            kept = "no checkpoint was written before it" if newest == "none yet" else \
                f"the previous checkpoint ({newest}) is intact"
            raise HostMemoryError(
                f"not enough host memory (RAM) for the copy of the checkpoint of step {step}: {exc}. Nothing was "
                f"saved from step {step}; {kept}. {advice}, then continue with --resume auto --output-dir "
                f"{self.run_dir}") from None

    def snapshot_sizes(self) -> list[tuple[int, bool]]:
        """(bytes, pinned) of the host buffers a background save of the whole state takes, AdamW's moments
        included before its first step creates them."""
        sections = {name: c.state_dict() for name, c in self.components.items()}
        pin = self.writer.pin_memory
        sizes = buffer_sizes(sections, pin, self.writer.static)
        optim = self.components["optim"]
        to_come = optim.state_sizes_to_come() if hasattr(optim, "state_sizes_to_come") else []
        return sizes + [(n, device.type == "cuda" if pin is None else pin) for n, device in to_come]

    def fit_to_host_memory(self, loader_workers: int, trainers: int = 1) -> None:
        """Background saves only when their host copy fits in the host memory available now (pinned only when
        that fits too), said in one line when it does not; then the snapshot buffers are reserved, off the
        training thread. `trainers`: the trainer processes on this machine (torchrun's local world), with
        `loader_workers` data-loader processes in all. See trainers/checkpoint/save_mode.py."""
        if not self.writer.background:
            return
        gc.collect()  # what start-up dropped (a resumed checkpoint's host copy) is given back before measuring
        sizes = self.snapshot_sizes()
        mode = choose_save_mode(sizes, host_memory(), loader_workers, trainers)
        for line in mode.message.splitlines():
            (log.warning if not mode.background else log.info)("%s", line)
        self.writer.background = mode.background
        if mode.background:
            if not mode.pinned:
                self.writer.pin_memory = False
            self.writer.reserve_sizes([(n, p and mode.pinned) for n, p in sizes])

    def _as_write_error(self, call: Callable[[], Any]) -> Any:
        """`call()`, with an OS error in a write (disk full, permissions) raised as CheckpointWriteError."""
        try:
            return call()
        except (OSError, RuntimeError) as exc:  # torch's writer reports a failed write as a RuntimeError
            cause = os_error_in_chain(exc)
            if cause is None or isinstance(exc, (CheckpointWriteError, TrainingDiverged)):
                raise
            step = self.writer.failed_step
            raise CheckpointWriteError(
                f"could not write the checkpoint of step {step} in {self.run_dir}: {cause}. The previous checkpoint "
                f"({self.newest_name()}) is intact; free disk space or fix permissions, then continue with "
                f"--resume auto --output-dir {self.run_dir}") from None

    def newest_name(self) -> str:
        """The newest complete checkpoint, by its step file's name where there is one, for messages."""
        steps = self.files.step_files()
        newest = steps[-1][1] if steps else self.files.find_resume()
        return newest.name if newest else "none yet"
