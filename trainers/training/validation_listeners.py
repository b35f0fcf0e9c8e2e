"""What acts on validations: the loop validates and hands a `Validation` to the run's listeners, in order (the
list: trainers/run/listeners.py). A listener is one feature (best.pth, early stopping, the forgetting guard,
generation at validation); it sees the record, not the run, and adding one leaves the loop as it is.

At a validation each listener's `validated(v)` runs in list order: it updates its state and may add to `v` what
later ones judge (metrics of its own, `eligible`, `improved`). Then `settled(v)` and `stop(v)` run in reverse
order, as nested with-blocks unwind: those that measured first act on the verdicts of those after them (best.pth
holds every listener's state of the validation; the sample set is written after it). The first reason `stop`
gives ends the run. `halted(step)` (reverse order): why a resumed run has nothing to train; `step_done(step)`:
after each optimizer step. Each owns its state (`state_dict` / `load_state_dict`), saved under its `key` in the
checkpoint's progress section; a checkpoint written before it existed hands it None.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from trainers.faults import Faults
from trainers.training.train_log import StepMetrics


@dataclass
class Validation:
    """One validation, as the loop hands it to the listeners; earlier listeners add to it."""

    step: int
    final: bool  # the validation at the end of the run
    by_lang: dict[str, StepMetrics]  # the loss sums of each validation language
    means: dict[str, float]  # over all languages: text_loss, mel_loss, mel_top1, and what listeners add (gen/*)
    log: Any  # the run's TrainLog (trainers/training/train_log.py; QuietLog under torchrun but on rank 0)
    faults: Faults  # fault points inside a listener's work (tests)
    save_best: Callable[[int, str, float], None]  # write best.pth: step, metric, value
    again: Callable[[], dict[str, StepMetrics]]  # the validation's loss pass again, on the weights as they are now
    eligible: bool = True  # may be best.pth (False: past the forgetting guard's limit, or not judged by it)
    improved: bool | None = None  # a new best, best.pth this validation's (None: it lacks the --best-metric)
    best: dict[str, Any] | None = None  # the best validation after this one: {"metric", "value", "step"}


class ValidationListener:
    """A listener that does nothing: subclasses override what they act on."""

    key: str | None = None  # its entry in the checkpoint's progress section (None: it has no state)

    def validated(self, v: Validation) -> None:
        pass

    def settled(self, v: Validation) -> None:
        pass

    def stop(self, v: Validation) -> str | None:
        return None

    def halted(self, step: int) -> str | None:
        return None

    def step_done(self, step: int) -> None:
        pass

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass


class Listeners:
    """The run's listeners, in order (see the module's docstring)."""

    def __init__(self, listeners: list[ValidationListener] | None = None) -> None:
        self.listeners = list(listeners or [])

    def __iter__(self) -> Iterator[ValidationListener]:
        return iter(self.listeners)

    def validated(self, v: Validation) -> None:
        for listener in self.listeners:
            listener.validated(v)
        for listener in reversed(self.listeners):
            listener.settled(v)

    def stop(self, v: Validation) -> str | None:
        return next(filter(None, (x.stop(v) for x in reversed(self.listeners))), None)

    def halted(self, step: int) -> str | None:
        return next(filter(None, (x.halted(step) for x in reversed(self.listeners))), None)

    def step_done(self, step: int) -> None:
        for listener in self.listeners:
            listener.step_done(step)

    def state_dict(self) -> dict[str, Any]:
        return {x.key: x.state_dict() for x in self.listeners if x.key is not None}

    def load_state_dict(self, section: Mapping[str, Any]) -> None:
        """Each listener's entry of the progress section (None where the checkpoint has none)."""
        for listener in self.listeners:
            if listener.key is not None:
                listener.load_state_dict(section.get(listener.key))
