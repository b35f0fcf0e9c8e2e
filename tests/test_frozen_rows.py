"""Base vocabulary rows stay bit-identical through AdamW decay, moments and clipping.

These drive the trainer's own optimizer step (trainers/training/optimization.py), so a change of
its order (freezing after clipping, or no freezing at all) fails here.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import TINY_GPT
from trainers.config.settings import TrainConfig
from trainers.model.frozen_rows import FrozenTextRows
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.model.weights import TEXT_ROW_KEYS, resize_text_rows
from trainers.training.optimization import Optimization

BASE = TINY_GPT.number_text_tokens  # 20
EXTENDED = BASE + 6
CFG = TrainConfig(learning_rate=1e-2, warmup_steps=0, lr_decay_steps=100, weight_decay=0.1, grad_clip=0.5)


def _extended_model() -> tuple[UnifiedVoiceGPT, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    base = UnifiedVoiceGPT(dataclasses.replace(TINY_GPT, dropout=0.0)).state_dict()
    model = UnifiedVoiceGPT(dataclasses.replace(TINY_GPT, number_text_tokens=EXTENDED, dropout=0.0))
    state = dict(base)
    for key in TEXT_ROW_KEYS:
        state[key] = resize_text_rows(base[key], EXTENDED)
    model.load_state_dict(state)
    return model, base


def _backward(model: UnifiedVoiceGPT, optim: Optimization, g: torch.Generator) -> None:
    text = torch.randint(0, EXTENDED, (4, 8), generator=g)  # base and new ids
    codes = torch.randint(0, TINY_GPT.start_mel_token, (4, 10), generator=g)
    sums = model.loss_sums(torch.randn(4, 32, TINY_GPT.model_dim, generator=g),
                           torch.randn(4, TINY_GPT.model_dim, generator=g), text, torch.full((4,), 8), codes,
                           torch.full((4,), 10))
    optim.backward(sums["text_ce"] + sums["mel_ce"])


def _train(model: UnifiedVoiceGPT, frozen: FrozenTextRows | None, steps: int = 6) -> Optimization:
    optim = Optimization(model, CFG, fp16=False, frozen=frozen, device_type="cpu")
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        optim.start_step(step)
        _backward(model, optim, g)
        assert optim.apply(optim.prepare()).applied
    return optim


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
    optim = _train(model, FrozenTextRows.capture(model, BASE))
    moments = optim.optimizer.state[model.text_embedding.weight]
    assert torch.count_nonzero(_base_rows(moments["exp_avg"])) == 0
    assert torch.count_nonzero(_base_rows(moments["exp_avg_sq"])) == 0
    assert torch.count_nonzero(moments["exp_avg"][BASE:-1]) > 0


def test_frozen_rows_do_not_count_in_the_clipping_norm():
    model, _ = _extended_model()
    frozen = FrozenTextRows.capture(model, BASE)
    optim = Optimization(model, CFG, fp16=False, frozen=frozen, device_type="cpu")
    _backward(model, optim, torch.Generator().manual_seed(2))
    grads = {id(p): p.grad.clone() for p in optim.params}
    for p in frozen.params:
        grads[id(p)][:BASE] = 0
        grads[id(p)][-1:] = 0
    without_frozen = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    with_frozen = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in optim.params])))
    assert with_frozen > without_frozen * 1.001  # the base rows do receive gradients
    assert optim.prepare() == pytest.approx(without_frozen, rel=1e-6)


def test_capture_refuses_a_base_larger_than_the_table():
    model, _ = _extended_model()
    with pytest.raises(ValueError):
        FrozenTextRows.capture(model, EXTENDED + 1)


def test_an_fp16_loss_scaler_skip_is_reported_as_a_skipped_step():
    model, _ = _extended_model()
    optim = Optimization(model, CFG, fp16=True, frozen=None, device_type="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim.start_step(0)
    optim.backward(sum(p.sum() for p in model.parameters()) * float("inf"))
    scale = optim.scaler.get_scale()
    result = optim.apply(optim.prepare())
    assert not result.applied and optim.scaler.get_scale() == scale / 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    _backward(model, optim, torch.Generator().manual_seed(3))
    assert optim.apply(optim.prepare()).applied


def test_new_rows_lr_scale_moves_an_extended_vocabularys_new_rows_that_much_further():
    """--new-rows-lr-scale on an extended vocabulary: the text tables in optimizer groups of their own at the
    scaled rate (their base rows still held); the first update of the new rows is the multiple of the unscaled
    one (Adam's first step is lr x sign-like, so the update scales with the rate)."""
    moved = {}
    for scale in (1.0, 10.0):
        model, base = _extended_model()
        start = model.text_embedding.weight.detach().clone()
        optim = Optimization(model, dataclasses.replace(CFG, new_rows_lr_scale=scale, weight_decay=0.0), fp16=False,
                             frozen=FrozenTextRows.capture(model, BASE), device_type="cpu",
                             scaled=frozenset(TEXT_ROW_KEYS))
        assert optim.start_step(0) == CFG.learning_rate
        scaled = [g for g in optim.optimizer.param_groups if "lr_scale" in g]
        assert [g["lr"] for g in scaled] == ([CFG.learning_rate * scale] * 2 if scale != 1.0 else [])
        _backward(model, optim, torch.Generator().manual_seed(1))
        assert optim.apply(optim.prepare()).applied
        assert torch.equal(_base_rows(model.text_embedding.weight.detach()), base["text_embedding.weight"])
        moved[scale] = (model.text_embedding.weight.detach() - start)[BASE:-1]
    torch.testing.assert_close(moved[10.0], 10 * moved[1.0], rtol=1e-4, atol=1e-7)
