"""Parity of trainers/model/generation.py with upstream IndexTTS2: for the same weights, conditioning latents,
emotion vector and text, greedy generation gives the codes of `UnifiedVoice.inference_speech` as infer_v2
builds it (`post_init_gpt2_config(kv_cache=True)`), alone and in a batch of different text lengths, with
and without infer_v2's repetition penalty.

Skipped unless upstream's model code imports. Upstream computes the conditioning latents from audio
features with its conformer and perceiver; the trainer works from precomputed latents, so the test hands
upstream's `get_conditioning` the same latents ours gets (everything after that point is compared).
"""
from __future__ import annotations

import pytest
import torch

from tests.test_generation import MAX_CODES, STOP, model, rows, texts, tokens
from trainers.model.generation import generate_codes

upstream = pytest.importorskip(
    "indextts.gpt.model_v2",
    reason="upstream IndexTTS2 is not installed: git clone https://github.com/index-tts/index-tts and "
           "pip install -e it (it pins transformers 4.52.1) to compare greedy codes with its inference_speech")

# Small conformer/perceiver sizes: the encoders are built (the constructor needs them) but never run.
ENCODER = {"output_size": 16, "linear_units": 32, "attention_heads": 2, "num_blocks": 1, "input_layer": "conv2d2",
           "perceiver_mult": 2}


def upstream_model(ours) -> "upstream.UnifiedVoice":
    cfg = ours.cfg
    uv = upstream.UnifiedVoice(
        layers=cfg.layers, model_dim=cfg.model_dim, heads=cfg.heads, max_text_tokens=cfg.max_text_tokens,
        max_mel_tokens=cfg.max_mel_tokens, number_text_tokens=cfg.number_text_tokens,
        number_mel_codes=cfg.number_mel_codes, start_text_token=cfg.start_text_token,
        stop_text_token=cfg.stop_text_token, start_mel_token=cfg.start_mel_token, stop_mel_token=cfg.stop_mel_token,
        condition_type="conformer_perceiver", condition_module=ENCODER, emo_condition_module=ENCODER)
    result = uv.load_state_dict(ours.state_dict(), strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    ours_keys = set(ours.state_dict())
    # What ours lacks: the conditioning encoders (group B) and HF's attention-mask buffers.
    assert not [k for k in result.missing_keys if k in ours_keys]
    uv.post_init_gpt2_config(kv_cache=True)
    return uv.eval()


def upstream_tokens(uv, batch: dict, **kwargs) -> list[list[int]]:
    """Each sample's generated tokens up to and including the first stop (HF pads finished rows with it)."""
    uv.get_conditioning = lambda *_args, **_kw: batch["condition"]
    b, n = batch["text_ids"].shape
    with torch.no_grad():
        out, _ = uv.inference_speech(torch.zeros(b, 1024, 8), batch["text_ids"], emo_vec=batch["emo_vec"],
                                     do_sample=False, num_beams=1, max_generate_length=MAX_CODES, **kwargs)
    found = []
    for row in out.tolist():
        found.append(row[:row.index(STOP) + 1] if STOP in row else row)
    return found


@pytest.mark.parametrize("penalty", [1.0, 10.0], ids=["greedy", "repetition_penalty_10"])
def test_greedy_codes_equal_upstream_inference_speech(penalty: float):
    ours = model()
    uv = upstream_model(ours)
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
