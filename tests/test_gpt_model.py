"""Contract tests for trainers/gpt_model.py against shared/reference/indextts2-gpt.md.

The expected state-dict table and the reference forward pass below are written from the
reference document, not from the model code, so a drift in either shows up here.
"""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import yaml

from trainers.model import gpt_model
from tests.conftest import TINY_GPT
from trainers.model.gpt_model import (
    PREFIX_LEN,
    GPTConfig,
    SampleDropout,
    UnifiedVoiceGPT,
    dropout_keys,
)
from trainers.model.weights import split_state_dict

REPO_ROOT = Path(__file__).resolve().parents[1]

SMALL = TINY_GPT


# --- helpers ----------------------------------------------------------------------------------


def assert_close(actual, expected, atol, rtol=0.0, what=""):
    """torch.allclose with a useful message (torch.testing.assert_close imports torch.distributed, ~2 s)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol):
        diff = (actual - expected).abs()
        bound = atol + rtol * expected.abs()
        raise AssertionError(
            f"{what}: {int((diff > bound).sum())} of {diff.numel()} elements differ; max abs diff {diff.max().item():.3g}"
        )


def randomized_model(cfg: GPTConfig = SMALL, seed: int = 0, **kwargs) -> UnifiedVoiceGPT:
    """A model whose every parameter (biases, LayerNorm affine included) is random and non-trivial."""
    torch.manual_seed(seed)
    model = UnifiedVoiceGPT(cfg, **kwargs)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("weight") and p.dim() == 1:  # LayerNorm gains
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)
    return model


def make_batch(text_lens, code_lens, cfg: GPTConfig = SMALL, seed: int = 0, T=None, M=None):
    """Batch padded to T/M (default: the longest) with garbage beyond each length."""
    g = torch.Generator().manual_seed(seed)
    b = len(text_lens)
    T = max(text_lens) if T is None else T
    M = max(code_lens) if M is None else M
    text_ids = torch.randint(2, cfg.number_text_tokens, (b, T), generator=g)
    codes = torch.randint(0, cfg.start_mel_token, (b, M), generator=g)
    condition = torch.randn(b, 32, cfg.model_dim, generator=g)
    emo_vec = torch.randn(b, cfg.model_dim, generator=g)
    return dict(
        condition=condition,
        emo_vec=emo_vec,
        text_ids=text_ids,
        text_lens=torch.tensor(text_lens),
        codes=codes,
        code_lens=torch.tensor(code_lens),
    )


def select(batch: dict, rows: list[int]) -> dict:
    """Sub-batch of `rows`, trimmed to the longest text/codes among them."""
    idx = torch.tensor(rows)
    t = int(batch["text_lens"][idx].max())
    m = int(batch["code_lens"][idx].max())
    return dict(
        condition=batch["condition"][idx],
        emo_vec=batch["emo_vec"][idx],
        text_ids=batch["text_ids"][idx, :t],
        text_lens=batch["text_lens"][idx],
        codes=batch["codes"][idx, :m],
        code_lens=batch["code_lens"][idx],
    )


def reference_segments(ids, lens, start, stop):
    """Inputs/targets exactly as the reference's steps 1-2 and 7 describe, with plain loops."""
    b, n = ids.shape
    body = ids.clone()
    for i in range(b):
        body[i, int(lens[i]):] = stop
    body = torch.cat([body, torch.full((b, 1), stop, dtype=ids.dtype)], dim=1)
    inputs = torch.cat([torch.full((b, 1), start, dtype=ids.dtype), body], dim=1)
    targets = torch.cat([body, torch.full((b, 1), stop, dtype=ids.dtype)], dim=1)
    for i in range(b):
        targets[i, int(lens[i]) + 1:] = -100
    return inputs, targets


def layer_norm(x, sd, prefix):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * sd[prefix + ".weight"] + sd[prefix + ".bias"]


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def reference_forward(model: UnifiedVoiceGPT, cfg: GPTConfig, batch: dict):
    """Upstream training forward (eval mode), re-implemented from the reference description."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    d, nh = cfg.model_dim, cfg.heads
    hd = d // nh
    text_in, _ = reference_segments(batch["text_ids"], batch["text_lens"], cfg.start_text_token, cfg.stop_text_token)
    mel_in, _ = reference_segments(batch["codes"], batch["code_lens"], cfg.start_mel_token, cfg.stop_mel_token)
    b, t2 = text_in.shape
    m2 = mel_in.shape[1]

    cond = batch["condition"] + batch["emo_vec"][:, None, :]
    speed = sd["speed_emb.weight"]
    prefix = torch.cat([cond, speed[1].expand(b, 1, d), speed[0].expand(b, 1, d)], dim=1)
    text_e = sd["text_embedding.weight"][text_in] + sd["text_pos_embedding.emb.weight"][:t2]
    mel_e = sd["mel_embedding.weight"][mel_in] + sd["mel_pos_embedding.emb.weight"][:m2]
    h = torch.cat([prefix, text_e, mel_e], dim=1)
    s = h.shape[1]
    assert s == 34 + t2 + m2
    causal = torch.ones(s, s, dtype=torch.bool).tril()

    def split_heads(t):
        return t.reshape(b, s, nh, hd).permute(0, 2, 1, 3)

    for i in range(cfg.layers):
        p = f"gpt.h.{i}."
        a = layer_norm(h, sd, p + "ln_1")
        qkv = a @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]
        q, k, v = (split_heads(qkv[..., j * d:(j + 1) * d]) for j in range(3))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        att = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(b, s, d)
        h = h + att @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        u = layer_norm(h, sd, p + "ln_2") @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"]
        h = h + gelu_tanh(u) @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    h = layer_norm(h, sd, "gpt.ln_f")
    h = layer_norm(h[:, 34:], sd, "final_norm")
    text_logits = h[:, :t2] @ sd["text_head.weight"].T + sd["text_head.bias"]
    mel_logits = h[:, -m2:] @ sd["mel_head.weight"].T + sd["mel_head.bias"]
    return text_logits, mel_logits


# --- 1. official state-dict table on the meta device -----------------------------------------


@contextmanager
def meta_build():
    """Build on the meta device with torch.nn.init made a no-op.

    Initialisers on meta tensors do nothing useful, and their first call imports
    torch._dynamo (seconds); shapes and names are all these tests look at.
    """
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_", "xavier_uniform_")
    with ExitStack() as stack:
        stack.enter_context(mock.patch.multiple(torch.nn.init, **{n: (lambda t, *a, **k: t) for n in names}))
        stack.enter_context(torch.device("meta"))
        yield


def official_cfg() -> GPTConfig:
    section = yaml.safe_load((REPO_ROOT / "checkpoints" / "config.yaml").read_text())["gpt"]
    return GPTConfig.from_yaml_section(section)


def expected_group_a(D, L, Nt, Nm, Tt, Tm) -> dict[str, tuple[int, ...]]:
    table = {
        "text_embedding.weight": (Nt + 1, D),
        "mel_embedding.weight": (Nm, D),
        "text_pos_embedding.emb.weight": (Tt + 2, D),
        "mel_pos_embedding.emb.weight": (Tm + 3, D),
        "speed_emb.weight": (2, D),
        "gpt.ln_f.weight": (D,),
        "gpt.ln_f.bias": (D,),
        "final_norm.weight": (D,),
        "final_norm.bias": (D,),
        "text_head.weight": (Nt + 1, D),
        "text_head.bias": (Nt + 1,),
        "mel_head.weight": (Nm, D),
        "mel_head.bias": (Nm,),
    }
    for i in range(L):
        p = f"gpt.h.{i}."
        table.update({
            p + "ln_1.weight": (D,),
            p + "ln_1.bias": (D,),
            p + "attn.c_attn.weight": (D, 3 * D),
            p + "attn.c_attn.bias": (3 * D,),
            p + "attn.c_proj.weight": (D, D),
            p + "attn.c_proj.bias": (D,),
            p + "ln_2.weight": (D,),
            p + "ln_2.bias": (D,),
            p + "mlp.c_fc.weight": (D, 4 * D),
            p + "mlp.c_fc.bias": (4 * D,),
            p + "mlp.c_proj.weight": (4 * D, D),
            p + "mlp.c_proj.bias": (D,),
        })
    return table


def test_official_config_values():
    cfg = official_cfg()
    assert PREFIX_LEN == 34  # 32 conditioning latents + speed_emb(1) + speed_emb(0)
    assert (cfg.model_dim, cfg.layers, cfg.heads) == (1280, 24, 20)
    assert (cfg.number_text_tokens, cfg.number_mel_codes) == (12000, 8194)
    assert (cfg.max_text_tokens, cfg.max_mel_tokens) == (600, 1815)
    assert (cfg.start_text_token, cfg.stop_text_token, cfg.start_mel_token, cfg.stop_mel_token) == (0, 1, 8192, 8193)


def test_official_state_dict_matches_reference_table():
    cfg = official_cfg()
    with meta_build():
        model = UnifiedVoiceGPT(cfg)
    sd = model.state_dict()
    assert all(t.is_meta for t in sd.values()), "the official-size model must not be allocated"

    expected = expected_group_a(D=1280, L=24, Nt=12000, Nm=8194, Tt=600, Tm=1815)
    assert len(expected) == 13 + 24 * 12
    got = {k: tuple(v.shape) for k, v in sd.items()}
    assert set(got) - set(expected) == set(), "unexpected keys"
    assert set(expected) - set(got) == set(), "missing keys"
    assert got == expected

    for key in got:
        assert not key.startswith(("gpt.wte.", "gpt.wpe.", "inference_model.")), key
        assert not key.endswith((".attn.bias", ".attn.masked_bias")), key
    # No buffers at all: every key is a parameter (trainable state only).
    assert set(dict(model.named_parameters())) == set(got)

    n_table = sum(math.prod(s) for s in expected.values())
    D, L = 1280, 24
    per_layer = 12 * D * D + 13 * D  # c_attn 3D^2+3D, c_proj D^2+D, c_fc 4D^2+4D, mlp c_proj 4D^2+D, 2 LNs 4D
    embeddings = (12001 + 8194 + 602 + 1818 + 2) * D
    rest = 4 * D + (12001 * D + 12001) + (8194 * D + 8194)
    assert n_table == L * per_layer + embeddings + rest
    assert sum(p.numel() for p in model.parameters()) == n_table
    # Reference: ~866M total of which ~339M is group B, so group A is ~527M.
    assert 520e6 < n_table < 535e6


# --- 2. forward contract ----------------------------------------------------------------------


def test_forward_upstream_layout_matches_reference_on_padded_batch():
    model = randomized_model().eval()
    batch = make_batch(text_lens=[5, 3, 1], code_lens=[4, 7, 2], seed=3)
    with torch.no_grad():
        text_logits, mel_logits = model(**batch, layout="upstream")
        ref_text, ref_mel = reference_forward(model, SMALL, batch)
    assert text_logits.shape == (3, 5 + 2, SMALL.number_text_tokens + 1)
    assert mel_logits.shape == (3, 7 + 2, SMALL.number_mel_codes)
    assert ref_text.abs().max() > 0.1  # not a degenerate comparison
    assert_close(text_logits, ref_text, atol=1e-5, rtol=0)
    assert_close(mel_logits, ref_mel, atol=1e-5, rtol=0)


def test_forward_depends_on_every_input():
    """The reference comparison above is only meaningful if each input actually matters."""
    model = randomized_model().eval()
    batch = make_batch(text_lens=[4, 4], code_lens=[5, 5], seed=4)
    with torch.no_grad():
        base = model(**batch, layout="upstream")
        for key in ("condition", "emo_vec"):
            changed = dict(batch, **{key: batch[key] + 0.5})
            out = model(**changed, layout="upstream")
            assert not torch.allclose(out[1], base[1]), key


def test_packed_equals_upstream_without_padding():
    model = randomized_model().eval()
    batch = make_batch(text_lens=[4, 4, 4], code_lens=[6, 6, 6], seed=5)
    with torch.no_grad():
        packed = model(**batch, layout="packed")
        upstream = model(**batch, layout="upstream")
    assert torch.equal(packed[0], upstream[0])
    assert torch.equal(packed[1], upstream[1])


def test_packed_and_upstream_differ_with_padding():
    # Documented difference: in the upstream layout mel positions attend to text padding.
    model = randomized_model().eval()
    batch = make_batch(text_lens=[5, 2], code_lens=[3, 3], seed=6)
    with torch.no_grad():
        packed = model(**batch, layout="packed")
        upstream = model(**batch, layout="upstream")
    # Sample 0 has no text padding: its valid mel logits agree.
    assert_close(packed[1][0, :5], upstream[1][0, :5], atol=1e-5, rtol=0)
    # Sample 1's mel sees 3 text-padding positions upstream but not packed.
    assert not torch.allclose(packed[1][1, :5], upstream[1][1, :5], atol=1e-4)


def test_packed_layout_is_batch_invariant_in_eval():
    model = randomized_model().eval()
    batch = make_batch(text_lens=[5, 2, 3], code_lens=[2, 7, 4], seed=7)
    with torch.no_grad():
        text_all, mel_all = model(**batch)
        for i in range(3):
            t_len, m_len = int(batch["text_lens"][i]), int(batch["code_lens"][i])
            text_one, mel_one = model(**select(batch, [i]))
            assert_close(text_all[i, :t_len + 2], text_one[0], atol=1e-5, rtol=0)
            assert_close(mel_all[i, :m_len + 2], mel_one[0], atol=1e-5, rtol=0)


def test_unknown_layout_is_rejected():
    model = randomized_model().eval()
    with pytest.raises(ValueError, match="layout"):
        model(**make_batch([2], [2]), layout="sideways")


def test_loss_sums_match_reference_cross_entropy_without_padding():
    model = randomized_model().eval()
    batch = make_batch(text_lens=[4, 4], code_lens=[6, 6], seed=8)
    with torch.no_grad():
        sums = model.loss_sums(**batch)
        ref_text, ref_mel = reference_forward(model, SMALL, batch)
    _, text_tgt = reference_segments(batch["text_ids"], batch["text_lens"], 0, 1)
    _, mel_tgt = reference_segments(batch["codes"], batch["code_lens"], 28, 29)
    expected_text = F.cross_entropy(ref_text.reshape(-1, ref_text.shape[-1]), text_tgt.reshape(-1), reduction="sum")
    expected_mel = F.cross_entropy(ref_mel.reshape(-1, ref_mel.shape[-1]), mel_tgt.reshape(-1), reduction="sum")
    assert_close(sums["text_ce"], expected_text, atol=1e-4, rtol=1e-5)
    assert_close(sums["mel_ce"], expected_mel, atol=1e-4, rtol=1e-5)
    assert int(sums["text_tokens"]) == 2 * (4 + 1)
    assert int(sums["mel_tokens"]) == 2 * (6 + 1)
    valid = mel_tgt >= 0
    correct = (ref_mel.argmax(-1)[valid] == mel_tgt[valid]).sum()
    assert int(sums["mel_correct"]) == int(correct)


# --- 3. micro-batch invariance with per-sample dropout ------------------------------------------


LENS = dict(text_lens=[5, 2, 4, 1], code_lens=[3, 8, 6, 2])


def loss_and_grads(model, batch, keys):
    sums = model.loss_sums(**batch, dropout_keys=keys)
    params = [p for _, p in model.named_parameters()]
    grads = torch.autograd.grad(sums["text_ce"] + sums["mel_ce"], params)
    return {k: v.detach() for k, v in sums.items()}, grads


@pytest.mark.parametrize("groups", [[[0], [1], [2], [3]], [[0, 1], [2, 3]], [[3, 0], [2, 1]]])
def test_loss_sums_and_grads_are_micro_batch_invariant(groups):
    model = randomized_model().train()
    batch = make_batch(**LENS, seed=9, T=7, M=10)  # extra padding beyond the longest sample too
    indices = torch.tensor([10, 11, 12, 13])
    whole, whole_grads = loss_and_grads(model, batch, dropout_keys(1234, 5, indices))

    total = {k: torch.zeros_like(v) for k, v in whole.items()}
    total_grads = [torch.zeros_like(g) for g in whole_grads]
    for rows in groups:
        part, part_grads = loss_and_grads(model, select(batch, rows), dropout_keys(1234, 5, indices[rows]))
        for k in total:
            total[k] = total[k] + part[k]
        total_grads = [a + b for a, b in zip(total_grads, part_grads)]

    for k in ("text_tokens", "mel_tokens", "mel_correct"):
        assert int(total[k]) == int(whole[k]), k
    assert int(whole["text_tokens"]) == sum(n + 1 for n in LENS["text_lens"])
    assert int(whole["mel_tokens"]) == sum(n + 1 for n in LENS["code_lens"])
    assert_close(total["text_ce"], whole["text_ce"], rtol=1e-5, atol=1e-5)
    assert_close(total["mel_ce"], whole["mel_ce"], rtol=1e-5, atol=1e-5)
    names = [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, total_grads, whole_grads):
        assert_close(a, b, rtol=1e-5, atol=1e-6, what=name)
    # Every parameter takes part in the loss.
    assert all(g.abs().sum() > 0 for g in whole_grads)


def test_dropout_is_active_deterministic_and_keyed():
    model = randomized_model()
    batch = make_batch(**LENS, seed=10)
    indices = torch.arange(4)
    keys = dropout_keys(7, 3, indices)
    with torch.no_grad():
        model.eval()
        eval_loss = model.loss_sums(**batch, dropout_keys=keys)["mel_ce"]
        model.train()
        a = model.loss_sums(**batch, dropout_keys=keys)
        b = model.loss_sums(**batch, dropout_keys=dropout_keys(7, 3, indices))
        other_step = model.loss_sums(**batch, dropout_keys=dropout_keys(7, 4, indices))
        other_seed = model.loss_sums(**batch, dropout_keys=dropout_keys(8, 3, indices))
    assert not torch.allclose(a["mel_ce"], eval_loss), "dropout must be active in train mode"
    assert torch.equal(a["mel_ce"], b["mel_ce"]) and torch.equal(a["text_ce"], b["text_ce"])
    assert not torch.equal(a["mel_ce"], other_step["mel_ce"])
    assert not torch.equal(a["mel_ce"], other_seed["mel_ce"])


def test_dropout_sites_embedding_and_two_residuals_per_layer(monkeypatch):
    """Reference: embedding dropout first, then dropout on both residual branches of every block,
    each with its own mask (site)."""
    calls = []
    real_call = SampleDropout.__call__

    def recording_call(self, x, site):
        calls.append((site, self.active))
        return real_call(self, x, site)

    monkeypatch.setattr(SampleDropout, "__call__", recording_call)
    model = randomized_model().train()
    with torch.no_grad():
        model.loss_sums(**make_batch(**LENS), dropout_keys=dropout_keys(0, 0, torch.arange(4)))
    sites = [s for s, _ in calls]
    assert sites[0] == 0  # embedding dropout comes first
    assert sorted(sites) == list(range(1 + 2 * SMALL.layers))  # each site once, all distinct
    assert all(active for _, active in calls)


def test_embedding_dropout_alone_changes_output():
    cfg = GPTConfig(**{**SMALL.to_dict(), "layers": 0})
    model = randomized_model(cfg)
    batch = make_batch(**LENS)
    keys = dropout_keys(0, 0, torch.arange(4))
    with torch.no_grad():
        model.eval()
        eval_out = model(**batch, dropout_keys=keys)[1]
        model.train()
        train_out = model(**batch, dropout_keys=keys)[1]
    assert not torch.allclose(eval_out, train_out)


def test_dropout_keys_are_distinct_and_stable():
    k = dropout_keys(0, 0, torch.arange(1000))
    assert k.dtype == torch.int64 and k.shape == (1000,)
    assert len(set(k.tolist())) == 1000
    assert bool(((k >= 0) & (k < 2**32)).all())
    assert torch.equal(k, dropout_keys(0, 0, torch.arange(1000)))
    assert torch.equal(k[[5, 9]], dropout_keys(0, 0, torch.tensor([5, 9])))
    assert not torch.equal(k, dropout_keys(0, 1, torch.arange(1000)))
    assert not torch.equal(k, dropout_keys(1, 0, torch.arange(1000)))
    # Huge seeds and steps do not overflow.
    big = dropout_keys(2**40 + 3, 2**33, torch.arange(4))
    assert bool(((big >= 0) & (big < 2**32)).all())


def test_sample_dropout_mask_rate_scale_and_independence():
    p, seq, dim = 0.1, 64, 32
    keys = dropout_keys(1, 2, torch.arange(3))
    drop = SampleDropout(p, keys, seq, dim, torch.device("cpu"))
    out = drop(torch.ones(3, seq, dim), site=4)
    kept = out != 0
    rate = 1.0 - kept.float().mean().item()
    assert 0.07 < rate < 0.13
    assert_close(out[kept], torch.full_like(out[kept], 1.0 / (1.0 - p)), atol=1e-6)
    # Sample 1's mask does not depend on its batch-mates.
    alone = SampleDropout(p, keys[1:2], seq, dim, torch.device("cpu"))(torch.ones(1, seq, dim), site=4)
    assert torch.equal(out[1:2], alone)
    # Different samples and different sites get different masks.
    assert not torch.equal(kept[0], kept[1])
    assert not torch.equal(out, drop(torch.ones(3, seq, dim), site=5))
    # No keys: identity.
    x = torch.randn(2, seq, dim)
    assert torch.equal(SampleDropout(p, None, seq, dim, torch.device("cpu"))(x, 0), x)


# --- 4. gradient checkpointing ----------------------------------------------------------------


def test_gradient_checkpointing_is_bit_identical(monkeypatch):
    plain = randomized_model().train()
    ckpt = UnifiedVoiceGPT(SMALL, gradient_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.train()

    calls = []
    real_checkpoint = gpt_model.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(gpt_model, "checkpoint", counting_checkpoint)

    batch = make_batch(**LENS, seed=11)
    keys = dropout_keys(99, 1, torch.arange(4))
    loss_a, grads_a = loss_and_grads(plain, batch, keys)
    assert calls == []
    loss_b, grads_b = loss_and_grads(ckpt, batch, keys)
    assert len(calls) == SMALL.layers, "checkpointing must actually be used"
    for k in loss_a:
        assert torch.equal(loss_a[k], loss_b[k]), k
    for (name, _), a, b in zip(plain.named_parameters(), grads_a, grads_b):
        assert torch.equal(a, b), name


# --- 5. teacher-forcing inputs and targets ------------------------------------------------------


def test_text_io_and_mel_io_hand_worked_example():
    model = randomized_model()
    ids = torch.tensor([[5, 6, 7], [8, 9, 4]])
    lens = torch.tensor([3, 1])
    text_in, text_tgt = model.text_io(ids, lens)
    assert text_in.tolist() == [[0, 5, 6, 7, 1], [0, 8, 1, 1, 1]]
    assert text_tgt.tolist() == [[5, 6, 7, 1, -100], [8, 1, -100, -100, -100]]

    codes = torch.tensor([[3, 4], [27, 0]])
    mel_in, mel_tgt = model.mel_io(codes, torch.tensor([0, 2]))
    assert mel_in.tolist() == [[28, 29, 29, 29], [28, 27, 0, 29]]
    assert mel_tgt.tolist() == [[29, -100, -100, -100], [27, 0, 29, -100]]

    # Official special ids.
    official = official_cfg()
    with meta_build():
        big = UnifiedVoiceGPT(official)
    mel_in, mel_tgt = big.mel_io(torch.tensor([[100, 200, 300]]), torch.tensor([2]))
    assert mel_in.tolist() == [[8192, 100, 200, 8193, 8193]]
    assert mel_tgt.tolist() == [[100, 200, 8193, -100, -100]]


def test_io_matches_reference_description_on_random_batches():
    model = randomized_model()
    g = torch.Generator().manual_seed(12)
    for _ in range(20):
        b, n = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(2, 20, (b, n), generator=g)
        lens = torch.randint(0, n + 1, (b,), generator=g)
        for method, start, stop in ((model.text_io, 0, 1), (model.mel_io, 28, 29)):
            got_in, got_tgt = method(ids, lens)
            ref_in, ref_tgt = reference_segments(ids, lens, start, stop)
            assert torch.equal(got_in, ref_in)
            assert torch.equal(got_tgt, ref_tgt)
            assert got_in.shape == (b, n + 2)
            # Inputs are targets shifted right by one, behind the start token.
            assert torch.equal(got_in[:, 1:][got_tgt[:, :-1] >= 0], got_tgt[:, :-1][got_tgt[:, :-1] >= 0])
    # Input ids are not modified in place.
    ids = torch.tensor([[5, 6, 7]])
    model.text_io(ids, torch.tensor([1]))
    assert ids.tolist() == [[5, 6, 7]]


# --- 6. split_state_dict ----------------------------------------------------------------------


def test_split_state_dict_groups_keys():
    t = lambda: torch.zeros(1)  # noqa: E731
    state = {
        "text_embedding.weight": t(),
        "gpt.h.0.ln_1.weight": t(),
        "gpt.h.0.attn.bias": t(),
        "gpt.h.0.attn.masked_bias": t(),
        "gpt.wte.weight": t(),
        "inference_model.lm_head.0.weight": t(),
        "emovec_layer.weight": t(),
        "emo_layer.bias": t(),
        "conditioning_encoder.embed.pos_enc.pe": t(),
        "perceiver_encoder.latents": t(),
        "emo_conditioning_encoder.encoders.0.norm_ff.weight": t(),
        "emo_perceiver_encoder.latents": t(),
        "something_new.weight": t(),
    }
    trained, carried, dropped = split_state_dict(state)
    assert set(trained) == {"text_embedding.weight", "gpt.h.0.ln_1.weight", "something_new.weight"}
    assert set(carried) == {
        "emovec_layer.weight",
        "emo_layer.bias",
        "conditioning_encoder.embed.pos_enc.pe",
        "perceiver_encoder.latents",
        "emo_conditioning_encoder.encoders.0.norm_ff.weight",
        "emo_perceiver_encoder.latents",
    }
    assert set(dropped) == {
        "gpt.h.0.attn.bias",
        "gpt.h.0.attn.masked_bias",
        "gpt.wte.weight",
        "inference_model.lm_head.0.weight",
    }
    for key, value in carried.items():
        assert value is state[key]  # carried through untouched

    prefixed = {"module." + k: v for k, v in state.items()}
    trained_p, carried_p, dropped_p = split_state_dict(prefixed)
    assert set(trained_p) == set(trained)
    assert set(carried_p) == set(carried)
    assert set(dropped_p) == set(dropped)
    assert all(carried_p[k] is state[k] for k in carried)


def test_split_state_dict_official_model_roundtrip():
    model = randomized_model()
    sd = model.state_dict()
    trained, carried, dropped = split_state_dict(sd)
    assert set(trained) == set(sd) and carried == {} and dropped == []


def test_a_packed_length_from_the_host_gives_the_same_losses():
    """The trainer reads the packed length from the host copy of the lengths (no GPU sync); the
    model then skips reading it from the device, with the same result to the bit."""
    from trainers.model.gpt_model import packed_length

    model = randomized_model().train()
    batch = make_batch(**LENS, seed=3)
    keys = dropout_keys(5, 2, torch.arange(4))
    own = model.loss_sums(**batch, dropout_keys=keys)
    given = model.loss_sums(**batch, dropout_keys=keys,
                            packed_len=packed_length(batch["text_lens"], batch["code_lens"]))
    assert all(torch.equal(own[k], given[k]) for k in own)


def test_training_and_validation_never_read_the_packed_length_on_the_device(tmp_path, monkeypatch):
    from tests.demo_runs import small_corpus_flags, train_here
    from trainers.model import gpt_model

    fallback_calls = []
    original = gpt_model._read_packed_length
    monkeypatch.setattr(gpt_model, "_read_packed_length", lambda *a: fallback_calls.append(1) or original(*a))
    result = train_here(tmp_path / "run", *small_corpus_flags(tmp_path / "data"), "--effective-batch", "4",
                        "--batch-size", "2", "--max-steps", "2", "--warmup-steps", "1", "--min-lr-ratio", "0.1",
                        "--dropout", "0.1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert fallback_calls == []  # every forward of the run (steps and validations) was given the length
    model = gpt_model.UnifiedVoiceGPT(TINY_GPT).train()
    model.loss_sums(**make_batch(**LENS, cfg=TINY_GPT), dropout_keys=dropout_keys(0, 0, torch.arange(4)))
    assert fallback_calls == [1]  # the patch is live: a call without the length reads it
