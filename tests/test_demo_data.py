"""Tests for the built-in synthetic demo corpus."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

import trainers.data.demo_data as demo_data
from trainers.data import demo_corpus
from trainers.data.demo_corpus import front_end
from trainers.data.demo_data import DemoAssets, DemoCorpusSpec, ensure_demo_assets, spec_fingerprint

SPEC = DemoCorpusSpec()

PAIRED_FIELDS = {
    "id", "speaker", "prompt_id", "prompt_condition_path", "prompt_condition_len",
    "prompt_emo_vec_path", "target_id", "target_text", "target_text_ids_path",
    "target_text_len", "target_codes_path", "target_code_len", "target_emo_vec_path",
}
SINGLE_FIELDS = {
    "id", "speaker", "text", "text_ids_path", "text_len", "codes_path", "code_len",
    "condition_path", "condition_len", "emo_vec_path",
}


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _rows(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    return ensure_demo_assets(tmp_path_factory.mktemp("demo") / "corpus")


def test_generation_is_byte_identical(assets: DemoAssets, tmp_path: Path) -> None:
    other = ensure_demo_assets(tmp_path / "again")
    first, second = _file_hashes(assets.root), _file_hashes(other.root)
    assert first == second
    assert len(first) == 4 + SPEC.num_speakers + 3 * (SPEC.num_train + SPEC.num_val)


def test_generation_is_identical_across_processes(assets: DemoAssets, tmp_path: Path) -> None:
    # A fresh interpreter (different hash seed) must produce the same bytes.
    root = tmp_path / "subprocess"
    code = "import sys; from pathlib import Path; from trainers.data.demo_data import ensure_demo_assets; "
    code += "ensure_demo_assets(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code, str(root)], check=True, cwd=repo, env=env)
    assert _file_hashes(root) == _file_hashes(assets.root)


def test_second_call_reuses(assets: DemoAssets, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args: object) -> None:
        raise AssertionError("corpus was regenerated")

    monkeypatch.setattr(demo_data, "generate", fail)
    before = _file_hashes(assets.root)
    assert ensure_demo_assets(assets.root) == assets
    assert _file_hashes(assets.root) == before


def test_marker_and_no_leftovers(assets: DemoAssets) -> None:
    marker = (assets.root / demo_data.READY_NAME).read_text(encoding="utf-8").strip()
    assert marker == spec_fingerprint(SPEC)
    siblings = [p.name for p in assets.root.parent.iterdir()]
    assert siblings == [assets.root.name]  # temp dirs were renamed or removed


def test_tokenizer(assets: DemoAssets) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(assets.tokenizer))
    assert sp.get_piece_size() == SPEC.vocab_size
    assert [sp.id_to_piece(i) for i in range(3)] == ["<s>", "</s>", "<unk>"]
    assert (sp.bos_id(), sp.eos_id(), sp.unk_id(), sp.pad_id()) == (0, 1, 2, -1)


def test_train_manifest_is_paired(assets: DemoAssets) -> None:
    rows = _rows(assets.train_manifest)
    assert len(rows) == SPEC.num_train
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        assert PAIRED_FIELDS <= row.keys()
        assert row["id"] == f"{row['target_id']}__{row['prompt_id']}"
        assert row["prompt_id"] != row["target_id"]
        assert row["prompt_condition_path"] == f"features/{row['speaker']}_condition.npy"
        for key in PAIRED_FIELDS:
            if key.endswith("_path"):
                assert (assets.train_manifest.parent / row[key]).is_file(), row[key]


def test_val_manifest_is_single(assets: DemoAssets) -> None:
    rows = _rows(assets.val_manifest)
    assert len(rows) == SPEC.num_val
    for row in rows:
        assert SINGLE_FIELDS <= row.keys()
        assert "prompt_condition_path" not in row and "target_codes_path" not in row
        for key in SINGLE_FIELDS:
            if key.endswith("_path"):
                assert (assets.val_manifest.parent / row[key]).is_file(), row[key]


def _features(assets: DemoAssets) -> list[dict]:
    """Normalize both manifest forms to one dict per utterance."""
    items = []
    for row in _rows(assets.train_manifest):
        items.append({
            "text": row["target_text"], "text_ids": row["target_text_ids_path"],
            "text_len": row["target_text_len"], "codes": row["target_codes_path"],
            "code_len": row["target_code_len"], "condition": row["prompt_condition_path"],
            "condition_len": row["prompt_condition_len"], "emo_vec": row["prompt_emo_vec_path"],
        })
    for row in _rows(assets.val_manifest):
        items.append({
            "text": row["text"], "text_ids": row["text_ids_path"],
            "text_len": row["text_len"], "codes": row["codes_path"], "code_len": row["code_len"],
            "condition": row["condition_path"], "condition_len": row["condition_len"],
            "emo_vec": row["emo_vec_path"],
        })
    return items


def test_feature_contents(assets: DemoAssets) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(assets.tokenizer))
    for item in _features(assets):
        text_ids = np.load(assets.root / item["text_ids"])
        codes = np.load(assets.root / item["codes"])
        condition = np.load(assets.root / item["condition"])
        emo_vec = np.load(assets.root / item["emo_vec"])

        assert text_ids.dtype == np.int32 and text_ids.ndim == 1
        assert len(text_ids) == item["text_len"]
        assert 0 < len(text_ids) <= demo_corpus.MAX_TEXT_LEN
        assert text_ids.tolist() == sp.encode(front_end(item["text"]))  # no bos/eos; upper-cased as upstream does
        assert 3 <= int(text_ids.min()) and int(text_ids.max()) < SPEC.vocab_size
        assert 3 <= len(item["text"].split()) - 1 <= 8  # words plus the final "."

        assert codes.dtype == np.int32 and codes.ndim == 1
        assert len(codes) == item["code_len"] and 0 < len(codes) <= demo_corpus.MAX_CODE_LEN
        assert 0 <= int(codes.min()) and int(codes.max()) < SPEC.num_codes

        assert condition.dtype == np.float32
        assert condition.shape == (item["condition_len"], SPEC.model_dim) == (32, SPEC.model_dim)
        assert emo_vec.dtype == np.float32 and emo_vec.shape == (SPEC.model_dim,)


def test_codes_follow_token_patterns(assets: DemoAssets) -> None:
    # Within a token's run consecutive codes step by +1: most steps must be +1.
    steps = []
    for item in _features(assets):
        codes = np.load(assets.root / item["codes"]).astype(np.int64)
        steps.append((np.diff(codes) % SPEC.num_codes) == 1)
    assert np.concatenate(steps).mean() > 0.6


def test_spec_change_regenerates(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    ensure_demo_assets(root, DemoCorpusSpec(num_train=16, num_val=4))
    before = _file_hashes(root)
    spec = DemoCorpusSpec(num_train=16, num_val=4, seed=7)
    ensure_demo_assets(root, spec)
    after = _file_hashes(root)
    assert after != before
    assert (root / demo_data.READY_NAME).read_text(encoding="utf-8").strip() == spec_fingerprint(spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_incomplete_corpus_is_regenerated(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "features").mkdir(parents=True)
    (root / "train.jsonl").write_text("half written", encoding="utf-8")
    assets = ensure_demo_assets(root, DemoCorpusSpec(num_train=16, num_val=4))
    assert len(_rows(assets.train_manifest)) == 16


def test_failed_generation_leaves_nothing_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_generate = demo_data.generate

    def crash(out: Path, spec: DemoCorpusSpec) -> None:
        real_generate(out, spec)
        raise KeyboardInterrupt  # killed after writing everything but the marker

    monkeypatch.setattr(demo_data, "generate", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_assets(tmp_path / "corpus", DemoCorpusSpec(num_train=16, num_val=4))
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_clobber_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(FileExistsError):
        ensure_demo_assets(tmp_path, DemoCorpusSpec(num_train=16, num_val=4))
    assert (tmp_path / "notes.txt").read_text(encoding="utf-8") == "keep me"


def test_invalid_spec_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ensure_demo_assets(tmp_path / "corpus", DemoCorpusSpec(num_train=4, num_speakers=4))
