"""Sample-keyed dropout masks (trainers/model/sample_dropout.py): v1 kept exactly, v2 fast and well mixed, v3 made
in the kernel that applies it (trainers/model/fused_masks.py).

The reference formulas below are written from the definitions, in exact integer arithmetic,
not by calling the module's helpers, so a drift in the code shows up here.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests.conftest import TINY_GPT
from tests.demo_runs import assert_same_training, small_corpus_flags, train, train_here
from tests.test_gpt_model import LENS, assert_close, loss_and_grads, make_batch, randomized_model, select
from trainers.checkpoint import schema
from trainers.config.settings import EXACTNESS_KEYS, TrainConfig, saved_settings
from trainers.model import fused_masks, gpt_model, sample_dropout
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.sample_dropout import DEFAULT_MASKS, SampleDropout, dropout_keys

CPU = torch.device("cpu")
M32 = 0xFFFFFFFF


# --- exact references ---------------------------------------------------------------------------


def mix32(x: int) -> int:
    """The 32-bit integer mixer both versions use (Python ints: no overflow question)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def v1_reference(p: float, keys: list[int], seq: int, dim: int, site: int) -> torch.Tensor:
    """Keep mask of the first implementation: mix32(cell + mix32(key + site * C)) >= p * 2**32."""
    keep = torch.zeros(len(keys), seq * dim, dtype=torch.bool)
    for b, key in enumerate(keys):
        site_key = mix32((key + site * 0x27D4EB2F) & M32)
        for cell in range(seq * dim):
            keep[b, cell] = mix32((cell + site_key) & M32) >= int(p * 2**32)
    return keep.view(len(keys), seq, dim)


def v2_reference(p: float, keys: list[int], seq: int, dim: int, site: int) -> torch.Tensor:
    """Keep mask of v2, from its definition.

    Cell i = position * dim + channel uses 16-bit half i % 2 (low half first) of word w = i // 2:
    h = mix32(w * 0x9E3779B1 + 0x632BE5AB); z = (h ^ a) * m; z ^= z >> 16; z *= 0x846CA68B
    (mod 2**32), with a = mix32(key + site * 0x27D4EB2F) and m = mix32(a ^ 0x5BD1E995) | 1.
    The cell is kept iff that half, read as a signed 16-bit number, is >= round(p * 2**16) - 2**15.
    """
    threshold = round(p * 2**16) - 2**15
    keep = torch.zeros(len(keys), seq * dim, dtype=torch.bool)
    for b, key in enumerate(keys):
        a = mix32((key + site * 0x27D4EB2F) & M32)
        m = mix32(a ^ 0x5BD1E995) | 1
        for cell in range(seq * dim):
            z = ((mix32((cell // 2 * 0x9E3779B1 + 0x632BE5AB) & M32) ^ a) * m) & M32
            z ^= z >> 16
            z = (z * 0x846CA68B) & M32
            half = (z >> (16 * (cell % 2))) & 0xFFFF
            keep[b, cell] = (half - 2**16 if half >= 2**15 else half) >= threshold
    return keep.view(len(keys), seq, dim)


def v3_reference(p: float, keys: list[int], seq: int, dim: int, site: int) -> np.ndarray:
    """Keep mask of v3, from its definition, in numpy's unsigned 64-bit integers (no torch code involved).

    Cell i = position * dim + channel: u = mix32(i * 0x9E3779B1 + 0x632BE5AB), z = mix32(u ^ a) (mod 2**32), with
    a = mix32(key + site * 0x27D4EB2F); the cell is kept iff z >= round(p * 2**32).
    """
    m32 = np.uint64(M32)

    def mix(x: np.ndarray) -> np.ndarray:
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(0x7FEB352D)) & m32
        x = x ^ (x >> np.uint64(15))
        x = (x * np.uint64(0x2C1B3C6D)) & m32
        return x ^ (x >> np.uint64(16))

    cells = np.arange(seq * dim, dtype=np.uint64)
    u = mix((cells * np.uint64(0x9E3779B1) + np.uint64(0x632BE5AB)) & m32)
    threshold = np.uint64(min(round(p * 2**32), 2**32 - 1))
    keep = [mix(u ^ np.uint64(mix32((key + site * 0x27D4EB2F) & M32))) >= threshold for key in keys]
    return np.stack(keep).reshape(len(keys), seq, dim)


def unmix32(y: int) -> int:
    """Inverse of mix32 (xorshifts and odd multipliers are invertible modulo 2**32)."""
    y ^= y >> 16
    y = (y * pow(0x2C1B3C6D, -1, 2**32)) & M32
    y ^= (y >> 15) ^ (y >> 30)
    y = (y * pow(0x7FEB352D, -1, 2**32)) & M32
    return y ^ (y >> 16)


def kept(drop: SampleDropout, shape: tuple[int, int, int], site: int) -> torch.Tensor:
    return drop(torch.ones(shape), site) != 0


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).mean() / (a.std(unbiased=False) * b.std(unbiased=False)))


# --- v1: the first implementation, bit for bit ----------------------------------------------------


def test_v1_reproduces_the_first_implementation():
    keys = dropout_keys(1234, 5, torch.arange(3))
    # Captured from commit 7957162 (before v2 existed): dropout_keys and the dropped cells.
    assert keys.tolist() == [3046673959, 1302028744, 2070811894]
    drop = SampleDropout(0.25, keys, 5, 8, CPU, version="v1")
    out = drop(torch.ones(3, 5, 8), site=3)
    dropped = [(out[b].flatten() == 0).nonzero().flatten().tolist() for b in range(3)]
    assert dropped == [[0, 1, 4, 5, 11, 14, 16, 22, 28, 29, 33, 38], [7, 10, 11, 28, 29, 30, 36],
                       [5, 6, 7, 12, 14, 20, 25, 26, 29, 37, 38]]
    assert out.unique().tolist() == [0.0, pytest.approx(4 / 3)]
    # And against the formula, on other shapes, rates and sites.
    for p, seq, dim, site in ((0.1, 7, 6, 0), (0.5, 3, 5, 4)):
        keys = dropout_keys(9, 2, torch.arange(4))
        drop = SampleDropout(p, keys, seq, dim, CPU, version="v1")
        assert torch.equal(kept(drop, (4, seq, dim), site), v1_reference(p, keys.tolist(), seq, dim, site))


def test_v1_model_uses_the_first_implementation_at_every_site(monkeypatch):
    """A v1 model gives the same loss and gradients as one whose dropout is the reference formula."""
    batch = make_batch(**LENS, seed=13)
    keys = dropout_keys(5, 6, torch.arange(4))
    model = randomized_model(dropout_masks="v1").train()
    loss, grads = loss_and_grads(model, batch, keys)

    def reference_call(self, x, site):
        keep = v1_reference(self.p, self.keys.flatten().tolist(), x.shape[1], x.shape[2], site)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    monkeypatch.setattr(SampleDropout, "__call__", reference_call)
    ref_loss, ref_grads = loss_and_grads(model, batch, keys)
    assert torch.equal(loss["mel_ce"], ref_loss["mel_ce"]) and torch.equal(loss["text_ce"], ref_loss["text_ce"])
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


# --- v2: definition, rate, mixing ---------------------------------------------------------------


@pytest.mark.parametrize("p, seq, dim, site", [(0.1, 6, 8, 0), (0.3, 5, 7, 3), (0.5, 3, 5, 9)])
def test_v2_matches_its_exact_definition(p, seq, dim, site):
    """The int32 kernel (wrapping products, shifts, 16-bit halves) equals the exact integer formula,
    odd seq * dim included (the last word's upper half is unused)."""
    keys = dropout_keys(77, 3, torch.arange(3))
    drop = SampleDropout(p, keys, seq, dim, CPU, version="v2")
    assert torch.equal(kept(drop, (3, seq, dim), site), v2_reference(p, keys.tolist(), seq, dim, site))
    assert torch.equal(drop.keep_mask(site, torch.float32), v2_reference(p, keys.tolist(), seq, dim, site).float())


@pytest.mark.parametrize("p, seq, dim, site", [(0.1, 6, 8, 0), (0.3, 5, 7, 3), (0.5, 3, 5, 9), (0.1, 411, 321, 48)])
def test_v3_matches_its_exact_definition(p, seq, dim, site):
    """The eager function (the CPU's path, in chunks: the last case spans several) equals the definition computed
    in numpy: the kept cells, their values (x * 1/(1-p) exactly) and keep_mask."""
    keys = dropout_keys(77, 3, torch.tensor([0, 5, 70001]))
    drop = SampleDropout(p, keys, seq, dim, CPU, version="v3")
    reference = torch.from_numpy(v3_reference(p, keys.tolist(), seq, dim, site))
    x = torch.randn(3, seq, dim)
    out = drop(x, site)
    assert torch.equal(out != 0, reference)
    assert torch.equal(out, torch.where(reference, x * (1.0 / (1.0 - p)), 0.0))
    assert torch.equal(drop.keep_mask(site, torch.float32), reference.float())


def test_v3_no_value_reaches_2_63_and_larger_samples_are_refused():
    """Why v3's int64 arithmetic overflows nowhere (so eager, inductor's C++ and CUDA's Triton agree): the counter's
    largest product stays below 2**63, and a sample with more cells than that allows is refused, not wrapped."""
    assert (fused_masks.MAX_CELLS - 1) * fused_masks.CELL_MUL + fused_masks.CELL_ADD < 2**63
    assert fused_masks.CELL_MUL < 2**32 and fused_masks.CELL_ADD < 2**32
    assert M32 * 0x7FEB352D < 2**63 and M32 * 0x2C1B3C6D < 2**63  # the mixer's products (mask_hash.hash32)
    assert fused_masks.threshold(0.999999999999) == 2**32 - 1 and fused_masks.threshold(0.1) == round(0.1 * 2**32)
    with pytest.raises(ValueError, match="at most"):
        SampleDropout(0.1, torch.zeros(1), 2**16, 2**15, CPU, version="v3")


def test_v2_is_the_default():
    assert DEFAULT_MASKS == "v2" == TrainConfig.dropout_masks
    assert sample_dropout.MASK_VERSIONS == ("v1", "v2", "v3")
    assert UnifiedVoiceGPT(TINY_GPT).dropout_masks == "v2"
    assert gpt_model.dropout_keys is dropout_keys  # the trainer and the batch probe import it from there
    with pytest.raises(ValueError, match="dropout_masks"):
        UnifiedVoiceGPT(TINY_GPT, dropout_masks="v4")
    with pytest.raises(ValueError, match="mask version"):
        SampleDropout(0.1, torch.zeros(1), 2, 2, CPU, version="v0")


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
@pytest.mark.parametrize("p", [0.02, 0.1, 0.5])
def test_rate_and_scale(version, p):
    b, seq, dim = 8, 128, 256
    keys = dropout_keys(1, 2, torch.arange(b))
    drop = SampleDropout(p, keys, seq, dim, CPU, version=version)
    for site in (0, 7):
        out = drop(torch.ones(b, seq, dim), site)
        keep = out != 0
        # Within 5 binomial standard deviations, over all cells and per sample.
        rate = 1.0 - keep.double().mean().item()
        assert abs(rate - p) < 5 * (p * (1 - p) / keep.numel()) ** 0.5, rate
        per_sample = 1.0 - keep.double().mean(dim=(1, 2))
        assert ((per_sample - p).abs() < 5 * (p * (1 - p) / (seq * dim)) ** 0.5).all(), per_sample
        assert_close(out[keep], torch.full_like(out[keep], 1.0 / (1.0 - p)), atol=1e-6)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_masks_of_samples_positions_and_sites_are_uncorrelated(version):
    """Two samples' masks are not shifted windows of one sequence, and no cell predicts another:
    correlations at the same cell, at shifts of 1, 2, 3, D and a few positions, and between
    sites stay within 5/sqrt(n) (n = cells compared)."""
    b, seq, dim, p = 6, 96, 128, 0.1
    keys = dropout_keys(3, 9, torch.arange(b))
    drop = SampleDropout(p, keys, seq, dim, CPU, version=version)
    masks = {site: kept(drop, (b, seq, dim), site).view(b, -1) for site in (1, 2, 10)}
    n = seq * dim
    worst = 0.0
    for i in range(b):
        for j in range(b):
            for shift in (0, 1, 2, 3, dim, dim + 1, 3 * dim, 7 * dim + 5):
                if i == j and shift == 0:
                    continue
                c = corr(masks[1][i, : n - shift], masks[1][j, shift:])
                assert abs(c) < 5 / (n - shift) ** 0.5, (i, j, shift, c)
                worst = max(worst, abs(c))
            for other in (2, 10):
                c = corr(masks[1][i], masks[other][j])
                assert abs(c) < 5 / n**0.5, (i, j, other, c)
    assert worst > 0  # the loop ran


@pytest.mark.parametrize("shift", [1, 128, 37 * 128 + 3])
def test_v2_masks_are_not_shifted_windows_of_one_sequence(shift):
    """v1 hashes cell + site key, so two samples whose site keys differ by s have masks that are
    the same sequence shifted by s (measured below). v2 and v3 do not: with such keys their masks stay
    uncorrelated at that shift and at the same cell."""
    seq, dim, site = 64, 128, 3
    first = int(dropout_keys(8, 1, torch.tensor([0]))[0])
    site_key = mix32((first + site * 0x27D4EB2F) & M32)
    second = (unmix32((site_key + shift) & M32) - site * 0x27D4EB2F) & M32
    assert mix32((second + site * 0x27D4EB2F) & M32) == (site_key + shift) & M32
    keys, n = torch.tensor([first, second]), seq * dim
    masks = {v: kept(SampleDropout(0.1, keys, seq, dim, CPU, version=v), (2, seq, dim), site).view(2, -1)
             for v in ("v1", "v2", "v3")}
    assert torch.equal(masks["v1"][0, shift:], masks["v1"][1, : n - shift])  # v1's flaw, for the record
    for v in ("v2", "v3"):
        assert abs(corr(masks[v][0, shift:], masks[v][1, : n - shift])) < 5 / (n - shift) ** 0.5, v
        assert abs(corr(masks[v][0], masks[v][1])) < 5 / n**0.5, v


def test_v2_related_site_keys_still_give_unrelated_masks():
    """The per-(sample, site) multiplier is what separates keys that differ in a few high bits;
    with one shared multiplier such keys give correlated masks (measured: -0.11 for the top bit)."""
    seq, dim = 64, 128
    drop = SampleDropout(0.1, dropout_keys(0, 0, torch.arange(2)), seq, dim, CPU)
    add, mul = drop._keys_of_site(0)
    for bit in (23, 26, 29, 30, 31):
        related = add.clone()
        related[1] = related[0] ^ sample_dropout._to_int32(torch.tensor(1 << bit))
        drop._site_keys[1000 + bit] = (related, mul)
        m = drop.keep_mask(1000 + bit, torch.float32).view(2, -1)
        assert abs(corr(m[0], m[1])) < 5 / (seq * dim) ** 0.5, bit


def test_v3_site_keys_one_bit_apart_give_unrelated_masks():
    """v3 mixes the key into the counter's hash with a second full round of the mixer: two site keys that differ in
    any single bit (or by a small sum) give masks uncorrelated at the same cell and at neighbouring cells."""
    n = 64 * 128
    first = int(fused_masks.site_keys(dropout_keys(0, 0, torch.arange(1)), 0))
    for other in [first ^ (1 << bit) for bit in range(32)] + [(first + d) & M32 for d in (1, 2, 3, 1 << 16)]:
        m = fused_masks.mask_and_scale(torch.ones(2, n), torch.tensor([[first], [other]]), 0, 2**31, 1.0)
        for shift in (0, 1, 2):
            c = corr(m[0, shift:], m[1, : n - shift])
            assert abs(c) < 5 / (n - shift) ** 0.5, (hex(first ^ other), shift, c)


# --- invariances --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
@pytest.mark.parametrize("dim", [16, 15])
def test_mask_of_a_sample_ignores_batch_mates_and_padding(version, dim):
    keys = dropout_keys(11, 4, torch.tensor([40, 41, 42]))
    whole = SampleDropout(0.2, keys, 9, dim, CPU, version=version)
    for site in (0, 3):
        all_three = kept(whole, (3, 9, dim), site)
        # Sample 41 alone, in a shorter (less padded) batch.
        alone = SampleDropout(0.2, keys[1:2], 6, dim, CPU, version=version)
        assert torch.equal(kept(alone, (1, 6, dim), site), all_three[1:2, :6])
        # Samples 42 and 40 in another order, padded longer.
        longer = SampleDropout(0.2, keys[[2, 0]], 13, dim, CPU, version=version)
        assert torch.equal(kept(longer, (2, 13, dim), site)[:, :9], all_three[[2, 0]])


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_model_loss_and_grads_are_micro_batch_and_padding_invariant(version):
    model = randomized_model(dropout_masks=version).train()
    batch = make_batch(**LENS, seed=9, T=7, M=10)
    indices = torch.tensor([10, 11, 12, 13])
    whole, whole_grads = loss_and_grads(model, batch, dropout_keys(1234, 5, indices))
    # Sample 3 alone packs to 41 positions, the others and the whole batch to 48: its masks
    # must not depend on how much padding its batch-mates add.
    parts = [loss_and_grads(model, select(batch, rows), dropout_keys(1234, 5, indices[rows])) for rows in ([3], [0, 2, 1])]
    assert_close(parts[0][0]["mel_ce"] + parts[1][0]["mel_ce"], whole["mel_ce"], rtol=1e-5, atol=1e-5)
    for a, b, c in zip(parts[0][1], parts[1][1], whole_grads):
        assert_close(a + b, c, rtol=1e-5, atol=1e-5)
    # Masks matter here: another step's masks move the loss far beyond that tolerance.
    other, _ = loss_and_grads(model, batch, dropout_keys(1234, 6, indices))
    assert (other["mel_ce"] - whole["mel_ce"]).abs() > 1e-3


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_gradient_checkpointing_is_bit_identical(version):
    plain = randomized_model(dropout_masks=version).train()
    ckpt = UnifiedVoiceGPT(TINY_GPT, gradient_checkpointing=True, dropout_masks=version)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.train()
    batch = make_batch(**LENS, seed=11)
    keys = dropout_keys(99, 1, torch.arange(4))
    loss_a, grads_a = loss_and_grads(plain, batch, keys)
    loss_b, grads_b = loss_and_grads(ckpt, batch, keys)
    assert all(torch.equal(loss_a[k], loss_b[k]) for k in loss_a)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.parametrize("chunk", [2, 6, 64, 1 << 18])
@pytest.mark.parametrize("dim", [16, 15])
def test_v2_cpu_chunks_give_the_whole_batch_masks(monkeypatch, chunk, dim):
    """On CPU masks are made in chunks (cache-sized); on a GPU for the whole batch at once.
    Both give the same result, whatever the chunk size, odd cell counts included."""
    monkeypatch.setattr(sample_dropout, "_CPU_CHUNK", chunk)
    drop = SampleDropout(0.2, dropout_keys(6, 6, torch.arange(3)), 9, dim, CPU)
    x = torch.randn(3, 9, dim)
    whole_batch = torch.addcmul(torch.zeros(()), x, drop.keep_mask(4, x.dtype), value=drop.scale)
    assert torch.equal(drop.apply_mask(x, 4), whole_batch)


@pytest.mark.parametrize("chunk", [1, 6, 1 << 17])
@pytest.mark.parametrize("dim", [16, 15])
def test_v3_cpu_chunks_give_the_whole_batch_masks(monkeypatch, chunk, dim):
    """On CPU v3 runs eagerly in chunks of cells (at least 1024 per sample); compiled, in one piece. Both give the
    masks of the definition applied to the whole batch at once."""
    monkeypatch.setattr(fused_masks, "_CPU_CELLS", chunk)
    drop = SampleDropout(0.2, dropout_keys(6, 6, torch.arange(3)), 300, dim, CPU, version="v3")
    x = torch.randn(3, 300, dim)
    keys = fused_masks.site_keys(drop.keys, 4)
    assert torch.equal(drop(x, 4), fused_masks.mask_and_scale(x.view(3, -1), keys, 0, drop.threshold, drop.scale)
                       .view(x.shape))


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_backward_regenerates_the_forward_mask_and_saves_nothing(version):
    seq, dim, p = 10, 16, 0.3
    drop = SampleDropout(p, dropout_keys(2, 2, torch.arange(3)), seq, dim, CPU, version=version)
    x = torch.randn(3, seq, dim, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = drop(x, 5)
    assert saved == []  # no mask (or input) kept for backward
    g = torch.randn(3, seq, dim)
    (grad,) = torch.autograd.grad(y, x, g)
    keep = drop.keep_mask(5, torch.float32)
    assert torch.equal(y, x.detach() * keep * (1 / (1 - p)))
    assert torch.equal(grad, g * keep * (1 / (1 - p)))


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_no_dropout_in_eval_or_at_zero_rate(version):
    batch = make_batch(**LENS, seed=12)
    keys = dropout_keys(4, 4, torch.arange(4))
    model = randomized_model(dropout_masks=version)
    with torch.no_grad():
        model.eval()
        eval_keyed = model(**batch, dropout_keys=keys)
        eval_plain = model(**batch)
        model.train()
        train_keyed = model(**batch, dropout_keys=keys)
        zero = randomized_model(GPTConfig(**{**TINY_GPT.to_dict(), "dropout": 0.0}), dropout_masks=version).train()
        zero_keyed = zero(**batch, dropout_keys=keys)
    assert all(torch.equal(a, b) for a, b in zip(eval_keyed, eval_plain))
    assert all(torch.equal(a, b) for a, b in zip(zero_keyed, eval_plain))  # same weights (same seed)
    assert not torch.allclose(train_keyed[1], eval_plain[1])


# --- v3 compiled: what CUDA runs, compiled here for the CPU once ------------------------------------------------


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor needs a C++ compiler on a CPU")
def test_v3_compiled_is_the_eager_function_bit_for_bit():
    """On CUDA v3 runs torch.compile of mask_and_scale (inductor: one fused kernel). Here inductor compiles the same
    function for the CPU (C++ instead of Triton, the same int64 graph) and gives what the eager function gives:
    the masks and values of an odd shape, and a model's loss and gradients, plain and under gradient
    checkpointing, which call it in forward, backward and recomputation. (The one compiled test: about 4 s with
    inductor's cache warm, 12 s cold; benchmarks/gpu_acceptance.py compares CUDA's masks with the CPU's.)"""
    batch, keys = make_batch(**LENS, seed=11), dropout_keys(99, 1, torch.arange(4))
    plain = randomized_model(dropout_masks="v3").train()
    checkpointed = UnifiedVoiceGPT(TINY_GPT, gradient_checkpointing=True, dropout_masks="v3")
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.train()
    x = torch.randn(3, 37 * 63)
    site = fused_masks.site_keys(dropout_keys(1234, 7, torch.tensor([5, 900, 70001])), 48)
    eager = [loss_and_grads(plain, batch, keys), fused_masks.apply(x, site, fused_masks.threshold(0.1), 1 / 0.9)]
    try:
        with fused_masks.compiled_on("cpu"):
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            compiled = fused_masks.apply(x, site, fused_masks.threshold(0.1), 1 / 0.9)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # it did compile
            assert torch.equal(compiled, eager[1])
            for model in (plain, checkpointed):
                loss, grads = loss_and_grads(model, batch, keys)
                assert all(torch.equal(loss[k], eager[0][0][k]) for k in loss)
                assert all(torch.equal(a, b) for a, b in zip(grads, eager[0][1]))
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1  # one graph: every shape
    finally:
        torch._dynamo.reset()  # the compiled code goes


def test_v3_runs_unfused_with_a_warning_where_compiling_fails(monkeypatch):
    """A GPU machine without what torch.compile needs (Triton's C compiler, say): the first call warns, saying what
    to do, and v3 runs eagerly from then on, with the same masks; compiling is not tried again."""
    calls = []

    def failing():
        def compiled(*args):
            calls.append(args)
            raise torch._dynamo.exc.BackendCompilerFailed(compiled, RuntimeError("no working C compiler"), None)
        return compiled

    monkeypatch.setattr(fused_masks, "_compiled", failing)
    x, keys = torch.randn(3, 500), fused_masks.site_keys(dropout_keys(1, 2, torch.arange(3)), 5)
    eager = fused_masks.apply(x, keys, fused_masks.threshold(0.2), 1.25)
    with fused_masks.compiled_on("cpu"):
        with pytest.warns(UserWarning, match=r"v3 run unfused on cpu .*no working C compiler.*--dropout-masks v2"):
            assert torch.equal(fused_masks.apply(x, keys, fused_masks.threshold(0.2), 1.25), eager)
        assert torch.equal(fused_masks.apply(x, keys, fused_masks.threshold(0.2), 1.25), eager)
    assert len(calls) == 1


# --- the trainer: new runs get v2, runs saved before v2 keep v1, v3 when chosen ------------------------------------
# (tests/test_checkpoint_compat.py resumes a run saved before v2 existed, dropout 0.1, bit-identically;
# tests/test_pre_seam_resume.py resumes v2 runs saved by an older trainer with v2, bit-identically.)

def test_runs_saved_before_v2_are_read_as_v1():
    assert saved_settings({"dropout": 0.1})["dropout_masks"] == "v1"
    assert saved_settings({"dropout": 0.1, "dropout_masks": "v2"})["dropout_masks"] == "v2"
    assert "dropout_masks" in EXACTNESS_KEYS


def test_a_new_run_trains_with_v2_and_a_resume_refuses_to_switch(tmp_path):
    inputs = [*small_corpus_flags(tmp_path / "data"), "--effective-batch", "4", "--dropout", "0.1",
              "--warmup-steps", "1", "--val-interval", "0"]
    run = tmp_path / "run"
    first = train_here(run, *inputs, "--max-steps", "2", "--lr-decay-steps", "3")
    assert first.returncode == 0, first.stderr[-2000:]
    assert schema.read(run / "latest.pth").settings["dropout_masks"] == "v2"
    for other in ("v1", "v3"):
        switched = train_here(run, "--resume", "auto", *inputs, "--max-steps", "3", "--dropout-masks", other)
        assert switched.returncode == 2
        assert "dropout_masks" in switched.stderr
        assert schema.read(run / "latest.pth").step == 2  # nothing trained, nothing changed
    resumed = train_here(run, "--resume", "auto", "--max-steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert schema.read(run / "latest.pth").settings["dropout_masks"] == "v2"  # the run's masks, not the default's


def test_a_v3_run_killed_mid_step_resumes_bit_identically(tmp_path):
    """--dropout-masks v3 trained by the trainer's own process, SIGKILLed mid-accumulation of step 3 and resumed
    with --resume auto alone: the same weights, optimizer state, samples and logged losses as a run never
    interrupted; the checkpoints say v3."""
    flags = [*small_corpus_flags(tmp_path / "data"), "--effective-batch", "4", "--batch-size", "2", "--dropout", "0.1",
             "--dropout-masks", "v3", "--warmup-steps", "1", "--val-interval", "0", "--max-steps", "4",
             "--save-interval", "2", "--log-interval", "1", "--log-sample-ids"]
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert train_here(reference, *flags).returncode == 0
    killed = train(run, *flags, kill_at="micro:3:1")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert schema.read(run / "latest.pth").step == 2
    resumed = train_here(run, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_training(reference, run, 4)
    assert schema.read(run / "latest.pth").settings["dropout_masks"] == "v3"
