"""Shared test settings."""
from __future__ import annotations

import pytest
import torch

from trainers.model.gpt_model import GPTConfig

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


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP waits
    make them up to 100x slower; restore the setting for other test modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
