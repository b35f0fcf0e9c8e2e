"""Waiting for asynchronous collectives (NCCL's) in Python, so that a hang or an error ends the process
with exit 6 and its message instead of NCCL's watchdog aborting it (SIGABRT).

A NCCL all-reduce is asynchronous to the host: the call only enqueues a kernel. A process whose peer
hangs or died then blocks at the next CUDA synchronisation, inside C++, where neither the deadline
of the process group nor a stop signal reaches Python; NCCL's watchdog thread eventually tears the
process down with SIGABRT. `await_works` instead polls the works of the gradient sum from Python:

* all done: `wait()` on each, which raises the error of a failed one (NCCL's remote error, gloo's
  "Connection closed by peer") as a RuntimeError -> DistributedFailure (exit 6);
* not done after `timeout_s` (--dist-timeout): DistributedFailure naming what and how long;
* a stop signal arrived and the works are still not done `SIGNAL_GRACE_S` later: the peers are not
  coming (torchrun sends SIGTERM to every worker as soon as one of them died; healthy peers reach
  the gradient sum within moments) -> DistributedFailure, before torchrun's SIGKILL (default 30 s).

Gloo's works are complete when DDP's backward returns (its futures block the host), so on the CPU
this returns at once; the torchrun tests run it that way, tests/test_collectives.py forces the
asynchronous case with a real gloo work whose peer never joins.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from trainers.errors import DistributedFailure

log = logging.getLogger("train")

SIGNAL_GRACE_S = 20.0  # under torchrun's default --shutdown-timeout (30 s), after which it SIGKILLs
WARN_AFTER_S = 60.0  # one warning line when a wait takes this long (or half the timeout, if shorter)


def await_works(works: Sequence[Any], what: str, timeout_s: float, stop: Any = None) -> None:
    """Block until every work is complete, polling; raise DistributedFailure on an error, after
    `timeout_s`, or `SIGNAL_GRACE_S` after a stop signal (`stop.requested`) while still waiting."""
    start, pending, nap, signalled, warned = time.monotonic(), list(works), 0.0002, None, False
    while pending:
        pending = [w for w in pending if not w.is_completed()]
        if not pending:
            break
        now = time.monotonic()
        waited = now - start
        if waited >= timeout_s:
            raise DistributedFailure(
                f"no answer from the other processes for {waited:.0f} s during {what} (--dist-timeout {timeout_s:g}): "
                "another process is stuck (a hung GPU or NCCL) or was stopped; this process stops without saving "
                "anything more")
        if stop is not None and stop.requested:
            signalled = now if signalled is None else signalled
            if now - signalled >= SIGNAL_GRACE_S:
                raise DistributedFailure(
                    f"a stop signal came during {what}, and the other processes did not answer in the "
                    f"{SIGNAL_GRACE_S:g} s after it: one of them died (torchrun then signals every worker) or hangs; "
                    "this process stops without saving anything more")
        if not warned and waited >= min(WARN_AFTER_S, timeout_s / 2):
            warned = True
            log.warning("waiting %.0f s for the other processes during %s; this process gives up and exits 6 after "
                        "--dist-timeout %g s", waited, what, timeout_s)
        time.sleep(nap)
        nap = min(nap * 2, 0.005)  # a few polls per millisecond at first: a healthy sum ends within moments
    for work in works:
        try:
            work.wait()
        except RuntimeError as exc:  # torch.distributed.DistBackendError is one
            raise DistributedFailure(lost_contact(what, exc)) from None


def lost_contact(what: str, exc: BaseException) -> str:
    """The message of a collective that failed: what it was doing and the backend's first line."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (f"lost contact with the other processes of this run during {what} ({type(exc).__name__}: {first}). "
            "Another process failed, was killed or stopped answering (see its messages and torchrun's report); this "
            "process stops without saving anything more")
