"""best.pth and early stopping on it, two validation listeners (trainers/training/validation_listeners.py).

best.pth is the checkpoint of the best validation so far, compared across resumes too. A validation that lacks the
--best-metric (a gen/* metric where nothing was generated) is not compared and counts for nothing, early stopping
included; one that is not `eligible` (the forgetting guard's) counts as one without a new best. Early stopping
(--early-stop-patience N) ends the run after N validations in a row without a new best.
"""
from __future__ import annotations

import logging
import math
from typing import Any

from trainers.training.forgetting import higher_is_better
from trainers.training.validation_listeners import Validation, ValidationListener

log = logging.getLogger("train")


class BestCheckpoint(ValidationListener):
    """The best validation so far (the "best" entry of the progress section) and best.pth."""

    key = "best"

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.best: dict[str, Any] | None = None  # absent in files written before best.pth existed

    def improves(self, value: float) -> bool:
        """Whether a validation's value beats the best one (a best of another metric is compared no more)."""
        if self.best is None or self.best["metric"] != self.metric:
            return True
        return value > self.best["value"] if higher_is_better(self.metric) else value < self.best["value"]

    def validated(self, v: Validation) -> None:
        if self.metric in v.means:
            v.improved = v.eligible and self.improves(v.means[self.metric])
            if v.improved:
                self.best = {"metric": self.metric, "value": v.means[self.metric], "step": v.step}
        v.best = self.best

    def settled(self, v: Validation) -> None:
        if v.improved:  # written after every listener's state of this validation is what it will be
            v.save_best(v.step, self.metric, v.means[self.metric])

    def state_dict(self) -> dict[str, Any] | None:
        return dict(self.best) if self.best else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.best = dict(state) if state else None


class EarlyStopping(ValidationListener):
    """--early-stop-patience: the validations in a row without a new best (the "stale_validations" entry)."""

    key = "stale_validations"

    def __init__(self, patience: int, best: BestCheckpoint) -> None:
        self.patience = patience
        self.of = best
        self.stale = 0  # absent before early stopping: 0

    def spent(self) -> bool:
        return self.patience > 0 and self.stale >= self.patience

    def validated(self, v: Validation) -> None:
        if v.improved is not None:
            self.stale = 0 if v.improved else self.stale + 1

    def stop(self, v: Validation) -> str | None:
        if not self.spent():
            return None
        best = v.best or {}
        return "\n".join([
            f"early stop at step {v.step}: {self.stale} validations without a better {self.of.metric} "
            f"(--early-stop-patience {self.patience})",
            f"best.pth holds step {best.get('step')}, the best {self.of.metric}: {best.get('value', math.nan):.4f}",
            "to train on, resume with a larger --early-stop-patience"])

    def halted(self, step: int) -> str | None:
        best = self.of.best
        if best is not None and best["metric"] != self.of.metric and self.stale:
            log.info("--best-metric is now %s (was %s): early stopping counts its validations from 0", self.of.metric,
                     best["metric"])
            self.stale = 0
        if not self.spent():
            return None
        return (f"the run stopped early at step {step} after {self.stale} validations without a new best\n"
                "to continue, pass a larger --early-stop-patience")

    def state_dict(self) -> int:
        return self.stale

    def load_state_dict(self, state: int | None) -> None:
        self.stale = int(state or 0)
