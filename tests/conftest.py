"""Shared test settings and the demo assets every trainer test uses."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.benchmark_smokes import SMOKES, start_in_background, stop_background
from trainers.model.gpt_model import GPTConfig

# The scripts the tests start (the trainer, the tools, torchrun's workers) import the trainers package
# of this checkout, as the tests do, whatever this Python has installed (another checkout, or none).
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)

# A tiny config whose special mel ids sit at the top of the mel vocabulary, as in the official one.
TINY_GPT = GPTConfig(
    model_dim=16,
    layers=2,
    heads=2,
    max_text_tokens=12,
    max_mel_tokens=16,
    number_text_tokens=20,
    number_mel_codes=30,
    start_mel_token=28,
    stop_mel_token=29,
    dropout=0.1,
)


@pytest.fixture(autouse=True, scope="session")
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP waits make them
    up to 100x slower. Trainer subprocesses get the same setting (tests/demo_runs.py), so runs in
    this process and in subprocesses compute bit-identical floats."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory, single_thread) -> list[str]:
    """Flags naming the demo corpus, tokenizer and base checkpoint, generated once per test session."""
    from tests.demo_runs import demo_flags

    return demo_flags(Path(tmp_path_factory.mktemp("demo_assets")))


@pytest.fixture(scope="session")
def demo25_assets(tmp_path_factory: pytest.TempPathFactory, single_thread) -> list[str]:
    """Flags naming the IndexTTS-2.5 demo's config, corpus, tokenizer and base, generated once per session."""
    from tests.demo_runs import demo25_flags

    return demo25_flags(Path(tmp_path_factory.mktemp("demo25_assets")))


class FamilyFlags(list):
    """Flags naming a model family's demo assets; `.family` is the family's name."""

    family: str


@pytest.fixture(scope="session", params=["indextts2", "indextts25"])
def family_assets(request: pytest.FixtureRequest) -> FamilyFlags:
    """The demo assets of each model family in turn: a test taking them runs over both (IndexTTS2, IndexTTS-2.5),
    the same test for both (docs/architecture.md, "Model families")."""
    flags = FamilyFlags(request.getfixturevalue("demo_assets" if request.param == "indextts2" else "demo25_assets"))
    flags.family = request.param
    return flags


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "benchmark_smokes(*scripts): the test reads these benchmarks' small modes "
                            "(tests/benchmark_smokes.py); without scripts, the one its `script` parameter names")


def smokes_read_by(item: pytest.Item) -> list[str]:
    marker = item.get_closest_marker("benchmark_smokes")
    if marker is None:
        return []
    if marker.args:
        return list(marker.args)
    params = getattr(item, "callspec", None)
    return [params.params["script"]] if params and "script" in params.params else []


def in_a_worker() -> bool:
    """Under pytest-xdist (pytest.ini's -n): the tests are spread over worker processes."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In one process the tests that read benchmark small modes go last: the small modes run in the background
    meanwhile. Spread over workers they go first, the longest first, so the other tests fill in beside them."""
    if in_a_worker():
        items.sort(key=lambda item: -max([SMOKES[s].seconds for s in smokes_read_by(item) if s in SMOKES] or [0]))
    else:
        items.sort(key=lambda item: bool(smokes_read_by(item)))  # stable: every other test keeps its place


@pytest.fixture(autouse=True, scope="session")
def benchmark_smokes_in_background(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The small modes the selected tests read start with the session, one at a time, beside the other tests
    (which mostly keep one core busy); whatever still runs at the end of the session is killed."""
    scripts = [script for item in request.session.items for script in smokes_read_by(item)]
    if scripts and not in_a_worker():  # a worker runs the small modes of its own tests, when they ask
        start_in_background(scripts, tmp_path_factory.mktemp("benchmark_smokes"))
    yield
    stop_background()
