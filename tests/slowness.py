"""Timeouts of process tests, scaled by how slow this machine is right now.

A process test waits a bounded time for a trainer, torchrun or a script, so that a hang fails instead of
blocking the suite. The bounds were set on an idle 2-core machine; a loaded CI machine runs everything
several times slower, and a fixed bound would fail a correct run there. `scaled(seconds)` multiplies a bound
by the slowness measured once per test session: a fixed small CPU workload (torch on one thread and plain
Python, as the trainer does) timed here against its time on the idle reference machine, never below 1.
INDEXTTS_TEST_SLOWNESS=F sets the factor instead (e.g. 4 on a machine known to be that much slower).
"""
from __future__ import annotations

import functools
import os
import statistics
import time

import torch

ENV_VAR = "INDEXTTS_TEST_SLOWNESS"
REFERENCE_S = 0.1  # the workload below on an idle 2-core x86_64 VM (about the fastest of 12 runs on the shared VM)


def _workload() -> float:
    """Seconds for a fixed mix of small one-thread torch ops and interpreted Python."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.perf_counter()
        x = torch.ones(64, 64)
        for _ in range(1500):
            x = torch.tanh(x @ x * 0.01)
        total = 0
        for i in range(1_000_000):
            total += i * i % 7
        return time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)


@functools.cache
def factor() -> float:
    """How many times slower than the reference machine this one runs now (>= 1), measured once."""
    given = os.environ.get(ENV_VAR)
    if given:
        return max(1.0, float(given))
    return max(1.0, statistics.median(_workload() for _ in range(3)) / REFERENCE_S)


def scaled(seconds: float) -> float:
    """A timeout of `seconds` on the idle reference machine, for this machine as loaded as it is now."""
    return seconds * factor()
