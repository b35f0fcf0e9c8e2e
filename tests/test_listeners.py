"""Validation listeners (trainers/training/validation_listeners.py): a listener added to the run's list gets every
validation and step without an edit of the loop, and its state survives a stop and a resume.

The listener here is one a new feature could be: it keeps the steps it saw and the validations it was handed.
Its state is saved under its key of the progress section, so a run stopped by SIGTERM mid-way and resumed ends
with the state of the run that was never stopped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.demo_runs import final_state, small_corpus_flags, train_here
from trainers.run import setup
from trainers.training.validation_listeners import Listeners, Validation, ValidationListener

FLAGS = ["--effective-batch", "4", "--batch-size", "2", "--max-steps", "7", "--val-interval", "3",
         "--max-val-batches", "2", "--save-interval", "100", "--log-interval", "100"]


class Tally(ValidationListener):
    """What it was shown: the steps done and, per validation, its step and mel_loss."""

    key = "tally"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.validations: list[tuple[int, float, bool]] = []

    def step_done(self, step: int) -> None:
        self.steps.append(step)

    def validated(self, v: Validation) -> None:
        self.validations.append((v.step, v.means["mel_loss"], v.final))

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "validations": [list(x) for x in self.validations]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.steps = list(state["steps"]) if state else []
        self.validations = [tuple(x) for x in state["validations"]] if state else []


@pytest.fixture
def with_tally(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's listeners and a Tally last: what a new listener's entry in trainers/run/listeners.py does."""
    run_listeners = setup.run_listeners
    monkeypatch.setattr(setup, "run_listeners",
                        lambda *args: Listeners([*run_listeners(*args), Tally()]))


def tally(run: Path) -> dict[str, Any]:
    return final_state(run).sections["progress"]["tally"]


def test_a_listeners_state_survives_a_stop_and_resume(with_tally, tmp_path):
    corpus = small_corpus_flags(tmp_path / "data")
    straight = tmp_path / "straight"
    assert train_here(straight, *corpus, *FLAGS).returncode == 0
    seen = tally(straight)
    assert seen["steps"] == list(range(1, 8))
    assert [(step, final) for step, _, final in seen["validations"]] == [(0, False), (3, False), (6, False), (7, True)]

    stopped = tmp_path / "stopped"
    first = train_here(stopped, *corpus, *FLAGS, kill_at="SIGTERM@micro:5:0")
    assert first.returncode != 0 and final_state(stopped).step == 5
    assert tally(stopped)["steps"] == list(range(1, 6))
    resumed = train_here(stopped, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert tally(stopped) == seen
