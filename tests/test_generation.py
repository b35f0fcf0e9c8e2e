"""Mel-code generation (trainers/model/generation.py) on the real model: greedy codes are the argmax of the
model's own teacher-forced forward, the KV cache changes nothing, a batch gives each sample's codes alone,
sampling is a function of the caller's generator only, and the model is left as it was."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_GPT
from tests.test_gpt_model import make_batch, randomized_model
from trainers.model.code_choice import Sampling, choose, penalise
from trainers.model.generation import MEL_POSITIONS, _prompts, generate_codes
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.model.kv_cache import KVCache, last_logits
from trainers.model.lora import LoraSettings, add_adapters

STOP = TINY_GPT.stop_mel_token
MAX_CODES = 12
TEXT_LENS = [5, 9, 3, 7]


def model(stop_bias: float = 1.5) -> UnifiedVoiceGPT:
    """A random model whose stop logit is raised so that, greedily, samples stop after 1, 2, 6 or 7 codes and one
    runs to the limit (seed 0, either position rule): every case of the loop's end is exercised."""
    m = randomized_model(seed=0)
    with torch.no_grad():
        m.mel_head.bias[STOP] += stop_bias
    return m.eval()


def texts(lens: list[int] = TEXT_LENS) -> dict:
    b = make_batch(lens, [1] * len(lens), seed=3)
    return {k: b[k] for k in ("condition", "emo_vec", "text_ids", "text_lens")}


def rows(batch: dict, i: int) -> dict:
    n = int(batch["text_lens"][i])
    return {k: (v[i:i + 1, :n] if k == "text_ids" else v[i:i + 1]) for k, v in batch.items()}


def tokens(result, i: int) -> list[int]:
    """Sample i's generated tokens, its stop included."""
    return result.codes[i].tolist() + ([STOP] if result.stopped[i] else [])


def test_the_ends_of_generation_are_all_exercised():
    for positions in MEL_POSITIONS:
        got = generate_codes(model(), **texts(), max_codes=MAX_CODES, mel_positions=positions)
        assert any(got.stopped) and not all(got.stopped), (positions, got)
        assert all(len(c) == MAX_CODES for c, s in zip(got.codes, got.stopped) if not s)
        assert all(STOP not in c.tolist() for c in got.codes)


def lora_model() -> UnifiedVoiceGPT:
    """The test model with LoRA adapters whose B is not zero, so they change what the model computes."""
    m = model()
    add_adapters(m, LoraSettings(rank=2, alpha=4.0), seed=5)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".lora_b"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return m


@pytest.mark.parametrize("build", [model, lora_model], ids=["plain", "lora_adapters"])
def test_greedy_codes_are_the_argmax_of_the_models_own_teacher_forced_forward(build):
    """Training positions: a causal model's logit at mel input j depends on inputs 0..j only, so feeding the
    generated codes to the model's forward must give back each next code as the argmax, stop included.
    With adapters too: generation calls the blocks' own projections, so adapters apply as in the forward."""
    m, batch = build(), texts()
    got = generate_codes(m, **batch, max_codes=MAX_CODES, mel_positions="training")
    lens = torch.tensor([len(c) for c in got.codes])
    codes = torch.zeros(len(lens), int(lens.max()), dtype=torch.long)
    for i, c in enumerate(got.codes):
        codes[i, :len(c)] = c
    with torch.no_grad():
        _, mel_logits = m(**batch, codes=codes, code_lens=lens)
    for i in range(len(lens)):
        want = tokens(got, i)
        assert mel_logits[i, :len(want)].argmax(-1).tolist() == want, i


def test_upstream_positions_are_the_training_positions_with_the_generated_codes_one_row_further():
    """Upstream's cached decoding embeds the k-th generated code at mel position k + 1. The same model with its
    position table moved up by one row after row 0 must therefore give, at training positions, the codes that
    the original gives at upstream's positions."""
    m = model()
    shifted = model()
    with torch.no_grad():
        table = shifted.mel_pos_embedding.emb.weight
        table[1:-1] = m.mel_pos_embedding.emb.weight[2:]
    upstream = generate_codes(m, **texts(), max_codes=MAX_CODES, mel_positions="upstream")
    training = generate_codes(shifted, **texts(), max_codes=MAX_CODES, mel_positions="training")
    assert [tokens(upstream, i) for i in range(4)] == [tokens(training, i) for i in range(4)]
    plain = generate_codes(m, **texts(), max_codes=MAX_CODES, mel_positions="training")
    assert [tokens(plain, i) for i in range(4)] != [tokens(upstream, i) for i in range(4)]  # the rule matters


@pytest.mark.parametrize("positions", MEL_POSITIONS)
def test_the_kv_cache_gives_the_codes_of_recomputing_the_whole_sequence(positions: str):
    m, batch = model(), texts()
    cached = generate_codes(m, **batch, max_codes=MAX_CODES, mel_positions=positions)
    full = generate_codes(m, **batch, max_codes=MAX_CODES, mel_positions=positions, kv_cache=False)
    assert [tokens(cached, i) for i in range(4)] == [tokens(full, i) for i in range(4)]
    sampling = Sampling(temperature=1.5)
    a = generate_codes(m, **batch, max_codes=MAX_CODES, mel_positions=positions, sampling=sampling,
                       generator=torch.Generator().manual_seed(7))
    b = generate_codes(m, **batch, max_codes=MAX_CODES, mel_positions=positions, sampling=sampling,
                       generator=torch.Generator().manual_seed(7), kv_cache=False)
    assert [tokens(a, i) for i in range(4)] == [tokens(b, i) for i in range(4)]


@pytest.mark.parametrize("stop_bias", [1.5, -100.0], ids=["stops", "runs_to_the_limit"])
@pytest.mark.parametrize("positions", MEL_POSITIONS)
def test_a_batch_of_different_text_lengths_gives_each_sample_its_codes_alone(positions: str, stop_bias: float):
    m, batch = model(stop_bias), texts()
    together = generate_codes(m, **batch, max_codes=MAX_CODES, mel_positions=positions)
    for i in range(len(TEXT_LENS)):
        alone = generate_codes(m, **rows(batch, i), max_codes=MAX_CODES, mel_positions=positions)
        assert tokens(alone, 0) == tokens(together, i), i


def test_left_padding_changes_no_logit_of_the_prompt():
    """Codes can hide a small leak through the padding (an argmax rarely flips); the logits cannot. Measured:
    4.8e-7 at logits up to 2.3 (float rounding); a mask letting queries see the padding gives 0.16."""
    m, batch = model(), texts()

    def prompt_logits(b: dict) -> torch.Tensor:
        x, pad = _prompts(m, **b)
        with torch.no_grad():
            return last_logits(m, x, KVCache.empty(m, pad, x.shape[1], x.dtype))

    together = prompt_logits(batch)
    for i in range(len(TEXT_LENS)):
        alone = prompt_logits(rows(batch, i))[0]
        assert torch.allclose(together[i], alone, atol=1e-5, rtol=0), (i, (together[i] - alone).abs().max())


def test_sampling_is_a_function_of_the_generator_and_leaves_the_global_rng_alone():
    m, batch = model(stop_bias=-5.0), texts()
    torch.manual_seed(123)
    before = torch.get_rng_state()

    def sample(seed: int):
        return generate_codes(m, **batch, max_codes=MAX_CODES, sampling=Sampling(temperature=2.0, top_k=8, top_p=0.95),
                              generator=torch.Generator().manual_seed(seed))

    first, again, other = sample(1), sample(1), sample(2)
    assert torch.equal(torch.get_rng_state(), before)
    assert [c.tolist() for c in first.codes] == [c.tolist() for c in again.codes]
    assert [c.tolist() for c in first.codes] != [c.tolist() for c in other.codes]
    greedy = generate_codes(m, **batch, max_codes=MAX_CODES)
    assert [c.tolist() for c in first.codes] != [c.tolist() for c in greedy.codes]  # it did sample
    top1 = generate_codes(m, **batch, max_codes=MAX_CODES, sampling=Sampling(top_k=1),
                          generator=torch.Generator().manual_seed(1))
    assert [c.tolist() for c in top1.codes] == [c.tolist() for c in greedy.codes]


def test_a_generator_per_text_gives_each_sample_its_sampled_codes_alone():
    """With one generator per text a sample's draws do not depend on its batch-mates (as at validation, where
    the batch size and the number of processes vary); with one shared generator they do."""
    m, batch = model(stop_bias=-2.0), texts()
    sampling = Sampling(temperature=2.0, top_k=8)

    def own(seeds: list[int]) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(s) for s in seeds]

    together = generate_codes(m, **batch, max_codes=MAX_CODES, sampling=sampling, generator=own([10, 11, 12, 13]))
    for i in range(len(TEXT_LENS)):
        alone = generate_codes(m, **rows(batch, i), max_codes=MAX_CODES, sampling=sampling, generator=own([10 + i]))
        assert tokens(alone, 0) == tokens(together, i), i
    shared = generate_codes(m, **batch, max_codes=MAX_CODES, sampling=sampling,
                            generator=torch.Generator().manual_seed(10))
    first = generate_codes(m, **rows(batch, 0), max_codes=MAX_CODES, sampling=sampling,
                           generator=torch.Generator().manual_seed(10))
    assert tokens(first, 0)[0] == tokens(shared, 0)[0]  # row 0 draws first from the shared generator, then
    assert tokens(first, 0) != tokens(shared, 0)  # its later draws come after its batch-mates'
    with pytest.raises(ValueError, match="one per text"):
        generate_codes(m, **batch, max_codes=4, sampling=sampling, generator=own([1, 2]))


def test_sampling_without_a_generator_is_refused():
    with pytest.raises(ValueError, match="needs a torch.Generator"):
        generate_codes(model(), **texts(), max_codes=4, sampling=Sampling())


def test_the_model_keeps_its_training_mode_parameters_and_gradients():
    m = model().train()
    m.mel_head.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    flags = {n: p.requires_grad for n, p in m.named_parameters()}
    modes: set[tuple[bool, bool]] = set()  # (module in training mode, gradients enabled) while generating
    hook = m.gpt.h[-1].mlp.register_forward_hook(lambda mod, *_: modes.add((mod.training, torch.is_grad_enabled())))
    generate_codes(m, **texts(), max_codes=MAX_CODES)
    hook.remove()
    assert modes == {(False, False)}
    generate_codes(m, **texts(), max_codes=MAX_CODES, sampling=Sampling(), generator=torch.Generator().manual_seed(0))
    assert m.training and all(sub.training for sub in m.modules())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert {n: p.requires_grad for n, p in m.named_parameters()} == flags
    assert all(p.grad is None for p in m.parameters())


def test_a_certain_stop_gives_no_codes_and_an_impossible_one_gives_max_codes():
    at_once = generate_codes(model(stop_bias=100.0), **texts(), max_codes=MAX_CODES)
    assert at_once.stopped == [True] * 4 and all(len(c) == 0 for c in at_once.codes)
    never = generate_codes(model(stop_bias=-100.0), **texts(), max_codes=MAX_CODES)
    assert never.stopped == [False] * 4 and all(len(c) == MAX_CODES for c in never.codes)


def test_max_codes_beyond_the_position_table_is_refused():
    limit = TINY_GPT.max_mel_tokens + 2
    generate_codes(model(stop_bias=-100.0), **rows(texts(), 0), max_codes=limit)
    with pytest.raises(ValueError, match=f"max_codes must be 1..{limit}"):
        generate_codes(model(), **texts(), max_codes=limit + 1)


def test_repetition_penalty_follows_hf_and_counts_upstreams_placeholder_ids():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    assert penalise(logits, seen, 2.0).tolist() == [[1.0, -2.0, 3.0, 0.5]]
    # seen codes 0 and 2 lead without the penalty; with it (4.0 / 10, 3.9 / 10) unseen code 3's 0.5 wins
    logits = torch.tensor([[4.0, 0.1, 3.9, 0.5]])
    assert choose(logits, torch.tensor([[True, False, True, False]]), 10.0, None, None).tolist() == [3]
    m = model(stop_bias=-100.0)
    with torch.no_grad():
        m.mel_head.bias[1] += 50.0  # code 1 would win every step, were it not penalised from the start
    plain = generate_codes(m, **texts(), max_codes=4)
    penalised = generate_codes(m, **texts(), max_codes=4, repetition_penalty=1e6)
    assert all(set(c.tolist()) == {1} for c in plain.codes)
    assert all(1 not in c.tolist() for c in penalised.codes)


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    drawn = {int(choose(logits, None, 1.0, Sampling(top_p=0.75), g)) for _ in range(200)}
    assert drawn == {0, 1}
