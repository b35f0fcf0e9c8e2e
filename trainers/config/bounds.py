"""The accepted range of every numeric setting, and the checks that refuse anything else.

One table serves the flag help (`--learning-rate ... (> 0 and <= 1)`), the flag parser (a number
typed where a whole number belongs) and `check_values` in trainers/run/resolve.py, which checks
the resolved settings (flags, saved run and defaults together) before anything is written.

Why these bounds:

* Counts (steps, epochs, batches, intervals) are whole numbers up to 2**31 - 1: far beyond any
  real run (two billion steps), and small enough that products such as steps x samples per step
  stay exact in the int64 tensors and numpy arrays that hold them. A larger value is a typo.
* The seed keys numpy's PCG64 (any integer >= 0), torch.Generator.manual_seed (at most
  2**64 - 1) and the dropout-mask hash (its low 32 bits), so [0, 2**64 - 1] is what every use
  accepts; seeds that differ only above bit 32 share dropout masks but not the data order.
* The learning rate is > 0 and <= 1: AdamW moves each weight by about lr per step and
  fine-tuning uses ~1e-5..1e-3, so a value above 1 is a typo that wrecks the pretrained weights
  in a step (1 itself is already far outside any useful range).
* Weight decay is in [0, 1]: AdamW multiplies each matrix by (1 - lr x decay) per step, which
  with both <= 1 never changes sign; typical values are 0.01..0.1.
* Ratios and probabilities: --min-lr-ratio in [0, 1], --dropout in [0, 1), Adam betas in [0, 1).
* Loss weights and --grad-clip are finite and >= 0 (--grad-clip 0: off); the two loss weights
  must not both be 0, or nothing is learned. Adam's eps (saved with a run, no flag) is in (0, 1].
* --lora-rank is 0 (full fine-tuning) to 4096; --lora-alpha is finite and > 0; --lora-dropout in [0, 1).
* Sampling at validation: --sample-temperature in [0, 100] (0: greedy; far above ~2 every code is about as
  likely, so a larger value is a typo), --sample-top-p in (0, 1] (1: off), --sample-top-k a count (0: off).
* --forgetting-limit is a finite fraction >= 0 (0: off; 0.1 allows a 10% rise over the base figure).
* --num-workers is at most 256: each worker is a process, more never speed up loading, and a
  typo would start thousands.
Every float must be finite: NaN compares false with every bound and would pass a plain `<` test.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable

MAX_COUNT = 2**31 - 1
MAX_SEED = 2**64 - 1
MAX_WORKERS = 256
MAX_LORA_RANK = 4096  # wider than any GPT's model_dim here: a larger rank is no low-rank adapter but a typo


@dataclass(frozen=True)
class Bound:
    kind: type  # int or float
    low: float
    high: float
    low_open: bool = False  # low itself is refused (> low)
    high_open: bool = False  # high itself is refused (< high)
    flag: bool = True  # typed as --name; False: only ever read from a saved run

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


def _count(low: int = 0) -> Bound:
    return Bound(int, low, MAX_COUNT)


def _finite(low: float = 0.0, high: float = math.inf, **kw: bool) -> Bound:
    return Bound(float, low, high, **kw)


BOUNDS: dict[str, Bound] = {
    "effective_batch": _count(1),
    "batch_size": _count(),
    "grad_accumulation": _count(),
    "epochs": _count(1),
    "max_steps": _count(),
    "learning_rate": _finite(0.0, 1.0, low_open=True),
    "warmup_steps": _count(),
    "lr_decay_steps": _count(),
    "min_lr_ratio": _finite(0.0, 1.0),
    "weight_decay": _finite(0.0, 1.0),
    "adam_beta1": _finite(0.0, 1.0, high_open=True, flag=False),
    "adam_beta2": _finite(0.0, 1.0, high_open=True, flag=False),
    "adam_eps": _finite(0.0, 1.0, low_open=True, flag=False),
    "grad_clip": _finite(),
    "text_loss_weight": _finite(),
    "mel_loss_weight": _finite(),
    "dropout": _finite(0.0, 1.0, high_open=True),
    "seed": Bound(int, 0, MAX_SEED),
    "train_samples": _count(),
    "num_workers": Bound(int, 0, MAX_WORKERS),
    "val_interval": _count(),
    "max_val_batches": _count(),
    "val_batch_size": _count(),
    "save_interval": _count(1),
    "keep_checkpoints": _count(),
    "log_interval": _count(1),
    "early_stop_patience": _count(),
    "forgetting_limit": _finite(),
    "sample_interval": _count(),
    "sample_temperature": _finite(0.0, 100.0),
    "sample_top_k": _count(),
    "sample_top_p": _finite(0.0, 1.0, low_open=True),
    "lora_rank": Bound(int, 0, MAX_LORA_RANK),
    "lora_alpha": _finite(0.0, low_open=True),
    "lora_dropout": _finite(0.0, 1.0, high_open=True),
    "new_rows_lr_scale": _finite(0.0, 1000.0, low_open=True),
}


# Flags of one invocation, never saved as settings (a re-warm's choice is saved in the LR schedule).
# --dist-timeout: seconds a torchrun process waits for the others; more than a week is a typo.
PLAN_BOUNDS: dict[str, Bound] = {
    "rewarm_lr": BOUNDS["learning_rate"],
    "rewarm_steps": _count(),
    "dist_timeout": _finite(0.0, 7 * 86400.0, low_open=True),
}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def setting_name(name: str) -> str:
    """How a message names a setting: its flag, or for settings without one, its saved key."""
    bound = BOUNDS.get(name)
    return flag_of(name) if bound is None or bound.flag else f"the setting {name} saved with the run"


def value_problems(values: dict[str, Any]) -> list[str]:
    """One message per numeric setting outside its range, naming the flag, the range and the value."""
    problems = [f"{setting_name(name)} must be {bound.describe()}, got {values[name]!r}"
                for name, bound in BOUNDS.items()
                if values.get(name) is not None and not bound.accepts(values[name])]  # None: not resolved yet
    text, mel = values.get("text_loss_weight"), values.get("mel_loss_weight")
    if text == 0 and mel == 0:
        problems.append("--text-loss-weight and --mel-loss-weight are both 0, so no loss is trained; give at least "
                        "one a weight > 0 (the defaults are 0.2 and 0.8)")
    return problems


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
