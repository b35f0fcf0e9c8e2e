"""Parity with upstream IndexTTS's own UnifiedVoice (tests/upstream_models.py fetches its code from pinned wheels).

2.0: upstream's forward() (conformer mode, on the precomputed conditioning latents ours takes) gives ours's
logits on a padded batch, and the trainer's loss sums equal the cross-entropy of upstream's logits against
the targets upstream builds. 2.5: the campplus helpers of tests/upstream_gpt.py (for the 2.5 family's parity
test) are checked here against indextts25-inference's own campplus code, and against upstream v2.5.0's key set.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_gpt_model import assert_close, make_batch, randomized_model
from tests.upstream_gpt import (CAMPPLUS_DIM, CAMPPLUS_PREFIX, ENCODER, campplus_generate, campplus_keys,
                                campplus_model, campplus_reference, campplus_upstream, conformer_model, forward_logits,
                                load_strict_campplus, loss_sums, v25)

# Measured on this machine (x86-64, fp32, one thread): max |ours - upstream| 9.5e-7 (text logits) and 1.9e-6
# (mel logits) of logits about 1-10 in size; the loss sums agree to 1e-5 relative. Far below a real mismatch
# (a wrong position or prefix moves logits by ~0.1 and more), above what another summation order gives.
ATOL = 1e-5


def upstream_out(ours, batch):
    uv = conformer_model(ours)
    return forward_logits(uv, batch["condition"], batch["emo_vec"], batch["text_ids"], batch["text_lens"],
                          batch["codes"], batch["code_lens"])


def test_upstream_forward_gives_our_logits_and_targets_on_a_padded_batch():
    ours = randomized_model().eval()
    batch = make_batch(text_lens=[5, 3, 1], code_lens=[4, 7, 2], seed=3)
    up = upstream_out(ours, batch)
    with torch.no_grad():
        text_logits, mel_logits = ours(**batch, layout="upstream")
    assert up["text_logits"].abs().max() > 0.5 and up["mel_logits"].abs().max() > 0.5  # not a degenerate comparison
    assert_close(text_logits, up["text_logits"], atol=ATOL, what="text logits")
    assert_close(mel_logits, up["mel_logits"], atol=ATOL, what="mel logits")
    # The targets our loss uses are the ones upstream builds, masked as the reference says.
    assert torch.equal(ours.text_io(batch["text_ids"], batch["text_lens"])[1], up["text_targets"])
    assert torch.equal(ours.mel_io(batch["codes"], batch["code_lens"])[1], up["mel_targets"])


def test_the_trainers_loss_sums_are_upstreams_cross_entropy():
    """loss_sums is the trainer's own loss (packed layout): without text padding it sees what upstream does."""
    ours = randomized_model().eval()
    batch = make_batch(text_lens=[4, 4, 4], code_lens=[6, 2, 5], seed=8)
    want = loss_sums(upstream_out(ours, batch))
    with torch.no_grad():
        got = ours.loss_sums(**batch)
    for key in ("text_ce", "mel_ce"):
        assert_close(got[key].float(), want[key], atol=ATOL, rtol=1e-5, what=key)
    for key in ("text_tokens", "mel_tokens", "mel_correct"):
        assert int(got[key]) == int(want[key]), key


# ------------------------------------------------------------------------------------------------ 2.5 (campplus)

GPT25 = {"layers": 2, "model_dim": 16, "heads": 2, "max_text_tokens": 12, "max_mel_tokens": 16,
         "number_text_tokens": 40, "number_mel_codes": 30, "start_text_token": 0, "stop_text_token": 1,
         "start_mel_token": 28, "stop_mel_token": 29, "condition_type": "conformer_perceiver",
         "condition_module": ENCODER, "emo_condition_module": ENCODER}


def campplus_state(seed: int = 0, stop_bias: float = 0.0) -> dict[str, torch.Tensor]:
    """A campplus state dict of GPT25's sizes whose every tensor is random and non-trivial."""
    torch.manual_seed(seed)
    uv = campplus_model(GPT25)
    g = torch.Generator().manual_seed(seed + 1)
    state = {}
    for name, t in uv.state_dict().items():
        noise = torch.randn(t.shape, generator=g)
        state[name] = 1.0 + 0.2 * noise if name.endswith("weight") and t.dim() == 1 else 0.15 * noise
    state["mel_head.bias"][GPT25["stop_mel_token"]] += stop_bias
    return state


def campplus_batch(text_lens: list[int], code_lens: list[int], langs: list[int], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    b, d = len(text_lens), GPT25["model_dim"]
    return {"spk_emb": torch.randn(b, CAMPPLUS_DIM, generator=g), "emo_vec": torch.randn(b, d, generator=g),
            "text_ids": torch.randint(2, GPT25["number_text_tokens"], (b, max(text_lens)), generator=g),
            "text_lens": torch.tensor(text_lens), "lang_ids": torch.tensor(langs),
            "codes": torch.randint(0, GPT25["start_mel_token"], (b, max(code_lens)), generator=g),
            "code_lens": torch.tensor(code_lens)}


def indextts25_logits(strict: torch.nn.Module, batch: dict, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i through indextts25-inference's own campplus code: its prepare_gpt_inputs (language embedding on
    the text) after the campplus prefix, then the start token and codes, its GPT-2, final_norm and the heads."""
    n, m = int(batch["text_lens"][i]), int(batch["code_lens"][i])
    d = GPT25["model_dim"]
    with torch.no_grad():
        speaker = strict.spk_emb_proj(batch["spk_emb"][i:i + 1]).unsqueeze(1) + batch["emo_vec"][i:i + 1, None]
        conds = torch.cat([speaker, torch.zeros(1, 2, d)], dim=1)
        _, emb, _ = strict.prepare_gpt_inputs(conds, batch["text_ids"][i:i + 1, :n], batch["lang_ids"][i:i + 1])
        mel_in = torch.cat([torch.tensor([GPT25["start_mel_token"]]), batch["codes"][i, :m],
                            torch.tensor([GPT25["stop_mel_token"]])]).unsqueeze(0)
        mel = strict.mel_embedding(mel_in) + strict.mel_pos_embedding(mel_in)
        h = strict.gpt(inputs_embeds=torch.cat([emb, mel], dim=1)).last_hidden_state
        h = strict.final_norm(h[:, CAMPPLUS_PREFIX:])
        return strict.text_head(h[:, :n + 2]), strict.mel_head(h[:, n + 2:])


def test_the_strict_load_target_has_upstream_v25s_campplus_key_set():
    got = {k: tuple(v.shape) for k, v in campplus_model(GPT25).state_dict().items()}
    want = campplus_keys(GPT25)
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    assert got == want
    assert want["lang_embedding.weight"] == (107, 16)  # 106 LANGUAGE_DICT entries + 1, as upstream


def test_the_strict_load_refuses_a_missing_or_an_extra_key():
    state = campplus_state()
    load_strict_campplus(state, GPT25)
    lacking = {k: v for k, v in state.items() if k != "lang_embedding.weight"}
    with pytest.raises(RuntimeError, match="lang_embedding.weight"):
        load_strict_campplus(lacking, GPT25)
    with pytest.raises(RuntimeError, match="speed_emb.weight"):
        load_strict_campplus({**state, "speed_emb.weight": torch.zeros(2, 16)}, GPT25)


def test_the_campplus_reference_is_indextts25s_campplus_forward_sample_by_sample():
    """Upstream v2.0.0's code with the campplus pieces supplied (tests/upstream_gpt.py) equals a published
    campplus implementation on the same weights: prefix, language rows, GPT-2 and heads."""
    state = campplus_state()
    c = campplus_upstream(state, GPT25)
    batch = campplus_batch([5, 3, 6], [4, 7, 2], langs=[0, 7, 105], seed=3)
    ref = campplus_reference(state, GPT25, batch, c)
    assert ref["text_logits"].shape == (3, 6 + 2, 41) and ref["mel_logits"].shape == (3, 7 + 2, 30)
    for i in range(3):
        n, m = int(batch["text_lens"][i]), int(batch["code_lens"][i])
        alone = {k: v[i:i + 1] for k, v in batch.items()}
        one = campplus_reference(state, GPT25, alone, c)
        text, mel = indextts25_logits(c.strict, batch, i)
        assert_close(one["text_logits"][:, :n + 2], text, atol=ATOL, what=f"text logits {i}")
        assert_close(one["mel_logits"][:, :m + 2], mel, atol=ATOL, what=f"mel logits {i}")
        # In the batch, padding sits after the sample's own positions: text logits of real positions agree.
        assert_close(ref["text_logits"][i:i + 1, :n + 2], text, atol=ATOL, what=f"batched text {i}")
    other = campplus_reference(state, GPT25, dict(batch, lang_ids=torch.tensor([1, 7, 105])), c)
    assert not torch.allclose(other["mel_logits"][0], ref["mel_logits"][0], atol=1e-3)  # the language counts
    assert torch.allclose(other["mel_logits"][1:], ref["mel_logits"][1:])


def test_the_campplus_reference_drops_text_ids_0_and_1_as_inference_does():
    state = campplus_state()
    batch = campplus_batch([4], [3], langs=[0], seed=5)
    clean = campplus_reference(state, GPT25, batch)
    dirty = dict(batch, text_ids=torch.cat([batch["text_ids"][:, :2], torch.tensor([[0, 1]]),
                                            batch["text_ids"][:, 2:]], dim=1), text_lens=torch.tensor([6]))
    got = campplus_reference(state, GPT25, dirty)
    assert int(got["text_lens"][0]) == 4
    assert torch.equal(got["mel_logits"], clean["mel_logits"])


def test_campplus_generation_runs_and_starts_with_the_references_argmax():
    """Smoke of upstream's inference_speech in campplus mode: greedy codes of a model that stops within the
    limit or runs to it, each first code the argmax of the teacher-forced pass at the start position."""
    state = campplus_state(stop_bias=1.0)
    c = campplus_upstream(state, GPT25)
    batch = campplus_batch([5, 2, 6, 4], [1, 1, 1, 1], langs=[3, 3, 3, 3], seed=7)
    found = []
    for i in range(4):
        n = int(batch["text_lens"][i])
        codes = campplus_generate(c, batch["spk_emb"][i:i + 1], batch["emo_vec"][i:i + 1],
                                  batch["text_ids"][i:i + 1, :n], lang_id=3, max_codes=10)[0]
        again = campplus_generate(c, batch["spk_emb"][i:i + 1], batch["emo_vec"][i:i + 1],
                                  batch["text_ids"][i:i + 1, :n], lang_id=3, max_codes=10)[0]
        assert codes == again and 1 <= len(codes) <= 10
        assert all(x < GPT25["start_mel_token"] for x in codes[:-1])
        ref = campplus_reference(state, GPT25, {k: v[i:i + 1] for k, v in batch.items()}, c)
        assert codes[0] == int(ref["mel_logits"][0, 0].argmax())
        found.append(codes)
    stopped = [GPT25["stop_mel_token"] in codes for codes in found]
    assert any(stopped) or all(len(codes) == 10 for codes in found), found
    assert v25().UnifiedVoice is type(c.strict)


# ------------------------------------------------------------------------------------------------ fetching the code

def fake_wheel(folder, name: str = "parity_fake", version: str = "1.0") -> str:
    """A minimal wheel file for pip to find in `folder` (pip download checks names, not contents)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return str(path)


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    from tests.upstream_models import Unavailable, Wheel, download

    fake_wheel(tmp_path / "index")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    wheel = Wheel("parity-fake", "1.0", "0" * 64, "parity_fake", (), ())
    with pytest.raises(Unavailable, match="not the pinned 0000"):
        download(wheel, tmp_path / "got")
    with pytest.raises(Unavailable, match="pip could not fetch parity-fake==2.0"):
        download(Wheel("parity-fake", "2.0", "0" * 64, "parity_fake", (), ()), tmp_path / "none")
