"""Turn SIGINT/SIGTERM into a request to stop at the next optimizer-step boundary.

The first signal lets the current step finish, so the trainer can save a checkpoint and exit
with a documented status. A second signal abandons the step at once (KeyboardInterrupt);
the last complete checkpoint on disk is untouched.
"""
from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field
from types import FrameType

log = logging.getLogger(__name__)

EXIT_SIGINT = 130  # 128 + SIGINT, the shell convention
EXIT_SIGTERM = 143  # 128 + SIGTERM


@dataclass
class StopRequest:
    signum: int | None = None
    _previous: dict[int, object] = field(default_factory=dict)

    def install(self) -> "StopRequest":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_status(self) -> int:
        return EXIT_SIGTERM if self.signum == signal.SIGTERM else EXIT_SIGINT

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            log.warning("second stop signal: abandoning the current step; the last saved checkpoint is intact")
            raise KeyboardInterrupt
        self.signum = signum
        log.warning(
            "received %s: finishing the current optimizer step, then saving a checkpoint and exiting "
            "(send it again to abandon the step without saving)",
            signal.Signals(signum).name,
        )


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """For data-loading workers: a terminal's Ctrl-C reaches the whole process group, and the
    main process alone decides when to stop (it shuts its workers down itself)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
