"""Loading an official-format gpt.pth into the trainer's model (trainers/base_weights.py)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from trainers.model.weights import BaseWeights, load_base_weights, read_state_dict, resize_text_rows
from tests.conftest import TINY_GPT
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.errors import UserError

CFG = TINY_GPT
NT = CFG.number_text_tokens
TEXT_ROW_KEYS = ("text_embedding.weight", "text_head.weight", "text_head.bias")


def cfg_with(**overrides) -> GPTConfig:
    return GPTConfig(**{**CFG.to_dict(), **overrides})


def random_state(cfg: GPTConfig = CFG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Group-A tensors of a model built from `cfg`, every value random (biases included)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in UnifiedVoiceGPT(cfg).state_dict().items()}


def group_b(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conditioning_encoder.embed.pos_enc.pe": torch.randn(1, 50, 8, generator=g),
        "conditioning_encoder.encoders.0.feed_forward.w_1.weight": torch.randn(12, 8, generator=g),
        "perceiver_encoder.latents": torch.randn(32, 16, generator=g),
        "emo_conditioning_encoder.embed.pos_enc.pe": torch.randn(1, 40, 8, generator=g).half(),
        "emo_perceiver_encoder.latents": torch.randn(32, 16, generator=g),
        "emovec_layer.weight": torch.randn(16, 8, generator=g),
        "emo_layer.bias": torch.randn(16, generator=g),
        "emo_conditioning_encoder.embed.num_batches_tracked": torch.tensor(7, dtype=torch.int64),
    }


def dropped_keys() -> dict[str, torch.Tensor]:
    return {
        "inference_model.lm_head.1.weight": torch.randn(30, 16),
        "gpt.wte.weight": torch.randn(30, 16),
        "gpt.h.0.attn.bias": torch.ones(1, 1, 8, 8),
        "gpt.h.1.attn.masked_bias": torch.tensor(-1e4),
    }


def save(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


def assert_bit_identical(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(a, b), what


def shape_forms(shape) -> set[str]:
    dims = [int(n) for n in shape]
    return {str(tuple(dims)), str(dims), str(torch.Size(dims)), "x".join(map(str, dims)), "×".join(map(str, dims))}


def assert_lists_mismatch(message: str, key: str, ckpt_shape, model_shape) -> None:
    lines = [line for line in message.splitlines() if key in line]
    assert lines, f"{key} not listed in:\n{message}"
    ok = any(
        any(f in line for f in shape_forms(ckpt_shape)) and any(f in line for f in shape_forms(model_shape))
        for line in lines
    )
    assert ok, f"{key}: expected both shapes {tuple(ckpt_shape)} and {tuple(model_shape)} in {lines}"


# --- formats, carried and dropped keys --------------------------------------------------------


@pytest.mark.parametrize("wrap", ["model_key", "raw", "raw_module_prefix", "model_key_module_prefix"])
def test_loads_official_and_raw_formats(tmp_path, wrap):
    base = random_state(seed=3)
    carried = group_b()
    full = {**base, **carried, **dropped_keys()}
    if wrap.endswith("module_prefix"):
        full = {"module." + k: v for k, v in full.items()}
    obj = {"model": full, "step": 5} if wrap.startswith("model_key") else full
    path = save(tmp_path / "gpt.pth", obj)

    model = UnifiedVoiceGPT(CFG)
    result = load_base_weights(path, model)

    assert isinstance(result, BaseWeights)
    own = model.state_dict()
    assert set(own) == set(base)
    for key, value in base.items():
        assert_bit_identical(own[key], value, key)
    assert set(result.carried) == set(carried)
    for key, value in carried.items():
        assert_bit_identical(result.carried[key], value, key)
    assert set(result.dropped) == set(dropped_keys())
    assert result.base_text_tokens == NT
    assert result.new_text_rows == 0


def test_loaded_model_gives_the_file_weights_output(tmp_path):
    """The loaded model computes with the file's weights (not just holds equal state)."""
    source = UnifiedVoiceGPT(CFG).eval()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = save(tmp_path / "gpt.pth", {"model": source.state_dict()})
    target = UnifiedVoiceGPT(CFG).eval()
    load_base_weights(path, target)
    batch = dict(
        condition=torch.randn(1, 32, 16), emo_vec=torch.randn(1, 16),
        text_ids=torch.tensor([[3, 4, 5]]), text_lens=torch.tensor([3]),
        codes=torch.tensor([[1, 2]]), code_lens=torch.tensor([2]),
    )
    with torch.no_grad():
        a, b = source(**batch), target(**batch)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_unknown_extra_key_is_carried(tmp_path, caplog):
    extra = {"some_future_module.proj.weight": torch.randn(3, 5), "speaker_table": torch.arange(6)}
    path = save(tmp_path / "gpt.pth", {"model": {**random_state(), **extra}})
    with caplog.at_level(logging.WARNING):
        result = load_base_weights(path, UnifiedVoiceGPT(CFG))
    for key, value in extra.items():
        assert_bit_identical(result.carried[key], value, key)
    assert "some_future_module.proj.weight" in caplog.text


def test_read_state_dict_prefers_model_key(tmp_path):
    sd = {"a": torch.zeros(2)}
    path = save(tmp_path / "x.pth", {"model": sd, "optimizer": {"state": {}}})
    assert set(read_state_dict(path)) == {"a"}
    path = save(tmp_path / "y.pth", sd)
    assert set(read_state_dict(path)) == {"a"}


# --- shape mismatches ---------------------------------------------------------------------------


def expected_mismatches(ckpt: dict, model: UnifiedVoiceGPT) -> dict[str, tuple]:
    own = model.state_dict()
    return {k: (tuple(ckpt[k].shape), tuple(own[k].shape)) for k in own if k in ckpt and ckpt[k].shape != own[k].shape}


def test_number_mel_codes_mismatch_lists_each_key(tmp_path):
    ckpt = random_state(cfg_with(number_mel_codes=40, start_mel_token=38, stop_mel_token=39))
    path = save(tmp_path / "gpt.pth", {"model": ckpt})
    model = UnifiedVoiceGPT(CFG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError) as info:
        load_base_weights(path, model)
    message = str(info.value)
    assert str(path) in message
    mism = expected_mismatches(ckpt, model)
    assert set(mism) == {"mel_embedding.weight", "mel_head.weight", "mel_head.bias"}
    for key, (c, m) in mism.items():
        assert_lists_mismatch(message, key, c, m)
    # Nothing was loaded.
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_max_tokens_mismatch_lists_position_tables(tmp_path):
    ckpt = random_state(cfg_with(max_text_tokens=20, max_mel_tokens=10))
    path = save(tmp_path / "gpt.pth", ckpt)
    with pytest.raises(UserError) as info:
        load_base_weights(path, UnifiedVoiceGPT(CFG))
    assert_lists_mismatch(str(info.value), "text_pos_embedding.emb.weight", (22, 16), (14, 16))
    assert_lists_mismatch(str(info.value), "mel_pos_embedding.emb.weight", (13, 16), (19, 16))


def test_model_dim_mismatch_lists_every_mismatched_key(tmp_path):
    ckpt = random_state(cfg_with(model_dim=24, heads=2))
    path = save(tmp_path / "gpt.pth", {"model": ckpt})
    model = UnifiedVoiceGPT(CFG)
    with pytest.raises(UserError) as info:
        load_base_weights(path, model)
    message = str(info.value)
    mism = expected_mismatches(ckpt, model)
    assert "gpt.h.1.mlp.c_fc.weight" in mism and "text_embedding.weight" in mism
    for key, (c, m) in mism.items():
        assert_lists_mismatch(message, key, c, m)


def test_text_row_key_with_wrong_width_is_a_user_error(tmp_path):
    ckpt = random_state()
    ckpt["text_head.weight"] = torch.randn(NT + 1, 17)
    path = save(tmp_path / "gpt.pth", ckpt)
    with pytest.raises(UserError) as info:
        load_base_weights(path, UnifiedVoiceGPT(CFG))
    assert_lists_mismatch(str(info.value), "text_head.weight", (NT + 1, 17), (NT + 1, 16))


def test_missing_group_a_key_is_listed(tmp_path):
    ckpt = random_state()
    del ckpt["gpt.ln_f.bias"]
    del ckpt["gpt.h.1.attn.c_proj.weight"]
    path = save(tmp_path / "gpt.pth", {"model": ckpt})
    with pytest.raises(UserError) as info:
        load_base_weights(path, UnifiedVoiceGPT(CFG))
    message = str(info.value)
    assert str(path) in message
    assert "gpt.ln_f.bias" in message
    assert "gpt.h.1.attn.c_proj.weight" in message


def test_missing_text_embedding_is_a_user_error(tmp_path):
    ckpt = random_state()
    del ckpt["text_embedding.weight"]
    path = save(tmp_path / "gpt.pth", ckpt)
    with pytest.raises(UserError, match="text_embedding.weight"):
        load_base_weights(path, UnifiedVoiceGPT(CFG))


def test_checkpoint_with_more_layers_is_refused(tmp_path):
    """A deeper checkpoint than --config must not load its first `layers` blocks silently:
    the fine-tune would train a truncated network, and the exported file (carrying
    gpt.h.<layers>.*) would not load strictly in upstream inference with either config."""
    ckpt = random_state(cfg_with(layers=3))
    path = save(tmp_path / "gpt.pth", {"model": ckpt})
    with pytest.raises(UserError) as info:
        load_base_weights(path, UnifiedVoiceGPT(CFG))
    assert "gpt.h.2." in str(info.value)


def test_checkpoint_with_fewer_layers_is_refused(tmp_path):
    path = save(tmp_path / "gpt.pth", random_state(cfg_with(layers=1)))
    with pytest.raises(UserError) as info:
        load_base_weights(path, UnifiedVoiceGPT(CFG))
    assert "gpt.h.1.mlp.c_fc.weight" in str(info.value)


# --- tokenizer size -----------------------------------------------------------------------------


def test_larger_tokenizer_extends_text_rows(tmp_path):
    base = random_state(seed=5)
    path = save(tmp_path / "gpt.pth", {"model": {**base, **group_b()}})
    model = UnifiedVoiceGPT(cfg_with(number_text_tokens=NT + 5))
    result = load_base_weights(path, model)
    assert result.base_text_tokens == NT
    assert result.new_text_rows == 5

    own = model.state_dict()
    for key in TEXT_ROW_KEYS:
        old, new = base[key], own[key]
        assert new.shape[0] == NT + 5 + 1, key
        assert new.shape[1:] == old.shape[1:], key
        assert torch.equal(new[:NT], old[:NT]), f"{key}: base token rows changed"
        assert torch.equal(new[NT + 5], old[NT]), f"{key}: extra row not moved to the new last row"
        mean = old[:NT].mean(dim=0)
        for row in range(NT, NT + 5):
            assert torch.allclose(new[row], mean, atol=1e-6), f"{key}: new row {row} is not the base mean"
        # The extra row is not part of the mean.
        assert not torch.allclose(mean, old[: NT + 1].mean(dim=0), atol=1e-6)
    # Everything else loaded as it is in the file.
    for key in set(base) - set(TEXT_ROW_KEYS):
        assert torch.equal(own[key], base[key]), key


def test_resize_text_rows_same_size_is_identity():
    t = torch.randn(NT + 1, 4)
    assert torch.equal(resize_text_rows(t, NT), t)
    grown = resize_text_rows(t, NT + 2)
    assert grown.shape == (NT + 3, 4)
    assert torch.equal(grown[-1], t[-1])


def test_smaller_tokenizer_is_refused(tmp_path):
    path = save(tmp_path / "gpt.pth", random_state())
    model = UnifiedVoiceGPT(cfg_with(number_text_tokens=NT - 3))
    with pytest.raises(UserError) as info:
        load_base_weights(path, model)
    message = str(info.value)
    assert str(path) in message
    assert str(NT) in message and str(NT - 3) in message


# --- unreadable files ---------------------------------------------------------------------------


class NotAllowedByWeightsOnly:
    def __init__(self) -> None:
        self.x = 1


@pytest.mark.parametrize(
    "content",
    [
        [1, 2, 3],
        "hello",
        {"model": {"text_embedding.weight": "not a tensor"}},
        {"model": [torch.zeros(1)]},
        {"step": 3, "weights": torch.zeros(2)},
        NotAllowedByWeightsOnly(),
    ],
    ids=["list", "str", "model_non_tensor", "model_list", "mixed_dict", "pickled_object"],
)
def test_not_a_state_dict_is_a_user_error(tmp_path, content):
    path = save(tmp_path / "weird.pth", content)
    with pytest.raises(UserError) as info:
        load_base_weights(path, UnifiedVoiceGPT(CFG))
    assert str(path) in str(info.value)


def test_garbage_bytes_are_a_user_error(tmp_path):
    path = tmp_path / "garbage.pth"
    path.write_bytes(b"this is not a torch checkpoint\x00\x01")
    with pytest.raises(UserError) as info:
        load_base_weights(path, UnifiedVoiceGPT(CFG))
    assert str(path) in str(info.value)


def test_missing_file_is_a_user_error(tmp_path):
    path = tmp_path / "nope" / "gpt.pth"
    with pytest.raises(UserError) as info:
        load_base_weights(path, UnifiedVoiceGPT(CFG))
    assert str(path) in str(info.value)
