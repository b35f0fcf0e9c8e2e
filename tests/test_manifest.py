import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainers.config.manifest_flags import manifest_flag
from trainers.data.manifest import (
    DataLimits,
    ManifestError,
    ManifestSpec,
    load_manifests,
    manifests_fingerprint,
    parse_manifest_spec,
)

LIMITS = DataLimits(max_text_tokens=600, max_mel_tokens=1815)


def make_features(folder: Path, name: str) -> dict[str, str]:
    """Write one sample's four tiny .npy files under folder/feats and return their relative paths."""
    feats = folder / "feats"
    feats.mkdir(parents=True, exist_ok=True)
    arrays = {
        "text": np.arange(2, 7, dtype=np.int32),
        "codes": np.arange(10, dtype=np.int32),
        "cond": np.zeros((32, 8), dtype=np.float32),
        "emo": np.zeros(8, dtype=np.float32),
    }
    rel = {}
    for kind, array in arrays.items():
        np.save(feats / f"{name}_{kind}.npy", array)
        rel[kind] = f"feats/{name}_{kind}.npy"
    return rel


def paired_line(rel: dict[str, str], **overrides) -> dict:
    line = {
        "id": "t1__p1",
        "speaker": "spk",
        "prompt_id": "p1",
        "prompt_condition_path": rel["cond"],
        "prompt_condition_len": 32,
        "prompt_emo_vec_path": rel["emo"],
        "target_id": "t1",
        "target_text": "hello",
        "target_text_ids_path": rel["text"],
        "target_text_len": 5,
        "target_codes_path": rel["codes"],
        "target_code_len": 10,
    }
    line.update(overrides)
    return line


def single_line(rel: dict[str, str], **overrides) -> dict:
    line = {
        "id": "u1",
        "text_ids_path": rel["text"],
        "text_len": 5,
        "codes_path": rel["codes"],
        "code_len": 10,
        "condition_path": rel["cond"],
        "condition_len": 32,
        "emo_vec_path": rel["emo"],
    }
    line.update(overrides)
    return line


def write_manifest(path: Path, lines: list) -> Path:
    """Write lines (dicts are JSON-encoded, strings written verbatim)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.write_text(text + "\n", encoding="utf-8")
    return path


def problems_of(excinfo) -> list[str]:
    return excinfo.value.problems


# --- spec parsing -----------------------------------------------------------


def test_parse_spec_with_and_without_language():
    assert parse_manifest_spec("data/train.jsonl::am") == ManifestSpec(Path("data/train.jsonl"), "am")
    assert parse_manifest_spec("data/train.jsonl") == ManifestSpec(Path("data/train.jsonl"), None)
    assert parse_manifest_spec("data/zh.jsonl::zh@0.2") == ManifestSpec(Path("data/zh.jsonl"), "zh")  # a replay's


def test_a_manifest_flag_is_read_in_one_place():
    """PATH[::LANG[@SHARE]]: the language after the last '::', a share after its last '@' (trainers/config)."""
    one = manifest_flag("/d/a::b.jsonl::zh@0.2")
    assert (one.path, one.lang, one.share, one.manifest) == ("/d/a::b.jsonl", "zh", "0.2", "/d/a::b.jsonl::zh")
    assert one.moved("/e/c.jsonl") == "/e/c.jsonl::zh@0.2"
    assert (manifest_flag("x@2.jsonl").path, manifest_flag("x@2.jsonl").share) == ("x@2.jsonl", None)
    assert (manifest_flag("v.jsonl::en").lang, manifest_flag("v.jsonl::en").share) == ("en", None)


@pytest.mark.parametrize("spec", ["data/train.jsonl::", "data/train.jsonl::  ", "::am"])
def test_parse_spec_rejects_empty_parts(spec):
    with pytest.raises(ManifestError):
        parse_manifest_spec(spec)


# --- successful parsing -------------------------------------------------------


def test_paired_line_maps_prompt_and_target_fields(tmp_path):
    rel = make_features(tmp_path, "a")
    manifest = write_manifest(tmp_path / "manifest.jsonl", [paired_line(rel, language="ja")])
    (sample,) = load_manifests([ManifestSpec(manifest, None)], LIMITS)
    assert sample.index == 0
    assert sample.id == "t1__p1"
    assert sample.source == f"{manifest}:1"
    assert sample.condition_path == str(tmp_path / rel["cond"])
    assert sample.emo_vec_path == str(tmp_path / rel["emo"])
    assert sample.text_ids_path == str(tmp_path / rel["text"])
    assert sample.codes_path == str(tmp_path / rel["codes"])
    assert (sample.text_len, sample.code_len) == (5, 10)
    assert sample.speaker == "spk"
    assert sample.lang == "ja"


def test_single_line_and_blank_lines(tmp_path):
    rel = make_features(tmp_path, "a")
    lines = ["", single_line(rel), "   ", single_line(rel, id="u2", speaker=7)]
    manifest = write_manifest(tmp_path / "manifest.jsonl", lines)
    samples = load_manifests([ManifestSpec(manifest, None)], LIMITS)
    assert [s.id for s in samples] == ["u1", "u2"]
    assert [s.source for s in samples] == [f"{manifest}:2", f"{manifest}:4"]
    assert samples[0].speaker is None and samples[1].speaker == "7"
    assert samples[0].lang is None
    assert samples[0].condition_path == str(tmp_path / rel["cond"])


def test_paths_resolve_relative_to_manifest_folder_not_cwd(tmp_path, monkeypatch):
    data = tmp_path / "data"
    rel = make_features(data, "a")
    absolute_emo = str(data / rel["emo"])
    manifest = write_manifest(data / "lists" / "train.jsonl", [
        single_line({k: "../" + v for k, v in rel.items()}, emo_vec_path=absolute_emo),
    ])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (sample,) = load_manifests([ManifestSpec(Path(os.path.relpath(manifest)), None)], LIMITS)
    assert sample.codes_path == str(data / rel["codes"])  # normalised, no ".."
    assert sample.emo_vec_path == absolute_emo
    assert os.path.isabs(sample.text_ids_path)


def test_lang_suffix_overrides_line_language_and_indices_span_files(tmp_path):
    rel = make_features(tmp_path, "a")
    first = write_manifest(tmp_path / "a.jsonl", [single_line(rel, language="en"), single_line(rel, id="u2")])
    second = write_manifest(tmp_path / "b.jsonl", [single_line(rel, id="u3", language="en")])
    specs = [parse_manifest_spec(f"{first}::am"), ManifestSpec(second, None)]
    samples = load_manifests(specs, LIMITS)
    assert [s.lang for s in samples] == ["am", "am", "en"]
    assert [s.index for s in samples] == [0, 1, 2]


def test_duplicate_ids_warn_once_with_count(tmp_path, caplog):
    rel = make_features(tmp_path, "a")
    manifest = write_manifest(tmp_path / "m.jsonl", [single_line(rel)] * 3 + [single_line(rel, id="x")])
    with caplog.at_level(logging.WARNING, logger="trainers.data.manifest"):
        samples = load_manifests([ManifestSpec(manifest, None)], LIMITS)
    assert len(samples) == 4
    warnings = [r for r in caplog.records if r.name == "trainers.data.manifest"]
    assert len(warnings) == 1
    assert "2 samples" in warnings[0].getMessage()


# --- errors -------------------------------------------------------------------


def load_error(tmp_path, lines, limits=LIMITS) -> list[str]:
    manifest = write_manifest(tmp_path / "manifest.jsonl", lines)
    with pytest.raises(ManifestError) as excinfo:
        load_manifests([ManifestSpec(manifest, None)], limits)
    return problems_of(excinfo)


def test_missing_field_is_named(tmp_path):
    rel = make_features(tmp_path, "a")
    line = paired_line(rel)
    del line["target_code_len"], line["id"]
    (problem,) = load_error(tmp_path, [single_line(rel), line])
    assert "manifest.jsonl:2:" in problem
    assert "id" in problem and "target_code_len" in problem


def test_missing_feature_file_names_field_and_resolved_path(tmp_path):
    rel = make_features(tmp_path, "a")
    (problem,) = load_error(tmp_path, [single_line(rel, codes_path="feats/gone.npy")])
    assert "manifest.jsonl:1:" in problem
    assert "codes_path" in problem
    assert str(tmp_path / "feats" / "gone.npy") in problem


def test_over_long_sample_names_limit_and_config_key(tmp_path):
    rel = make_features(tmp_path, "a")
    problems = load_error(tmp_path, [paired_line(rel), paired_line(rel, target_code_len=2000)])
    assert problems == [
        f"{tmp_path / 'manifest.jsonl'}:2: target_code_len 2000 exceeds gpt.max_mel_tokens 1815; drop or split this sample"
    ]


def test_combined_length_limit(tmp_path):
    rel = make_features(tmp_path, "a")
    limits = DataLimits(max_text_tokens=10, max_mel_tokens=20)
    # Each length fits on its own, but 34+(10+2)+(20+2) = 68 > (20+3)+(10+2) = 35.
    (problem,) = load_error(tmp_path, [single_line(rel, text_len=10, code_len=20)], limits)
    assert "manifest.jsonl:1:" in problem and "68" in problem and "35" in problem


def test_zero_length_is_rejected(tmp_path):
    rel = make_features(tmp_path, "a")
    (problem,) = load_error(tmp_path, [single_line(rel, text_len=0)])
    assert "manifest.jsonl:1:" in problem and "text_len 0" in problem


def test_bad_json_and_non_object_lines(tmp_path):
    rel = make_features(tmp_path, "a")
    problems = load_error(tmp_path, [single_line(rel), '{"id": "x",', "[1, 2]"])
    assert len(problems) == 2
    assert problems[0].startswith(f"{tmp_path / 'manifest.jsonl'}:2: invalid JSON")
    assert "manifest.jsonl:3:" in problems[1] and "not an object" in problems[1]


@pytest.mark.parametrize(
    "override, key",
    [
        ({"text_len": True}, "text_len"),
        ({"code_len": "10"}, "code_len"),
        ({"code_len": 10.0}, "code_len"),
        ({"codes_path": ""}, "codes_path"),
        ({"condition_path": 3}, "condition_path"),
        ({"id": 5}, "id"),
        ({"language": ["en"]}, "language"),
    ],
)
def test_wrong_types(tmp_path, override, key):
    rel = make_features(tmp_path, "a")
    (problem,) = load_error(tmp_path, [single_line(rel, **override)])
    assert "manifest.jsonl:1:" in problem and key in problem


def test_unrecognised_form_says_which_keys_identify_each(tmp_path):
    (problem,) = load_error(tmp_path, [{"id": "x", "wav": "a.wav"}])
    assert "manifest.jsonl:1:" in problem
    assert "prompt_condition_path" in problem and "target_codes_path" in problem and "codes_path" in problem


def test_all_problems_across_lines_and_files_are_reported(tmp_path):
    rel = make_features(tmp_path, "a")
    first = write_manifest(tmp_path / "one" / "manifest.jsonl", [
        single_line({k: "../" + v for k, v in rel.items()}),
        single_line(rel, code_len=5000),
        "not json",
    ])
    second = write_manifest(tmp_path / "two" / "manifest.jsonl", [paired_line(rel, target_text_len=-1)])
    missing = tmp_path / "three.jsonl"
    empty = write_manifest(tmp_path / "empty.jsonl", [""])
    specs = [ManifestSpec(p, None) for p in (first, second, missing, empty)]
    with pytest.raises(ManifestError) as excinfo:
        load_manifests(specs, LIMITS, flag="--val-manifest")
    problems = problems_of(excinfo)
    # line 2 of file one: over-long plus four missing feature files (paths are relative to one/)
    assert sum(f"{first}:2:" in p for p in problems) == 5
    assert any(p.startswith(f"{first}:3: invalid JSON") for p in problems)
    assert any(p.startswith(f"{second}:1:") for p in problems)
    assert f"--val-manifest {missing}: file not found; check the path" in problems
    assert any(p.startswith(f"--val-manifest {empty}:") and "no samples" in p for p in problems)
    assert not any(f"{first}:1:" in p for p in problems)
    message = str(excinfo.value)
    assert message.splitlines() == problems  # fewer than 30: all listed, one per line


def test_message_lists_at_most_30_problems(tmp_path):
    rel = make_features(tmp_path, "a")
    problems = load_error(tmp_path, [single_line(rel, code_len=0)] * 45)
    assert len(problems) == 45
    with pytest.raises(ManifestError) as excinfo:
        load_manifests([ManifestSpec(tmp_path / "manifest.jsonl", None)], LIMITS)
    lines = str(excinfo.value).splitlines()
    assert len(lines) == 31
    assert lines[-1] == "... and 15 more problems"


def test_manifest_error_survives_pickling():
    error = pickle.loads(pickle.dumps(ManifestError(["a:1: x", "a:2: y"])))
    assert error.problems == ["a:1: x", "a:2: y"]
    assert str(error) == "a:1: x\na:2: y"


def test_no_manifests_is_an_error():
    with pytest.raises(ManifestError, match="--train-manifest"):
        load_manifests([], LIMITS)


# --- fingerprint --------------------------------------------------------------


def test_fingerprint_survives_moving_the_folder_and_tracks_content(tmp_path):
    rel = make_features(tmp_path / "data", "a")
    manifest = write_manifest(tmp_path / "data" / "train.jsonl", [single_line(rel)])
    before = manifests_fingerprint([ManifestSpec(manifest, "am")])
    content = manifest.read_bytes()  # the documented composition: count, then language, length and bytes per file
    assert before == hashlib.sha256(b"manifests:1\nlang=am\nbytes:%d\n" % len(content) + content).hexdigest()

    shutil.move(tmp_path / "data", tmp_path / "moved")
    moved = tmp_path / "moved" / "train.jsonl"
    assert manifests_fingerprint([ManifestSpec(moved, "am")]) == before
    load_manifests([ManifestSpec(moved, "am")], LIMITS)  # relative paths still resolve

    assert manifests_fingerprint([ManifestSpec(moved, None)]) != before
    assert manifests_fingerprint([ManifestSpec(moved, "ja")]) != before
    write_manifest(moved, [single_line(rel, id="changed")])
    assert manifests_fingerprint([ManifestSpec(moved, "am")]) != before


def test_fingerprint_depends_on_order_and_file_boundaries(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_bytes(b"xy")
    b.write_bytes(b"z")
    ab = manifests_fingerprint([ManifestSpec(a, None), ManifestSpec(b, None)])
    assert ab != manifests_fingerprint([ManifestSpec(b, None), ManifestSpec(a, None)])
    a.write_bytes(b"x")
    b.write_bytes(b"yz")
    assert ab != manifests_fingerprint([ManifestSpec(a, None), ManifestSpec(b, None)])


def test_fingerprint_of_missing_file_raises(tmp_path):
    with pytest.raises(ManifestError):
        manifests_fingerprint([ManifestSpec(tmp_path / "nope.jsonl", None)])


# --- scale --------------------------------------------------------------------


def test_large_manifest_with_few_files_stats_each_file_once(tmp_path, monkeypatch):
    rels = [make_features(tmp_path, "a"), make_features(tmp_path, "b")]  # 8 files in all
    lines = []
    for i in range(20_000):
        rel = rels[i % 2]
        if i % 2:
            lines.append(json.dumps(paired_line(rel, id=f"s{i}", target_text_len=1 + i % 500)))
        else:
            lines.append(json.dumps(single_line(rel, id=f"s{i}", code_len=1 + i % 1500)))
    manifest = tmp_path / "big.jsonl"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")

    from trainers.data import manifest_lines

    stats = []
    real = manifest_lines.file_state
    monkeypatch.setattr(manifest_lines, "file_state", lambda path: stats.append(path) or real(path))
    samples = load_manifests([ManifestSpec(manifest, None)], LIMITS)
    assert len(samples) == 20_000
    assert samples[-1].index == 19_999
    assert samples[-1].source == f"{manifest}:20000"
    assert len(stats) == len(set(stats)) == 8  # one stat per feature file, not per line (cost: benchmarks/)
