"""What indextts-prepare tells its user: each skipped line as it is found, progress, and the closing summary.

Lines go to stderr (the summary to stdout), through tqdm's writer while the progress bar is drawn. The bar (a
terminal only) shows utterances/s and the time left; without a terminal a progress line is printed every
PROGRESS_SECONDS instead.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from trainers.tools.prepare.checks import REASONS
from trainers.tools.prepare.inputs import Problem

PROGRESS_SECONDS = 30.0


def say(line: str) -> None:
    """A line on stderr, above the bar when one is drawn."""
    tqdm.write(line, file=sys.stderr)


def warn(line: str) -> None:
    say(f"warning: {line}")


@dataclass
class Progress:
    """The bar over the utterances this process makes (or the periodic line without a terminal)."""

    total: int
    bar: Any = None
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    last_line: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.bar = tqdm(total=self.total, unit="utt", desc="prepare", disable=None, dynamic_ncols=True,
                        file=sys.stderr)

    def advance(self, count: int) -> None:
        self.done += count
        self.bar.update(count)
        now = time.monotonic()
        if self.bar.disable and now - self.last_line >= PROGRESS_SECONDS and self.done < self.total:
            self.last_line = now
            rate = self.done / max(now - self.started, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else 0
            say(f"prepared {self.done}/{self.total} utterances, {rate:.1f} utt/s, about {_duration(left)} left")

    def close(self) -> None:
        self.bar.close()


def command_lines(program: str, args: list[str]) -> list[str]:
    """A command as shell lines: each flag with its value on a line, continued by backslashes."""
    parts: list[str] = [program]
    for arg in args:
        if arg.startswith("--") or len(parts) == 1:
            parts.append(arg)
        else:
            parts[-1] += f" {arg}"
    return [("  " if i == 0 else "    ") + part + (" \\" if i < len(parts) - 1 else "") for i, part in enumerate(parts)]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def skipped_counts(problems: list[Problem]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in problems:
        counts[p.reason] = counts.get(p.reason, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def skipped_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{REASONS.get(reason, reason)} {n}" for reason, n in counts.items())
