"""How long a log line may be: at most LINE_LIMIT characters with its time and level (docs/cloud.md; every run of
the test suite is checked by tests/demo_runs.py), and a line said in several where it would be longer."""
from __future__ import annotations

import logging

LINE_LIMIT = 120
LINE_TEXT = LINE_LIMIT - len("2026-01-01 00:00:00 INFO ")  # what an INFO line has for its text: 95


def log_fitting(log: logging.Logger, line: str, *split: str) -> None:
    """`line` as one INFO line if it fits in LINE_TEXT, else the lines of `split`: for lines holding a value of the
    user's or the machine's of no fixed length (a list of manifests, a path, a GPU's name)."""
    for text in ([line] if len(line) <= LINE_TEXT else split):
        log.info("%s", text)
