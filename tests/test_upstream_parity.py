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


# ------------------------------------------------------------------ 2.5: the trainer's IndexTTS-2.5 family against it

def family25_batch(tmp_path, raw_text: list[list[int]], code_lens: list[int], langs: list[str], seed: int = 0,
                   gpt_section: dict = GPT25):
    """A batch as the 2.5 family's data path makes it from the 2.5 preprocessing's files (text ids with 0 and 1
    among them, dropped there), and the raw batch upstream's reference gets (which drops them itself)."""
    import json

    import numpy as np

    from trainers.data.features import FeatureDataset, collate_batch
    from trainers.data.manifest import load_manifests, parse_manifest_spec
    from trainers.families import FAMILIES

    family = FAMILIES["indextts25"]
    gpt = family.read_config(gpt_section)
    g = torch.Generator().manual_seed(seed)
    tmp_path = tmp_path / "batch"
    (tmp_path / "f").mkdir(parents=True)
    lines, raw = [], {"spk_emb": [], "emo_vec": [], "codes": []}
    for i, (ids, m) in enumerate(zip(raw_text, code_lens)):
        arrays = {"text_ids": np.asarray(ids, np.int32), "spk_emb": torch.randn(CAMPPLUS_DIM, generator=g).numpy(),
                  "emo_vec": torch.randn(gpt.model_dim, generator=g).numpy(),
                  "codes": torch.randint(0, gpt.start_mel_token, (m,), generator=g).numpy().astype(np.int32)}
        np.savez(tmp_path / "f" / f"u{i}.npz", **arrays)
        lines.append({"id": f"u{i}", "features": f"f/u{i}.npz", "lang": langs[i], "text_len": len(ids), "code_len": m})
        for k in raw:
            raw[k].append(torch.from_numpy(arrays[k]))
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    table = load_manifests([parse_manifest_spec(str(tmp_path / "m.jsonl"))], family.data_limits(gpt))
    dataset = FeatureDataset(table, family.feature_spec(gpt))
    ours = collate_batch([dataset[i] for i in range(len(dataset))])
    width = max(map(len, raw_text))
    reference = {"spk_emb": torch.stack(raw["spk_emb"]), "emo_vec": torch.stack(raw["emo_vec"]),
                 "text_ids": torch.tensor([ids + [2] * (width - len(ids)) for ids in raw_text]),
                 "text_lens": torch.tensor(list(map(len, raw_text))), "lang_ids": ours.inputs["lang_id"],
                 "codes": torch.nn.utils.rnn.pad_sequence(raw["codes"], batch_first=True).long(),
                 "code_lens": torch.tensor(code_lens)}
    return family, gpt, ours, reference


def family25_model(family, gpt, state):
    model = family.build_model(gpt).eval()
    model.load_state_dict({k: state[k] for k in model.state_dict()}, strict=True)
    return model


def test_the_25_familys_logits_and_losses_are_upstreams_campplus_pass(tmp_path):
    """Our IndexTTS-2.5 model (its data path included: ids 0 and 1 dropped from the preprocessing's text ids, the
    language's row) on upstream's campplus pass with the language embedding as prepare_gpt_inputs adds it.
    Measured (x86-64, fp32, one thread): max |ours - upstream| 8.3e-7 (text logits), 1.2e-6 (mel logits), of logits
    up to 2 in size; tolerance ATOL 1e-5. The loss sums (next test): text 0 difference on 56.6, mel 4e-6 on 56.0."""
    state = campplus_state(seed=4)
    raw = [[35, 0, 7, 1, 9, 12], [33, 8, 0, 0], [31, 5, 6, 7, 8, 9, 10, 1]]
    family, gpt, ours, reference = family25_batch(tmp_path, raw, [4, 7, 2], ["en", "ja", "yue"], seed=2)
    assert ours.inputs["text_lens"].tolist() == [4, 2, 7] and ours.inputs["lang_id"].tolist() == [0, 7, 99]
    model = family25_model(family, gpt, state)
    ref = campplus_reference(state, GPT25, reference)
    with torch.no_grad():
        text_logits, mel_logits = model(**ours.inputs, layout="upstream")
    assert ref["text_logits"].abs().max() > 0.5 and ref["mel_logits"].abs().max() > 0.5
    assert_close(text_logits, ref["text_logits"], atol=ATOL, what="text logits")
    assert_close(mel_logits, ref["mel_logits"], atol=ATOL, what="mel logits")
    assert torch.equal(model.text_io(ours.text_ids, ours.text_lens)[1], ref["text_targets"])
    assert torch.equal(model.mel_io(ours.codes, ours.code_lens)[1], ref["mel_targets"])


def test_the_25_familys_loss_sums_are_upstreams_cross_entropy(tmp_path):
    state = campplus_state(seed=5)
    raw = [[35, 0, 7, 9, 11], [33, 8, 1, 4, 5], [31, 5, 6, 7]]  # 4 ids each once 0 and 1 are dropped: no text padding
    family, gpt, ours, reference = family25_batch(tmp_path, raw, [6, 2, 5], ["en", "zh", "ar"], seed=3)
    want = campplus_reference(state, GPT25, reference)
    with torch.no_grad():
        got = family25_model(family, gpt, state).loss_sums(**ours.inputs)
    for key in ("text_ce", "mel_ce"):
        assert_close(got[key].float(), want[key], atol=ATOL, rtol=1e-5, what=key)
    for key in ("text_tokens", "mel_tokens", "mel_correct"):
        assert int(got[key]) == int(want[key]), key


def test_the_25_familys_greedy_codes_are_upstreams_inference_speech(tmp_path):
    from trainers.model.generation import generate_codes

    state = campplus_state(seed=6, stop_bias=1.0)
    raw = [[35, 0, 7, 9, 12], [33, 8, 4]]
    family, gpt, ours, reference = family25_batch(tmp_path, raw, [1, 1], ["es", "es"], seed=4)
    model = family25_model(family, gpt, state)
    c = campplus_upstream(state, GPT25)
    got = generate_codes(model, ours.text_ids, ours.text_lens, 10, **ours.conditioning)
    for i in range(2):
        n = int(ours.text_lens[i])
        want = campplus_generate(c, reference["spk_emb"][i:i + 1], reference["emo_vec"][i:i + 1],
                                 ours.text_ids[i:i + 1, :n], lang_id=3, max_codes=10)[0]
        assert got.codes[i].tolist() + ([GPT25["stop_mel_token"]] if got.stopped[i] else []) == want, i


def full_config25(path, gpt: dict) -> None:
    """A full IndexTTS-2.5 config.yaml: the other keys infer_v2_5 reads (no dataset section), version 2.5."""
    import yaml

    from tests.demo_runs import INFERENCE_SECTIONS

    sections = yaml.safe_load(INFERENCE_SECTIONS.read_text(encoding="utf-8"))
    sections.pop("dataset")
    path.write_text(yaml.safe_dump({"gpt": gpt, **sections, "version": 2.5}, sort_keys=False), encoding="utf-8")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_25_runs_export_is_the_campplus_key_set_upstream_loads_strictly_and_generates_from(demo25_assets, tmp_path,
                                                                                             lora):
    """A 2.5 run (full, and LoRA: its adapters merged) started from a base in upstream's campplus layout (every key
    of its constructor, the emotion encoders included), exported: gpt.pth holds exactly that key set
    (load_strict_campplus: strict=True), the carried tensors bit-identical; full: the trained tensors the run's;
    LoRA: the logits of the adapted model (base + adapters, built here) within 2e-5; the tokenizer under the name
    infer_v2_5 opens; and upstream's inference_speech generates from it the greedy codes the trainer's own
    generation gives."""
    import yaml

    from tests.demo_runs import DEMO25_CONFIG, final_state, train_here
    from trainers.families import FAMILIES
    from trainers.model.generation import generate_codes
    from trainers.model.lora import LoraSettings, add_adapters
    from trainers.tools import export_checkpoint

    gpt = {**yaml.safe_load(DEMO25_CONFIG.read_text())["gpt"], "condition_module": ENCODER,
           "emo_condition_module": ENCODER}
    torch.manual_seed(0)
    base_state = campplus_model(gpt).state_dict()
    torch.save({"model": {**base_state, "inference_model.lm_head.weight": torch.zeros(2, 2)}}, tmp_path / "base.pth")
    flags = list(demo25_assets)
    flags[flags.index("--base-checkpoint") + 1] = str(tmp_path / "base.pth")
    run = tmp_path / "run"
    done = train_here(run, *flags, "--max-steps", "3", "--save-interval", "3", "--val-interval", "0",
                      *(["--lora-rank", "4", "--learning-rate", "2e-2"] if lora else []))
    assert done.returncode == 0, done.stderr
    full_config25(tmp_path / "config.yaml", gpt)
    assert export_checkpoint.main([str(run), "--out", str(tmp_path / "out"), "--config", str(tmp_path / "config.yaml")]) == 0
    exported = torch.load(tmp_path / "out" / "gpt.pth", weights_only=True)["model"]
    assert {k: tuple(v.shape) for k, v in exported.items()} == campplus_keys(gpt)
    family = FAMILIES["indextts25"]
    config = family.read_config(gpt)
    model = family.build_model(config).eval()
    model.load_state_dict({k: exported[k] for k in model.state_dict()})
    ckpt = final_state(run)
    if lora:
        assert all(torch.equal(exported[k], base_state[k]) for k in exported if k not in model.state_dict())
        adapted = family.build_model(config)
        adapted.load_state_dict({k: base_state[k] for k in adapted.state_dict()})
        s = ckpt.lora
        add_adapters(adapted, LoraSettings(s["rank"], s["alpha"], tuple(s["targets"]), s["dropout"]), 0)
        adapted.load_state_dict(ckpt.model, strict=False)
        raw = [[35, 0, 7, 9, 12], [33, 8, 4]]
        _, _, batch, _ = family25_batch(tmp_path, raw, [5, 3], ["en", "ja"], seed=8, gpt_section=gpt)
        with torch.no_grad():
            worst = max(float((a - b).abs().max()) for a, b in zip(adapted.eval()(**batch.inputs), model(**batch.inputs)))
        assert not torch.equal(exported["gpt.h.0.attn.c_attn.weight"], base_state["gpt.h.0.attn.c_attn.weight"])
        assert worst < 2e-5, worst
    else:
        for key, value in exported.items():
            assert torch.equal(value, (ckpt.model if key in ckpt.model else base_state)[key]), key
        assert not torch.equal(exported["lang_embedding.weight"], base_state["lang_embedding.weight"])  # it trained
    tokenizer = flags[flags.index("--tokenizer") + 1]
    assert (tmp_path / "out" / "multilingual_zh_ja_yue_char_del.tiktoken").read_bytes() == open(tokenizer, "rb").read()
    written = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert written["version"] == 2.5 and "dataset" not in written and written["gpt"]["number_text_tokens"] == 2400

    c = campplus_upstream(exported, gpt)  # strict=True inside (load_strict_campplus)
    g = torch.Generator().manual_seed(1)
    text = torch.randint(2, 700, (1, 6), generator=g)
    spk_emb, emo_vec = torch.randn(1, CAMPPLUS_DIM, generator=g), torch.randn(1, 64, generator=g)
    ours = generate_codes(model, text, torch.tensor([6]), 12, spk_emb=spk_emb, emo_vec=emo_vec,
                          lang_id=torch.tensor([0]))
    want = campplus_generate(c, spk_emb, emo_vec, text, lang_id=0, max_codes=12)[0]
    assert len(want) >= 1 and ours.codes[0].tolist() + ([129] if ours.stopped[0] else []) == want


def test_a_25_lora_adapter_merged_by_indextts_merge_lora_is_the_export_and_loads_strictly(demo25_assets, tmp_path,
                                                                                          capsys):
    """indextts-merge-lora folds a 2.5 run's adapter file (--adapter-only) into its campplus base: the merged file
    holds the export's key set, spk_emb_proj and lang_embedding included (told from the base's keys, as the export
    is told by the run's family), loads with strict=True into upstream's campplus UnifiedVoice, and its tensors are
    the merged export's within 2e-5."""
    import yaml

    from tests.demo_runs import DEMO25_CONFIG, train_here
    from trainers.tools import export_checkpoint, merge_lora

    gpt = {**yaml.safe_load(DEMO25_CONFIG.read_text())["gpt"], "condition_module": ENCODER,
           "emo_condition_module": ENCODER}
    torch.manual_seed(0)
    base = tmp_path / "base.pth"
    torch.save({"model": {**campplus_model(gpt).state_dict(), "inference_model.lm_head.weight": torch.zeros(2, 2)}},
               base)
    flags = list(demo25_assets)
    flags[flags.index("--base-checkpoint") + 1] = str(base)
    run = tmp_path / "run"
    done = train_here(run, *flags, "--max-steps", "2", "--save-interval", "2", "--val-interval", "0",
                      "--lora-rank", "4", "--learning-rate", "2e-2")
    assert done.returncode == 0, done.stderr
    full_config25(tmp_path / "config.yaml", gpt)
    config = ["--config", str(tmp_path / "config.yaml")]
    assert export_checkpoint.main([str(run), "--out", str(tmp_path / "export"), *config]) == 0
    assert export_checkpoint.main([str(run), "--out", str(tmp_path / "adapter"), "--adapter-only", *config]) == 0
    capsys.readouterr()
    merged_path = tmp_path / "merged.pth"
    assert merge_lora.main(["--adapter", str(tmp_path / "adapter" / "lora_adapter.pth"), "--base", str(base),
                            "--out", str(merged_path)]) == 0
    merged = torch.load(merged_path, weights_only=True)["model"]
    exported = torch.load(tmp_path / "export" / "gpt.pth", weights_only=True)["model"]
    load_strict_campplus(merged, gpt)  # strict=True: a missing or an extra key raises
    assert set(merged) == set(exported)
    assert max(float((merged[k].float() - exported[k].float()).abs().max()) for k in merged) < 2e-5
    said = capsys.readouterr().out
    assert "(IndexTTS-2.5) -> " in said, said
    assert "left out (IndexTTS-2.5's UnifiedVoice does not load them): inference_model.lm_head.weight" in said, said
