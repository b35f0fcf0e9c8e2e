"""The LoRA adapters of trainers/model/lora.py on the real model: a fresh adapter changes nothing, only the
adapters train, the base stays bit-identical, and the merged state dict has the base's names and shapes
and computes what the adapted model computes."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_GPT
from tests.test_gpt_model import make_batch, randomized_model, select
from trainers.model.gpt_model import ADAPTER_SITES, SampleDropout, UnifiedVoiceGPT, dropout_keys
from trainers.model.lora import (
    DEFAULT_TARGETS,
    LoraSettings,
    add_adapters,
    adapter_state_dict,
    merge_adapters,
    merged_state_dict,
)

# Merged and adapted logits differ by float rounding only: W + s*A@B summed once versus x@W + (x@A)@(s*B)
# summed per position. Measured max abs diff on this model: 1.4e-6 at logits up to 2.4.
MERGE_ATOL = 2e-5


def batch() -> dict:
    return make_batch([5, 9, 3], [7, 12, 4], seed=3)


def adapted(seed: int = 0, settings: LoraSettings = LoraSettings(rank=4, alpha=8.0)) -> UnifiedVoiceGPT:
    model = randomized_model(seed=seed)
    add_adapters(model, settings, seed=11)
    return model


def test_a_fresh_adapter_changes_nothing():
    base = randomized_model().eval()
    model = adapted().eval()
    with torch.no_grad():
        for want, got in zip(base(**batch()), model(**batch())):
            assert torch.equal(want, got)


def test_only_the_adapters_train_and_the_base_stays_bit_identical():
    model = adapted().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)
    assert len(trainable) == 2 * len(DEFAULT_TARGETS) * TINY_GPT.layers
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    b = batch()
    keys = dropout_keys(1, 0, torch.arange(3))
    for _ in range(3):
        sums = model.loss_sums(**b, dropout_keys=keys)
        (sums["mel_ce"] + sums["text_ce"]).backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert changed and all(k.endswith((".lora_a", ".lora_b")) for k in changed), changed
    assert any(k.endswith(".lora_b") for k in changed)  # the adapters did learn


def test_the_merged_state_dict_has_the_base_layout_and_the_adapted_models_logits():
    model = adapted()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # as after training: B no longer zero
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    merged = merged_state_dict(model, LoraSettings(rank=4, alpha=8.0))
    plain = UnifiedVoiceGPT(TINY_GPT)
    assert {k: tuple(v.shape) for k, v in merged.items()} == {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    plain.load_state_dict(merged, strict=True)
    model.eval(), plain.eval()
    with torch.no_grad():
        base_logits = randomized_model().eval()(**batch())
        for want, got, before in zip(model(**batch()), plain(**batch()), base_logits):
            assert (want - before).abs().max() > 100 * MERGE_ATOL  # the adapters do change the logits
            diff = (want - got).abs().max().item()
            assert diff <= MERGE_ATOL, f"merged logits differ from the adapted model's by {diff:.3g}"


def test_merging_an_adapter_file_into_a_base_equals_merging_the_model():
    model = adapted()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.fill_(0.01)
    settings = LoraSettings(rank=4, alpha=8.0)
    base = randomized_model().state_dict()
    from_files = merge_adapters(base, adapter_state_dict(model), settings.scale)
    from_model = merged_state_dict(model, settings)
    assert from_files.keys() == from_model.keys()
    assert all(torch.equal(from_files[k], from_model[k]) for k in from_files)


def test_an_adapter_that_does_not_fit_its_base_is_refused_by_name():
    adapters = adapter_state_dict(adapted())
    base = randomized_model().state_dict()
    del base["gpt.h.1.mlp.c_fc.weight"]
    with pytest.raises(ValueError, match=r"gpt\.h\.1\.mlp\.c_fc: needs lora_a, lora_b and a base"):
        merge_adapters(base, adapters, 2.0)
    base = UnifiedVoiceGPT(TINY_GPT.__class__(**{**TINY_GPT.to_dict(), "model_dim": 32})).state_dict()
    with pytest.raises(ValueError, match=r"do not fit the base weight"):
        merge_adapters(base, adapters, 2.0)


def test_adapters_are_a_function_of_the_seed():
    one, two, other = adapter_state_dict(adapted()), adapter_state_dict(adapted()), None
    assert all(torch.equal(one[k], two[k]) for k in one)
    model = randomized_model()
    add_adapters(model, LoraSettings(rank=4, alpha=8.0), seed=12)
    other = adapter_state_dict(model)
    assert not torch.equal(one["gpt.h.0.attn.c_attn.lora_a"], other["gpt.h.0.attn.c_attn.lora_a"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0, alpha=1.0), "--lora-rank must be at least 1"),
    (dict(rank=4, alpha=0.0), "--lora-alpha must be positive"),
    (dict(rank=4, alpha=8.0, dropout=1.0), r"--lora-dropout must be in \[0, 1\)"),
    (dict(rank=4, alpha=8.0, targets=("c_attn", "q_proj")), r"--lora-targets: unknown or empty \['q_proj'\]"),
])
def test_bad_settings_name_their_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraSettings(**kwargs)


def trained_adapters(dropout: float, **kwargs) -> UnifiedVoiceGPT:
    """An adapted model whose adapters are non-zero, as after some training."""
    model = randomized_model(**kwargs)
    add_adapters(model, LoraSettings(rank=4, alpha=8.0, dropout=dropout), seed=11)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.train()


def test_adapter_dropout_is_keyed_by_sample_not_by_batch_mates():
    """A sample's adapter masks depend on its key alone: alone or beside others, its logits are the same
    (up to float rounding), as the model's own dropout guarantees across micro-batch splits."""
    model = trained_adapters(dropout=0.5)
    b = batch()
    keys = dropout_keys(3, 7, torch.tensor([10, 11, 12]))
    with torch.no_grad():
        together = model(**b, dropout_keys=keys)[1]
        alone = model(**select(b, [1]), dropout_keys=keys[1:2])[1]
        again = model(**b, dropout_keys=keys)[1]
        model.adapter_dropout = 0.0
        undropped = model(**b, dropout_keys=keys)[1]
    m = int(b["code_lens"][1]) + 2
    assert torch.equal(together, again)
    assert (together[1, :m] - alone[0, :m]).abs().max() < 1e-5
    assert (together - undropped).abs().max() > 1e-2  # the adapters' dropout is active


def test_adapter_dropout_sites_are_their_own_and_recomputed_alike_under_checkpointing(monkeypatch):
    sites = []
    real_call = SampleDropout.__call__

    def recording_call(self, x, site):
        sites.append(site)
        return real_call(self, x, site)

    monkeypatch.setattr(SampleDropout, "__call__", recording_call)
    grads = []
    for checkpointing in (False, True):
        model = trained_adapters(dropout=0.3, gradient_checkpointing=checkpointing)
        sums = model.loss_sums(**batch(), dropout_keys=dropout_keys(0, 0, torch.arange(3)))
        (sums["mel_ce"] + sums["text_ce"]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    adapter_sites = sorted({s for s in sites if s >= ADAPTER_SITES})
    assert len(adapter_sites) == 4 * TINY_GPT.layers  # one per adapted projection, distinct
    assert max(s for s in sites if s < ADAPTER_SITES) <= 2 * TINY_GPT.layers
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-5) for k in grads[0])
