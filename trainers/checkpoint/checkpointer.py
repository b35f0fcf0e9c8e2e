"""Saving the run's components as one checkpoint, in the schema's sections.

The components are registered once under their section names; a save asks each for its
state_dict(), the schema assembles and validates the file, and `files.CheckpointManager`
writes it atomically and rotates old ones.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Protocol

from trainers.checkpoint import schema
from trainers.checkpoint.files import CheckpointEvent, CheckpointManager
from trainers.errors import CheckpointWriteError

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
        """Write the checkpoint of `step`; CheckpointWriteError (previous checkpoint intact) if it fails."""
        state = schema.assemble({name: c.state_dict() for name, c in self.components.items()})
        try:
            path = self.files.save(state, step)
        except OSError as exc:
            previous = self.files.find_resume()
            raise CheckpointWriteError(
                f"could not write the checkpoint of step {step} in {self.run_dir}: {exc}. The previous checkpoint "
                f"({previous.name if previous else 'none'}) is intact; free disk space or fix permissions, then "
                f"continue with --resume auto --output-dir {self.run_dir}") from None
        log.info("saved checkpoint %s (step %d)", path, step)
        return path
