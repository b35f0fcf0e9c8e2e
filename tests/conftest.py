"""Shared test settings and the demo assets every trainer test uses."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

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
