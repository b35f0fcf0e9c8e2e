"""The IndexTTS-2.5 family (trainers/families/indextts25): its model, tokenizer and data, and the refusals of
inputs that belong to the other model. Its parity with upstream is tests/test_upstream_parity.py; its runs
(resume, LoRA, torchrun, ...) are the tests that take the `family_assets` fixture (tests/conftest.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.demo_runs import DEMO25_CONFIG, train_here
from trainers.data.features import FeatureDataset, FeatureError
from trainers.data.manifest import ManifestError, load_manifests, parse_manifest_spec
from trainers.errors import UserError
from trainers.families import FAMILIES
from trainers.families.indextts25.languages import LANGUAGE_ROWS, SPECIAL_TOKENS, lang_id
from trainers.families.indextts25.model import IndexTTS25Config, IndexTTS25GPT
from trainers.families.indextts25.tokenizer import encoding

FAMILY = FAMILIES["indextts25"]
GPT = IndexTTS25Config(model_dim=16, layers=2, heads=2, max_text_tokens=12, max_mel_tokens=16,
                       number_text_tokens=40, number_mel_codes=30, start_mel_token=28, stop_mel_token=29, dropout=0.0)


def inputs(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"spk_emb": torch.randn(n, 192, generator=g), "emo_vec": torch.randn(n, GPT.model_dim, generator=g),
            "lang_id": torch.tensor([0, 13][:n])}


def flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    out = list(flags)
    out[out.index(name) + 1] = value
    return out


# ------------------------------------------------------------------------------------------------- the model

def test_the_prefix_is_three_positions_and_the_language_reaches_every_text_position():
    torch.manual_seed(0)
    model = IndexTTS25GPT(GPT).eval()
    x = inputs(2)
    text, lens = torch.randint(2, 40, (2, 5)), torch.tensor([5, 5])
    codes, code_lens = torch.randint(0, 28, (2, 4)), torch.tensor([4, 4])
    with torch.no_grad():
        text_logits, mel_logits = model(**x, text_ids=text, text_lens=lens, codes=codes, code_lens=code_lens)
        other = model(**{**x, "lang_id": x["lang_id"] + 1}, text_ids=text, text_lens=lens, codes=codes,
                      code_lens=code_lens)
        prefix = model.conditioning_prefix(**x)
    assert text_logits.shape == (2, 7, 41) and mel_logits.shape == (2, 6, 30)
    assert all((text_logits[:, j] != other[0][:, j]).any() for j in range(7))  # start and stop included
    assert prefix.shape == (2, 3, 16) and not prefix[:, 1:].any()  # [speaker + emotion][0][0]
    torch.testing.assert_close(prefix[:, 0], model.spk_emb_proj(x["spk_emb"]) + x["emo_vec"])


def test_the_state_dict_is_the_campplus_layout():
    with torch.device("meta"):
        state = IndexTTS25GPT(GPT).state_dict()
    assert tuple(state["spk_emb_proj.weight"].shape) == (16, 192)
    assert tuple(state["lang_embedding.weight"].shape) == (LANGUAGE_ROWS, 16) == (107, 16)
    assert tuple(state["text_embedding.weight"].shape) == (41, 16)
    assert not [k for k in state if k.startswith(("speed_emb", "conditioning_encoder", "perceiver_encoder"))]
    assert FAMILY.holds_state(state) and not FAMILIES["indextts2"].holds_state(state)


def test_a_config_is_25_by_its_version_and_its_text_ids_0_and_1_are_start_and_stop():
    section = yaml.safe_load(DEMO25_CONFIG.read_text())["gpt"]
    assert FAMILY.claims({"version": 2.5}) and not FAMILY.claims({"version": 2.0}) and not FAMILY.claims({})
    with pytest.raises(ValueError, match="gpt.start_text_token must be 0 in an IndexTTS-2.5 config"):
        FAMILY.read_config({**section, "start_text_token": 2, "stop_text_token": 3})
    with pytest.raises(ValueError, match="official config has number_text_tokens: 60509"):
        FAMILY.read_config({k: v for k, v in section.items() if k != "number_text_tokens"})


# --------------------------------------------------------------------------------------------- the tokenizer

def test_the_tiktoken_file_has_its_ranks_then_the_special_tokens_in_upstreams_order(demo25_assets, tmp_path):
    path = flag(demo25_assets, "--tokenizer")
    enc = encoding(path)
    ranks = FAMILY.tokenizer.size(path) - len(SPECIAL_TOKENS)
    assert enc.n_vocab == FAMILY.tokenizer.size(path) == 2400
    assert len(SPECIAL_TOKENS) == 1673 and LANGUAGE_ROWS == 106 + 1  # as upstream's; docs/indextts25.md says so
    assert enc.encode("<|en|>", allowed_special="all") == [ranks + 2]  # after endoftext, startoftranscript
    assert enc.encode("<|am|>", allowed_special="all") == [ranks + 2 + lang_id("am")]  # 58913 in the release
    assert enc.encode("<|su|>", allowed_special="all") == [ranks + 2 + 98]  # the 99th and last language token
    assert enc.encode("<|0.00|>", allowed_special="all") == [enc.n_vocab - 1501]
    assert enc.encode('!"') == [0, 1]  # ranks 0 and 1, which inference drops from the text
    assert FAMILY.tokenizer.recognises(path) and not FAMILIES["indextts2"].tokenizer.recognises(path)
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(UserError, match=r"ranks are not 0\.\.1"):
        FAMILY.tokenizer.size(str(bad))


# ------------------------------------------------------------------------------------------------- the data

def community_corpus(root: Path, lines: list[dict], npz: dict[str, dict[str, np.ndarray]]) -> Path:
    """A pair manifest and .npz files as the 2.5 preprocessing writes them."""
    (root / "features").mkdir(parents=True)
    for name, arrays in npz.items():
        np.savez(root / "features" / f"{name}.npz", **arrays)
    manifest = root / "pairs.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


def utterance(text_ids: list[int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"codes": rng.integers(0, 28, 6).astype(np.int32), "text_ids": np.asarray(text_ids, dtype=np.int32),
            "spk_emb": rng.standard_normal(192).astype(np.float32),
            "emo_vec": rng.standard_normal(GPT.model_dim).astype(np.float32)}


def pair(target: str, prompt: str, text_len: int, lang: str = "en", alias: str | None = None) -> dict:
    return {"id": f"{target}__{prompt}", "target_features": f"features/{target}.npz",
            "prompt_features": f"features/{prompt}.npz", "speaker": "s", "lang": lang, "lang_alias": alias,
            "prompt_lang": lang, "cross_lingual": False, "text_len": text_len, "code_len": 6}


def test_the_preprocessings_pairs_are_read_with_ids_0_and_1_dropped_and_counted_without_them(tmp_path, caplog):
    manifest = community_corpus(tmp_path, [pair("a", "b", 6), pair("b", "a", 3, alias="tt")],
                                {"a": utterance([35, 0, 7, 1, 9, 0], 1), "b": utterance([35, 8, 9], 2)})
    with caplog.at_level("INFO"):
        table = load_manifests([parse_manifest_spec(str(manifest))], FAMILY.data_limits(GPT))
    assert list(table.text_len) == [3, 3]  # what the model sees: the token counts of a step
    assert [table[i].lang for i in range(2)] == ["en", "tt"]  # lang_alias: the code the sample borrows
    assert "1 samples' text ids hold ids 0 or 1 (3 in all" in caplog.text
    first, second = FeatureDataset(table, FAMILY.feature_spec(GPT))[0], FeatureDataset(table, FAMILY.feature_spec(GPT))[1]
    assert first["text_ids"].tolist() == [35, 7, 9] and int(first["lang_id"]) == 0 and int(second["lang_id"]) == 92
    with np.load(tmp_path / "features" / "b.npz") as prompt:  # the speaker vector is the prompt's
        assert np.array_equal(first["spk_emb"].numpy(), prompt["spk_emb"])
        assert np.array_equal(first["emo_vec"].numpy(), prompt["emo_vec"])


@pytest.mark.parametrize("line, problem", [
    (pair("a", "a", 5), "holds 6 ids but the line says text_len 5"),
    (pair("a", "a", 6, lang="xx"), "language 'xx' is not one of IndexTTS-2.5's 106 language codes"),
    ({**pair("a", "a", 6), "lang": None}, "no language: an IndexTTS-2.5 sample needs one"),
])
def test_a_line_is_refused_naming_what_is_wrong(tmp_path, line, problem):
    manifest = community_corpus(tmp_path, [line], {"a": utterance([35, 0, 7, 1, 9, 0], 1)})
    with pytest.raises(ManifestError, match=problem):
        load_manifests([parse_manifest_spec(str(manifest))], FAMILY.data_limits(GPT))


def test_a_language_without_a_token_is_trained_as_upstream_uses_it(tmp_path):
    manifest = community_corpus(tmp_path, [pair("a", "a", 3, lang="yue")], {"a": utterance([35, 8, 9], 1)})
    table = load_manifests([parse_manifest_spec(str(manifest))], FAMILY.data_limits(GPT))
    assert int(FeatureDataset(table, FAMILY.feature_spec(GPT))[0]["lang_id"]) == 99


def test_conditioning_latents_of_indextts2_are_refused_as_a_speaker_vector(tmp_path):
    arrays = {**utterance([35, 8, 9], 1), "spk_emb": np.zeros((32, GPT.model_dim), np.float32)}
    manifest = community_corpus(tmp_path, [pair("a", "a", 3)], {"a": arrays})
    table = load_manifests([parse_manifest_spec(str(manifest))], FAMILY.data_limits(GPT))
    with pytest.raises(FeatureError, match=r"holds \[32, 16\] conditioning latents, the speaker input of IndexTTS2"):
        FeatureDataset(table, FAMILY.feature_spec(GPT))[0]


def test_an_archive_without_codes_or_spk_emb_is_refused_at_start_naming_its_line(demo25_assets, tmp_path):
    """The manifests' check opens every target .npz for its text ids: an archive a line names for its codes or its
    speaker vector (the prompt's) without that array is refused there, by line, before anything is written (it was
    found when its sample was first read, after steps had trained and been saved)."""
    train = Path(flag(demo25_assets, "--train-manifest"))
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    for row in rows:
        row.update({k: str(train.parent / row[k]) for k in ("target_features", "prompt_features")})
    for row, (lacking, key) in zip(rows[-2:], [("codes", "target_features"), ("spk_emb", "prompt_features")]):
        with np.load(row[key]) as archive:
            arrays = {k: archive[k] for k in archive.files if k != lacking}
        row[key] = str(tmp_path / f"no_{lacking}.npz")
        np.savez(row[key], **arrays)
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    refused = train_here(run, *with_flag(demo25_assets, "--train-manifest", str(manifest)), "--max-steps", "1")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    n = len(rows)
    for line, key, lacking in ((n - 1, "target_features", "codes"), (n, "prompt_features", "spk_emb")):
        assert (f"{manifest}:{line}: {key} {tmp_path / f'no_{lacking}.npz'}: the archive has no {lacking!r} array "
                "(it has ") in refused.stderr, refused.stderr
    assert "re-run the 2.5 preprocessing" in refused.stderr and not run.exists()


def test_text_ids_of_another_language_than_the_samples_are_refused_by_line(demo25_assets, tmp_path):
    """English data given as `::ja` (its text ids begin with <|en|>, its lines say en) would train ja's rows on
    English text that inference never sees for ja (it begins ja text with <|ja|>): refused, by line."""
    train = flag(demo25_assets, "--train-manifest")
    run = tmp_path / "run"
    refused = train_here(run, *with_flag(demo25_assets, "--train-manifest", f"{train}::ja"), "--max-steps", "1")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert (f"{train}:1: target_features {Path(train).parent / 'features' / 'demo_train_00000.npz'}: its text ids "
            "begin with the language token of en, but ::ja trains the sample as ja (its line says en); drop ::ja if "
            "the data is en, or make its text ids again as ja (indextts-retokenize)") in refused.stderr, refused.stderr
    assert "... and 354 more problems" in refused.stderr and not run.exists()
    # The same text ids under lines that say ja themselves.
    rows = [json.loads(line) for line in Path(train).read_text().splitlines()[:3]]
    relabeled = tmp_path / "ja.jsonl"
    relabeled.write_text("".join(json.dumps({**row, "lang": "ja", **{k: str(Path(train).parent / row[k]) for k in (
        "target_features", "prompt_features")}}) + "\n" for row in rows))
    refused = train_here(run, *with_flag(demo25_assets, "--train-manifest", str(relabeled)), "--max-steps", "1")
    assert refused.returncode == 2 and (f"{relabeled}:3: target_features {Path(train).parent / 'features'}/"
                                        "demo_train_00002.npz: its text ids begin with the language token of en, but "
                                        "its line says the language is ja") in refused.stderr, refused.stderr


# ----------------------------------------------------------------------------- inputs of the other model: exit 2

def npy_lines_of_the_other_model(demo_assets: list[str], demo25_assets: list[str], root: Path) -> dict[str, str]:
    """A 2.0 manifest whose condition files are 2.5 speaker vectors, and a 2.5 .npy manifest whose speaker files
    are 2.0 conditioning latents: lines of each family's form, features of the other's."""
    two = Path(flag(demo_assets, "--train-manifest"))
    out = {}
    root.mkdir()
    rows = [json.loads(line) for line in two.read_text().splitlines()[:8]]
    spk = root / "spk_emb.npy"
    np.save(spk, np.ones(192, np.float32))
    lines20 = [{**r, "prompt_condition_path": str(spk), "target_text_ids_path": str(two.parent / r["target_text_ids_path"]),
                "target_codes_path": str(two.parent / r["target_codes_path"]),
                "prompt_emo_vec_path": str(two.parent / r["prompt_emo_vec_path"])} for r in rows]
    out["indextts2"] = str(root / "v20.jsonl")
    Path(out["indextts2"]).write_text("".join(json.dumps(r) + "\n" for r in lines20))
    lines25 = [{"id": r["id"], "target_text_ids_path": l["target_text_ids_path"], "target_text_len": r["target_text_len"],
                "target_codes_path": l["target_codes_path"], "target_code_len": r["target_code_len"],
                "prompt_spk_emb_path": str(two.parent / r["prompt_condition_path"]),
                "prompt_emo_vec_path": l["prompt_emo_vec_path"], "language": "en"} for r, l in zip(rows, lines20)]
    out["indextts25"] = str(root / "v25.jsonl")
    Path(out["indextts25"]).write_text("".join(json.dumps(r) + "\n" for r in lines25))
    return out


REFUSALS = {
    # what the 2.5 run is given of 2.0's, and the reverse
    "2.0 base, 2.5 config": ("indextts25", {"--base-checkpoint": "indextts2"}, "is a gpt.pth of IndexTTS2 (2.0)"),
    "2.5 base, 2.0 config": ("indextts2", {"--base-checkpoint": "indextts25"}, "is a gpt.pth of IndexTTS-2.5"),
    "SentencePiece model, 2.5 config": ("indextts25", {"--tokenizer": "indextts2"}, "is a SentencePiece model"),
    "tiktoken file, 2.0 config": ("indextts2", {"--tokenizer": "indextts25"}, "is a tiktoken file"),
    "2.0 manifests, 2.5 run": ("indextts25", {"--train-manifest": "indextts2", "--val-manifest": "indextts2"},
                               "a manifest of IndexTTS2 (2.0)'s features"),
    "2.5 manifests, 2.0 run": ("indextts2", {"--train-manifest": "indextts25", "--val-manifest": "indextts25"},
                               "a manifest of IndexTTS-2.5's features"),
    "[32, D] latents behind 2.5 lines": ("indextts25", {"--train-manifest": "npy", "--val-manifest": "npy"},
                                         "are IndexTTS2 (2.0)'s, but --config"),
    "[192] speaker vectors behind 2.0 lines": ("indextts2", {"--train-manifest": "npy", "--val-manifest": "npy"},
                                               "are IndexTTS-2.5's, but --config"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_an_input_of_the_other_model_is_refused_naming_both_and_nothing_is_written(case, demo_assets, demo25_assets,
                                                                                 tmp_path):
    run_family, swapped, message = REFUSALS[case]
    assets = {"indextts2": demo_assets, "indextts25": demo25_assets}
    flags = list(assets[run_family])
    if run_family == "indextts2":
        flags += ["--config", str(DEMO25_CONFIG.with_name("demo.yaml"))]
    mixed = npy_lines_of_the_other_model(demo_assets, demo25_assets, tmp_path / "mixed")
    for name, source in swapped.items():
        value = mixed[run_family] if source == "npy" else flag(assets[source], name)
        flags = with_flag(flags, name, value)
    inputs_before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    run = tmp_path / "run"
    refused = train_here(run, *flags, "--max-steps", "1")
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr and message in refused.stderr, refused.stderr
    assert "IndexTTS2 (2.0)" in refused.stderr and "IndexTTS-2.5" in refused.stderr
    assert not run.exists() and {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == inputs_before


def test_a_tokenizer_of_another_size_than_the_25_config_is_refused(demo25_assets, tmp_path):
    config = tmp_path / "config.yaml"
    data = yaml.safe_load(DEMO25_CONFIG.read_text())
    data["gpt"]["number_text_tokens"] = 2401
    config.write_text(yaml.safe_dump(data))
    refused = train_here(tmp_path / "run", *with_flag(demo25_assets, "--config", str(config)), "--max-steps", "1")
    assert refused.returncode == 2 and "gpt.number_text_tokens is 2401 but the tokenizer has 2400 ids" in refused.stderr
    assert not (tmp_path / "run").exists()


def test_a_resume_with_a_tokenizer_of_another_size_gives_the_real_reason_first(demo25_assets, tmp_path):
    """Another tokenizer size means a new run from the checkpoint's weights, which a 2.5 tokenizer cannot start
    (its special tokens would move): that is said first, not "pass a new --output-dir", after which it came."""
    from trainers.families.indextts25.demo import tiktoken_file

    run = tmp_path / "run"
    assert train_here(run, *demo25_assets, "--max-steps", "1", "--val-interval", "0").returncode == 0
    other = tmp_path / "other.tiktoken"
    other.write_bytes(tiktoken_file(2401))
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    refused = train_here(run, "--resume", "auto", "--tokenizer", str(other))
    assert refused.returncode == 2, refused.stderr
    assert "IndexTTS-2.5's tokenizer cannot be extended" in refused.stderr, refused.stderr
    assert "--output-dir" not in refused.stderr and "Traceback" not in refused.stderr
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


# ---------------------------------------------------------------------------------------------- a new language

NEW = ["--new-language", "tr", "--new-rows-lr-scale", "10", "--val-interval", "0", "--save-interval", "3",
       "--log-interval", "1", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def turkish25(demo25_assets, tmp_path_factory) -> list[str]:
    """The demo's flags with its corpus as Turkish: a copy whose text ids begin with <|tr|> instead of <|en|> (as
    upstream's front end writes Turkish text) and whose lines say tr, so its samples train lang_embedding's row of
    'tr' and <|tr|>'s text rows (the manifests' check refuses text ids of another language than the sample's)."""
    first = 2400 - len(SPECIAL_TOKENS) + 2  # <|en|>, lang_id 0
    out = tmp_path_factory.mktemp("turkish25")
    (out / "features").mkdir()
    flags = list(demo25_assets)
    for name in ("--train-manifest", "--val-manifest"):
        manifest = Path(flag(flags, name))
        lines = []
        for line in manifest.read_text().splitlines():
            row = json.loads(line)
            for key in ("features", "target_features", "prompt_features"):
                if key in row and not (out / row[key]).exists():
                    with np.load(manifest.parent / row[key]) as archive:
                        arrays = dict(archive)
                    assert arrays["text_ids"][0] == first
                    arrays["text_ids"][0] = first + lang_id("tr")
                    np.savez(out / row[key], **arrays)
            lines.append(json.dumps({**row, "lang": "tr", **({"prompt_lang": "tr"} if "prompt_lang" in row else {})}))
        (out / manifest.name).write_text("".join(line + "\n" for line in lines))
        flags = with_flag(flags, name, str(out / manifest.name))
    return flags


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_new_languages_rows_train_and_every_other_row_stays_bit_identical(turkish25, demo25_assets, tmp_path, lora):
    from tests.demo_runs import assert_equal_nested, final_state
    from trainers.model.weights import read_state_dict

    flags = [*turkish25, *NEW, *(["--lora-rank", "4"] if lora else [])]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert train_here(straight, *flags, "--max-steps", "6").returncode == 0
    first = train_here(stopped, *flags, "--max-steps", "6", kill_at="SIGTERM@micro:4:0")
    assert first.returncode == 143, first.stderr
    again = train_here(stopped, "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "--new-language tr: rows lang_embedding.weight[9], text_embedding.weight[738]" in again.stderr
    a, b = final_state(straight), final_state(stopped)
    assert_equal_nested(a.model, b.model, "model")
    assert_equal_nested(a.optimizer, b.optimizer, "optimizer")
    base = read_state_dict(Path(flag(demo25_assets, "--base-checkpoint")))
    token = 2400 - len(SPECIAL_TOKENS) + 2 + lang_id("tr")
    for key, trained in (("lang_embedding.weight", [lang_id("tr")]), ("text_embedding.weight", [token]),
                         ("text_head.weight", [token]), ("text_head.bias", [token])):
        changed = (a.model[key] != base[key]).reshape(base[key].shape[0], -1).any(1).nonzero().flatten().tolist()
        assert changed == trained, (key, changed)
    groups = a.optimizer["param_groups"]
    scaled = [g for g in groups if "lr_scale" in g]
    assert [g["lr_scale"] for g in scaled] == [10.0, 10.0] and scaled[0]["lr"] == pytest.approx(10 * groups[0]["lr"])
    if lora:  # the adapters and the tables of the new rows; nothing else of the base
        assert set(a.model) - {k for k in a.model if k.endswith((".lora_a", ".lora_b"))} == {
            "lang_embedding.weight", "text_embedding.weight", "text_head.weight", "text_head.bias"}


@pytest.mark.parametrize("extra, message", [
    (["--new-language", "xx"], "--new-language xx: not one of IndexTTS-2.5's 106 language codes"),
    (["--new-rows-lr-scale", "5"], "--new-rows-lr-scale 5 scales the rows that train beside held ones"),
    # English data, its rows asked for ja: no sample would reach them (it trained, with only the usual INFO line)
    (["--new-language", "ja,en"], "--new-language ja: none of the 384 training samples is in ja (by language: en 384)"),
])
def test_new_language_flags_that_cannot_apply_are_refused(demo25_assets, tmp_path, extra, message):
    refused = train_here(tmp_path / "run", *demo25_assets, "--max-steps", "1", *extra)
    assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert not (tmp_path / "run").exists()


def test_a_new_language_on_indextts2_is_refused_and_its_demo_leaves_nothing_written(tmp_path):
    """--demo generates its corpus in the run directory before the flag is refused: the refusal says "nothing was
    written", so the corpus goes with the lock file and the directory the start made."""
    refused = train_here(tmp_path / "run", "--demo", "--max-steps", "1", "--new-language", "tr")
    assert refused.returncode == 2 and "IndexTTS2 (2.0) has no language rows" in refused.stderr, refused.stderr
    assert "Generated demo corpus" in refused.stderr and "nothing was written" in refused.stderr
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ indextts-retokenize

def npy_manifest(root: Path, texts: list[tuple[str, str | None]]) -> Path:
    """Single 2.5 .npy lines (text_ids_path, codes_path, spk_emb_path, emo_vec_path) with these texts/languages."""
    (root / "f").mkdir(parents=True)
    np.save(root / "f" / "spk.npy", np.ones(192, np.float32))
    np.save(root / "f" / "emo.npy", np.zeros(64, np.float32))
    np.save(root / "f" / "codes.npy", np.arange(5, dtype=np.int32))
    lines = [{"id": f"u{i}", "text": text, "codes_path": "f/codes.npy", "code_len": 5, "spk_emb_path": "f/spk.npy",
              "emo_vec_path": "f/emo.npy", **({"language": lang} if lang else {})} for i, (text, lang) in enumerate(texts)]
    (root / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root / "m.jsonl"


def test_retokenize_writes_25_text_ids_as_upstreams_front_end_makes_them(demo25_assets, tmp_path, capsys):
    from trainers.families.indextts25.front_end import front_end
    from trainers.tools.tokenizer.retokenize_manifest import main as retokenize

    tokenizer = flag(demo25_assets, "--tokenizer")
    enc = encoding(tokenizer)
    manifest = npy_manifest(tmp_path / "in", [("The Cat walks: quickly!", "en"), ("the dog (runs)", "es"),
                                              ("a bird sings", None)])
    assert retokenize(["--tokenizer", tokenizer, "--manifests", str(manifest), "--output-dir", str(tmp_path / "out"),
                       "--config", str(DEMO25_CONFIG), "--language", "ja"]) == 0
    out = capsys.readouterr().out
    assert "language normalisation SKIPPED: IndexTTS-2.5 inference normalises zh, zhen and en with WeTextProcessing" in out
    rows = [json.loads(line) for line in (tmp_path / "out" / "m.jsonl").read_text().splitlines()]
    ids = [np.load(tmp_path / "out" / row["text_ids_path"]).tolist() for row in rows]
    assert front_end("The Cat walks: quickly!", "en") == "<|en|> the cat walks, quickly!"  # lower case, ':' -> ','
    assert front_end("the dog (runs)", "es") == "<|es|> THE DOG 'RUNS'"  # UPPER case, brackets -> quotes
    assert ids[0] == [i for i in enc.encode("<|en|> the cat walks, quickly!", allowed_special="all") if i > 1]
    assert ids[0][0] == enc.encode("<|en|>", allowed_special="all")[0] and 0 not in ids[0]  # "!" (id 0) dropped
    assert ids[1][0] == enc.encode("<|es|>", allowed_special="all")[0]
    assert rows[2]["language"] == "ja" and ids[2][0] == enc.encode("<|ja|>", allowed_special="all")[0]
    assert [row["text_len"] for row in rows] == list(map(len, ids))
    table = load_manifests([parse_manifest_spec(str(tmp_path / "out" / "m.jsonl"))],
                           FAMILY.data_limits(FAMILY.read_config(yaml.safe_load(DEMO25_CONFIG.read_text())["gpt"])))
    assert list(table.text_len) == list(map(len, ids))  # what the trainer counts: nothing more to drop


@pytest.mark.parametrize("flags, message", [
    (["--config", str(DEMO25_CONFIG.with_name("demo.yaml"))], "is IndexTTS-2.5's, but --config"),
    ([], "language 'xx' is not one of IndexTTS-2.5's 106 language codes"),
])
def test_retokenize_refuses_a_25_tokenizer_with_a_20_config_or_an_unknown_language(demo25_assets, tmp_path, capsys,
                                                                                  flags, message):
    from trainers.tools.tokenizer.retokenize_manifest import main as retokenize

    manifest = npy_manifest(tmp_path / "in", [("a cat", "xx")])
    assert retokenize(["--tokenizer", flag(demo25_assets, "--tokenizer"), "--manifests", str(manifest),
                       "--output-dir", str(tmp_path / "out"), *flags]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_text_loss_in_blocks_has_the_gradient_of_one_block():
    """chunked_head_cross_entropy (IndexTTS-2.5's text loss) against the head's logits at once: same loss and
    gradients within float rounding, in fp32 and under bf16 autocast, with blocks that do not divide the rows."""
    from trainers.model.cross_entropy import chunked_head_cross_entropy, summed_cross_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    h, targets = torch.randn(11, 16, requires_grad=True), torch.randint(0, 50, (11,))
    for autocast in (False, True):
        grads = []
        for blocks in (None, 4):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = (summed_cross_entropy(head(h).float(), targets) if blocks is None
                        else chunked_head_cross_entropy(h, targets, head, blocks))
            grads.append([loss.detach(), *torch.autograd.grad(loss, (h, head.weight, head.bias))])
        tolerance = 3e-2 if autocast else 1e-5  # bf16 products summed in another order
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
