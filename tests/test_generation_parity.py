"""Parity of trainers/model/generation.py with upstream IndexTTS2: for the same weights, conditioning latents,
emotion vector and text, greedy generation gives the codes of `UnifiedVoice.inference_speech` as infer_v2
builds it (`post_init_gpt2_config(kv_cache=True)`), alone and in a batch of different text lengths, with
and without infer_v2's repetition penalty.

Upstream's code comes from a pinned wheel (tests/upstream_models.py). Upstream computes the conditioning latents
from audio features with its conformer and perceiver; the trainer works from precomputed latents, so the test
hands upstream's `get_conditioning` the same latents ours gets (everything after that point is compared).
"""
from __future__ import annotations

import pytest

from tests.test_generation import MAX_CODES, model, rows, texts, tokens
from tests.upstream_gpt import conformer_model, generated_tokens
from trainers.model.generation import generate_codes


def upstream_tokens(uv, batch: dict, **kwargs) -> list[list[int]]:
    return generated_tokens(uv, batch["condition"], batch["emo_vec"], batch["text_ids"], MAX_CODES, **kwargs)


@pytest.mark.parametrize("penalty", [1.0, 10.0], ids=["greedy", "repetition_penalty_10"])
def test_greedy_codes_equal_upstream_inference_speech(penalty: float):
    ours = model()
    uv = conformer_model(ours)
    batch = texts()
    extra = {} if penalty == 1.0 else {"repetition_penalty": penalty}
    ours_batch = generate_codes(ours, **batch, max_codes=MAX_CODES, repetition_penalty=penalty)
    for i in range(len(batch["text_lens"])):
        alone = rows(batch, i)
        assert upstream_tokens(uv, alone, **extra) == [tokens(ours_batch, i)], i
    # Upstream left-pads a batch too; its text padding must hold no start/stop ids (it drops those).
    padded = dict(batch, text_ids=batch["text_ids"].clone())
    for i, n in enumerate(batch["text_lens"].tolist()):
        padded["text_ids"][i, n:] = ours.cfg.stop_text_token
    assert upstream_tokens(uv, padded, **extra) == [tokens(ours_batch, i) for i in range(len(batch["text_lens"]))]
