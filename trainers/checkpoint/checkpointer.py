"""Saving the run's components as one checkpoint, in the schema's sections.

The components are registered once under their section names; a save asks each for its
state_dict(), the schema assembles and validates the file, and `files.CheckpointManager`
writes it atomically and rotates old ones.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from trainers.checkpoint import schema
from trainers.checkpoint.files import CheckpointEvent, CheckpointManager, os_error_in_chain
from trainers.checkpoint.writer import CheckpointWriter
from trainers.errors import CheckpointWriteError, TrainingDiverged

log = logging.getLogger("train")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...


class Checkpointer:
    """Saves the components, synchronously or in the background (trainers/checkpoint/writer.py).

    In the background mode the loop is blocked only while the state is copied to host memory; the
    file is assembled, checksummed and written (atomically, latest.pth moving only once it is
    complete) in a writer thread while training goes on. A second save waits for the first. An
    error of a background write is raised as CheckpointWriteError at the next save, or at `wait()`
    / `close()`, which the trainer calls before it exits.
    """

    def __init__(self, run_dir: Path, keep: int, components: Mapping[str, Stateful],
                 on_event: CheckpointEvent | None = None, background: bool = False) -> None:
        missing = set(schema.SECTIONS) - set(components)
        if missing:
            raise ValueError(f"no component for checkpoint section(s) {sorted(missing)}")
        self.run_dir = Path(run_dir)
        self.files = CheckpointManager(self.run_dir, keep, on_event)
        self.components = dict(components)
        carried = getattr(self.components["model"], "carried", {})
        self.writer = CheckpointWriter(self.files, background=background, static=carried.values())

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

    def wait(self) -> None:
        """Until the save in flight is complete (CheckpointWriteError if it failed)."""
        self._mapped(self.writer.wait)

    def close(self) -> None:
        self._mapped(self.writer.close)

    def _submit(self, step: int, write: Callable[[dict], Path], done: Callable[[Path], None]) -> None:
        for name, component in self.components.items():
            bad = component.non_finite() if hasattr(component, "non_finite") else None
            if bad:
                raise TrainingDiverged(f"{name} tensor {bad} holds non-finite values, so step {step} is not saved")
        sections = {name: c.state_dict() for name, c in self.components.items()}

        def assemble_and_write(copy: dict) -> Path:
            path = write(schema.assemble(copy))  # checksums too: off the training thread in the background mode
            done(path)
            return path

        self._mapped(lambda: self.writer.submit(sections, step, assemble_and_write))

    def _mapped(self, call: Callable[[], Any]) -> Any:
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
