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
from trainers.errors import CheckpointWriteError, TrainingDiverged

log = logging.getLogger("train")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int, components: Mapping[str, Stateful],
                 on_event: CheckpointEvent | None = None) -> None:
        missing = set(schema.SECTIONS) - set(components)
        if missing:
            raise ValueError(f"no component for checkpoint section(s) {sorted(missing)}")
        self.run_dir = Path(run_dir)
        self.files = CheckpointManager(self.run_dir, keep, on_event)
        self.components = dict(components)

    def save(self, step: int) -> Path:
        """Write the checkpoint of `step`; CheckpointWriteError (previous checkpoint intact) if it fails.

        A checkpoint with a non-finite weight or optimizer value is never written (TrainingDiverged):
        it would replace, and rotation would then delete, the good ones before it.
        """
        path = self._write(step, lambda state: self.files.save(state, step))
        log.info("saved checkpoint %s (step %d)", path, step)
        return path

    def save_best(self, step: int, metric: str, value: float) -> Path:
        """Replace best.pth with the checkpoint of `step`, whose validation is the best so far."""
        path = self._write(step, lambda state: self.files.save_best(state, step))
        log.info("saved %s: the best validation so far (step %d, %s %.4f)", path.name, step, metric, value)
        return path

    def _write(self, step: int, write: Callable[[dict], Path]) -> Path:
        for name, component in self.components.items():
            bad = component.non_finite() if hasattr(component, "non_finite") else None
            if bad:
                raise TrainingDiverged(f"{name} tensor {bad} holds non-finite values, so step {step} is not saved")
        state = schema.assemble({name: c.state_dict() for name, c in self.components.items()})
        try:
            return write(state)
        except (OSError, RuntimeError) as exc:  # torch's writer reports a failed write as a RuntimeError
            cause = os_error_in_chain(exc)
            if cause is None:
                raise
            raise CheckpointWriteError(
                f"could not write the checkpoint of step {step} in {self.run_dir}: {cause}. The previous checkpoint "
                f"({self.newest_name()}) is intact; free disk space or fix permissions, then continue with "
                f"--resume auto --output-dir {self.run_dir}") from None

    def newest_name(self) -> str:
        """The newest complete checkpoint, by its step file's name where there is one, for messages."""
        steps = self.files.step_files()
        newest = steps[-1][1] if steps else self.files.find_resume()
        return newest.name if newest else "none yet"
