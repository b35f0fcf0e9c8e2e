"""Base vocabulary rows stay bit-identical through AdamW decay, moments and clipping."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import TINY_GPT
from trainers.model.weights import TEXT_ROW_KEYS, resize_text_rows
from trainers.model.frozen_rows import FrozenTextRows
from trainers.model.gpt_model import UnifiedVoiceGPT

BASE = TINY_GPT.number_text_tokens  # 20
EXTENDED = BASE + 6


def _extended_model() -> tuple[UnifiedVoiceGPT, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    base = UnifiedVoiceGPT(dataclasses.replace(TINY_GPT, dropout=0.0)).state_dict()
    model = UnifiedVoiceGPT(dataclasses.replace(TINY_GPT, number_text_tokens=EXTENDED, dropout=0.0))
    state = dict(base)
    for key in TEXT_ROW_KEYS:
        state[key] = resize_text_rows(base[key], EXTENDED)
    model.load_state_dict(state)
    return model, base


def _train(model: UnifiedVoiceGPT, frozen: FrozenTextRows | None, steps: int = 6) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        text = torch.randint(0, EXTENDED, (4, 8), generator=g)  # base and new ids
        codes = torch.randint(0, TINY_GPT.start_mel_token, (4, 10), generator=g)
        sums = model.loss_sums(torch.randn(4, 32, TINY_GPT.model_dim, generator=g),
                               torch.randn(4, TINY_GPT.model_dim, generator=g), text, torch.full((4,), 8), codes,
                               torch.full((4,), 10))
        (sums["text_ce"] + sums["mel_ce"]).backward()
        if frozen:
            frozen.zero_grads()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if frozen:
            frozen.restore()
        opt.zero_grad(set_to_none=True)
    return opt


def _base_rows(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:BASE], t[-1:]])


def test_base_rows_stay_bit_identical_and_new_rows_train():
    model, base = _extended_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, FrozenTextRows.capture(model, BASE))
    state = model.state_dict()
    for key in TEXT_ROW_KEYS:
        assert torch.equal(_base_rows(state[key]), base[key]), key  # ids 0..Nt-1 and the extra row
        assert not torch.equal(state[key][BASE:-1], initial[key][BASE:-1]), key
    assert not torch.equal(state["gpt.h.0.mlp.c_fc.weight"], initial["gpt.h.0.mlp.c_fc.weight"])


def test_without_freezing_the_same_training_moves_the_base_rows():
    # The check above is meaningful: this training does move base rows when they are not frozen.
    model, base = _extended_model()
    _train(model, None)
    assert not torch.equal(_base_rows(model.state_dict()["text_embedding.weight"]), base["text_embedding.weight"])


def test_frozen_rows_leave_no_adam_moments():
    model, _ = _extended_model()
    opt = _train(model, FrozenTextRows.capture(model, BASE))
    moments = opt.state[model.text_embedding.weight]
    assert torch.count_nonzero(_base_rows(moments["exp_avg"])) == 0
    assert torch.count_nonzero(_base_rows(moments["exp_avg_sq"])) == 0
    assert torch.count_nonzero(moments["exp_avg"][BASE:-1]) > 0


def test_capture_refuses_a_base_larger_than_the_table():
    model, _ = _extended_model()
    with pytest.raises(ValueError):
        FrozenTextRows.capture(model, EXTENDED + 1)
