"""Numeric ranges (`Bound`) and the checks that refuse anything else.

Each numeric setting declares its range where it is declared (trainers/config/settings.py, flags.py); one
Bound serves the flag help (`--learning-rate ... (> 0 and <= 1)`), the flag parser (a number typed where a
whole number belongs) and the check of the resolved settings (flags, saved run and defaults together) before
anything is written, so a value saved with a run is held to the same range.

Why these bounds in general:

* Counts (steps, epochs, batches, intervals) are whole numbers up to 2**31 - 1: far beyond any
  real run (two billion steps), and small enough that products such as steps x samples per step
  stay exact in the int64 tensors and numpy arrays that hold them. A larger value is a typo.
* The learning rate is > 0 and <= 1: AdamW moves each weight by about lr per step and
  fine-tuning uses ~1e-5..1e-3, so a value above 1 is a typo that wrecks the pretrained weights
  in a step (1 itself is already far outside any useful range).
* Every float must be finite: NaN compares false with every bound and would pass a plain `<` test.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable

MAX_COUNT = 2**31 - 1
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Bound:
    kind: type  # int or float
    low: float
    high: float
    low_open: bool = False  # low itself is refused (> low)
    high_open: bool = False  # high itself is refused (< high)
    hint: Callable[[float], str] | None = None  # what to pass instead of a finite value above the range, from it

    def advice(self, value: Any) -> str | None:
        """The hint for a finite number above the range (a percentage typed for a fraction, say), else None."""
        above = isinstance(value, (int, float)) and type(value) is not bool and self.high < value < math.inf
        return self.hint(value) if self.hint and above else None

    def accepts(self, value: Any) -> bool:
        if type(value) is bool or not isinstance(value, (int, float)):
            return False
        if self.kind is int and type(value) is not int:
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """The range in words: 'a whole number from 1 to 2147483647', 'a finite number > 0 and <= 1'."""
        if self.kind is int:
            return f"a whole number from {_int_text(self.low)} to {_int_text(self.high)}"
        low = f"{'>' if self.low_open else '>='} {_num_text(self.low)}"
        if math.isinf(self.high):
            return f"a finite number {low}"
        return f"a finite number {low} and {'<' if self.high_open else '<='} {_num_text(self.high)}"

    def range_text(self) -> str:
        """The range for --help, e.g. '>= 1', '0..2**64-1' or '> 0 and <= 1'."""
        if self.kind is int:
            # The cap of counts only stops typos; --help shows the useful part.
            if self.high == MAX_COUNT:
                return f">= {_int_text(self.low)}"
            return f"{_int_text(self.low)}..{_int_text(self.high)}"
        return self.describe().removeprefix("a finite number ")


def _int_text(value: float) -> str:
    value = int(value)
    return {MAX_SEED: "2**64-1", MAX_COUNT: "2**31-1"}.get(value, str(value))


def _num_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def count(low: int = 0) -> Bound:
    return Bound(int, low, MAX_COUNT)


def finite(low: float = 0.0, high: float = math.inf, **kw: bool) -> Bound:
    return Bound(float, low, high, **kw)


LEARNING_RATE = finite(0.0, 1.0, low_open=True)


# --- argparse types: the value's form; its range is checked with the other settings ------------------

def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number (digits only, like 500), got {text!r}") from None


def real_number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (like 0.001 or 1e-3), got {text!r}") from None


def bounded_number(bound: Bound) -> Callable[[str], int | float]:
    """An argparse type for a flag checked at once: its form, then its range."""
    def parse(text: str) -> int | float:
        value = (whole_number if bound.kind is int else real_number)(text)
        if not bound.accepts(value):
            raise argparse.ArgumentTypeError(f"must be {bound.describe()}, got {text!r}")
        return value
    return parse


def parses_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
