"""Turn SIGINT, SIGTERM and SIGHUP into a request to stop at the next optimizer-step boundary.

SIGHUP is what a closing SSH session or studio terminal sends, so it is treated like SIGTERM.
Before training starts there is nothing to save, but raising from a signal handler in the middle
of an import (torch, numpy, torch.distributed) can leave half-imported modules behind, crash in
C++ or be swallowed by the import machinery; so during start-up the first signal is only noted
(`EarlySignals` before the imports, `StopRequest` after them) and start-up stops at its next
safe point (`StopRequest.check`); a second one stops at once. During training the first signal
lets the current step finish, so the trainer can save a checkpoint and exit with 128 + the
signal number; a second one abandons the step at once (`StopNow`), leaving the last complete
checkpoint on disk untouched.
"""
from __future__ import annotations

import logging
import signal
import os
from dataclasses import dataclass, field
from types import FrameType

log = logging.getLogger("train")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopNow(BaseException):
    """A stop signal that cannot wait for a step boundary (BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


@dataclass
class EarlySignals:
    """Stop signals that arrive before the trainer's imports are done: noted, never raised; a second one
    exits with os._exit, since before main() there is no frame that could catch a `StopNow`."""

    received: list[int] = field(default_factory=list)

    def install(self) -> "EarlySignals":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.received:  # asked twice: nothing was trained or written yet, so leave at once
            os._exit(128 + signum)
        self.received.append(signum)


@dataclass
class StopRequest:
    signum: int | None = None
    training: bool = False  # False: a signal stops at once; True: at the next step boundary
    _previous: dict[int, object] = field(default_factory=dict)

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
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
        return 128 + (self.signum or signal.SIGTERM)

    def check(self) -> None:
        """A safe point of start-up: stop here if a signal was noted."""
        if not self.training and self.signum is not None:
            raise StopNow(self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.training:
            if self.signum is not None:
                raise StopNow(signum)
            self.signum = signum
            log.warning("received %s during start-up: stopping before training (send it again to stop at once)",
                        name)
            return
        if self.signum is not None:
            log.warning("second stop signal (%s): abandoning the step; the last saved checkpoint is intact", name)
            raise StopNow(signum)
        self.signum = signum
        log.warning("received %s: finishing the current optimizer step, then saving a checkpoint and exiting", name)
        log.warning("(send it again to abandon the step without saving)")


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """For data-loading workers: a terminal's Ctrl-C reaches the whole process group, and the
    main process alone decides when to stop (it shuts its workers down itself). For the trainer
    once its exit status is decided (trainers/training/process_exit.py)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
