"""Every script in benchmarks/ runs in its small mode and prints the figure lines the README quotes, so a
change that breaks a benchmark fails the suite instead of the next person who measures.

The rule: a script added to benchmarks/ needs an entry in tests/benchmark_smokes.py SMOKES (its small mode's
flags and figure lines), or the test named after it fails. No timing is asserted: small modes measure nothing.
"""
from __future__ import annotations

import re
import sys
from typing import Callable

import pytest

from tests.benchmark_smokes import BENCHMARKS, SMOKES, SmokeRun, run_smokes
from tests.conftest import in_a_worker

SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("*.py"))


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], SmokeRun]:
    """The small mode of a script. In one process those of every benchmark this session selected, started together
    (a few at a time); spread over workers, each worker runs its own tests' scripts, one at a time."""
    folder = tmp_path_factory.mktemp("benchmark_smokes")
    if in_a_worker():
        return lambda script: run_smokes([script], folder, at_once=1)[script]
    here = sys.modules[__name__]
    selected = [item.callspec.params["script"] for item in request.session.items
                if item.module is here and hasattr(item, "callspec") and "script" in item.callspec.params]
    return run_smokes([s for s in selected if s in SMOKES], folder).__getitem__


@pytest.mark.benchmark_smokes
@pytest.mark.parametrize("script", SCRIPTS)
def test_the_benchmark_runs_in_its_small_mode_and_prints_its_figures(script: str, smoke_runs) -> None:
    assert script in SMOKES, (
        f"benchmarks/{script} has no small mode: give it --smoke (every part once at tiny sizes, in seconds, no "
        "timing target judged) and add it to SMOKES in tests/benchmark_smokes.py with the figure lines the "
        "README quotes")
    done = smoke_runs(script)
    shown = f"benchmarks/{script} {' '.join(SMOKES[script].args)} in {done.seconds} s:\n{done.output[-4000:]}"
    assert done.returncode is not None, f"still running after its time: {shown}"
    assert done.returncode == 0, f"exit {done.returncode}: {shown}"
    assert "Traceback" not in done.output, shown
    missing = [p for p in SMOKES[script].figures if not re.search(p, done.output, re.MULTILINE)]
    assert not missing, f"figure lines missing: {missing}\n{shown}"


def test_every_small_mode_belongs_to_a_script_in_benchmarks() -> None:
    assert not set(SMOKES) - set(SCRIPTS), f"SMOKES names scripts that are gone: {sorted(set(SMOKES) - set(SCRIPTS))}"
