"""What acts on validations: the loop validates and hands the result to the run's listeners, in order.

A listener is one feature that acts on validations or steps: generation at validation, the forgetting guard,
the best checkpoint, early stopping (the run's list: trainers/run/listeners.py). It gets a `Validation` and
nothing else of the run; what else it needs (the model to generate with, its settings) it was given when it
was built. Adding one adds it to the list; the loop stays as it is.

The order of a validation:

1. `validated(v)`, in list order: each updates its own state, and may add to `v` what later listeners judge:
   metrics of its own (gen/*), whether the validation may be best.pth (`v.eligible`), a new best (`v.improved`).
2. `settled(v)`, in reverse order, as nested with-blocks unwind: the listeners that measured first act last,
   on the verdicts of those after them (best.pth is written with every listener's state of this validation,
   the sample set after it, protecting the best step's).
3. `stop(v)`, in reverse order: the first reason to end the run here ends it (the loop saves and exits 0).

`halted(step)`, in reverse order before a resumed run trains: why it has nothing to do (a stop it made before).
`step_done(step)`: after every optimizer step.

Each owns its state: `state_dict()` / `load_state_dict()`, saved in the checkpoint's progress section under
the listener's `key` (None: no state); a checkpoint written before the listener existed gives it None.
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
        keys = [x.key for x in self.listeners if x.key is not None]
        if len(keys) != len(set(keys)):
            raise ValueError(f"two listeners save their state under the same key: {keys}")

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
