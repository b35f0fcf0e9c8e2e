"""The compact sample table and its file: same samples as the manifest check gives, a few dozen bytes each,
and a file that is refused whenever it is not intact."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from trainers.data.manifest import ManifestSpec, load_manifests, repeated_ids
from trainers.data.manifest_lines import DataLimits
from trainers.data.sample_table import Sample, SampleTable, StringPool
from trainers.data.table_file import TableFileError, map_file, map_table, write_table

LIMITS = DataLimits(max_text_tokens=100, max_mel_tokens=100)


def write_corpus(folder: Path, lines: int, speakers: int = 3) -> Path:
    """`lines` single-utterance lines over 4 shared feature files, unique ids, a few speakers and languages."""
    feats = folder / "feats"
    feats.mkdir(parents=True)
    for name in ("t", "c", "cond", "e"):
        np.save(feats / f"{name}.npy", np.zeros(3))
    rows = [{"id": f"utt_{i:07d}", "text_ids_path": "feats/t.npy", "text_len": 1 + i % 40, "codes_path": "feats/c.npy",
             "code_len": 1 + i % 50, "condition_path": "feats/cond.npy", "emo_vec_path": "feats/e.npy",
             "speaker": f"spk{i % speakers}" if i % 5 else None, "language": ["en", "am"][i % 2] if i % 3 else None}
            for i in range(lines)]
    manifest = folder / "train.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return manifest


def test_the_table_gives_each_line_as_the_same_sample(tmp_path):
    manifest = write_corpus(tmp_path, 50)
    table = load_manifests([ManifestSpec(manifest, None)], LIMITS)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert isinstance(table, SampleTable) and len(table) == 50
    for i, (sample, row) in enumerate(zip(table, rows)):
        assert sample == Sample(index=i, id=row["id"], source=f"{manifest}:{i + 1}",
                                text_ids_path=str(tmp_path / "feats" / "t.npy"),
                                codes_path=str(tmp_path / "feats" / "c.npy"),
                                condition_path=str(tmp_path / "feats" / "cond.npy"),
                                emo_vec_path=str(tmp_path / "feats" / "e.npy"), text_len=row["text_len"],
                                code_len=row["code_len"], lang=row["language"], speaker=row["speaker"])
    assert table[-1] == table[49] and table[2:4] == [table[2], table[3]]
    assert table.text_len.tolist() == [r["text_len"] for r in rows]
    languages = table.languages(10)
    assert list(languages) == ["", "am", "en"]  # in order of first appearance
    assert sorted(i for ids in languages.values() for i in ids) == list(range(10))
    with pytest.raises(IndexError):
        table[50]


def test_a_list_of_samples_becomes_an_equal_table():
    samples = [Sample(index=i, id=f"s{i}", source=src, text_ids_path=f"/d/{i}_t.npy", codes_path="/d/c.npy",
                      condition_path="rel/cond.npy", emo_vec_path="", text_len=i + 1, code_len=2, lang=None,
                      speaker="\ud800odd" if i else None)
               for i, src in enumerate(["m.jsonl:1", "m.jsonl:7", "a:b.jsonl:3", "no line number"])]
    assert list(SampleTable.of(samples)) == samples


def test_a_sample_costs_well_under_100_bytes_when_features_are_shared(tmp_path):
    """The figure the data-scale benchmark measures at a million lines, from the arrays alone."""
    table = load_manifests([ManifestSpec(write_corpus(tmp_path, 20_000), None)], LIMITS)
    per_sample = sum(a.nbytes for a in table.arrays.values()) / len(table)
    assert per_sample < 60, per_sample  # 40 bytes of columns, 8 of id offset, 11 of id


def test_repeated_ids_are_counted_like_a_set_would_even_when_every_hash_collides():
    ids = ["a", "b", "a", "c", "b", "a", "d"]
    pool = StringPool(np.frombuffer("".join(ids).encode(), np.uint8), np.arange(len(ids) + 1, dtype=np.int64))
    for hashes in (np.array([hash(s) for s in ids], dtype=np.int64), np.zeros(len(ids), dtype=np.int64)):
        assert repeated_ids(hashes, pool) == (3, 2)  # positions 2, 4 and 5 repeat; the first is 2
    assert repeated_ids(np.arange(3, dtype=np.int64), pool) == (0, -1)


# --- the file -----------------------------------------------------------------------------------


def test_the_file_maps_the_same_table_and_pickles_as_its_path(tmp_path):
    table = load_manifests([ManifestSpec(write_corpus(tmp_path, 300), None)], LIMITS)
    path = tmp_path / "cache" / "train.samples"
    write_table(path, table, "key", {"note": 1}, {"extra": np.arange(5)})
    header, mapped, extras = map_file(path, verify=True, extras=("extra",))
    assert header["key"] == "key" and header["meta"] == {"note": 1} and extras["extra"].tolist() == list(range(5))
    assert list(mapped) == list(table) and mapped.backing == path
    assert not mapped.arrays["line"].flags.writeable
    assert [p.name for p in path.parent.iterdir()] == ["train.samples"]  # no temporary left behind
    blob = pickle.dumps(mapped)  # how a spawned loader worker receives it
    assert len(blob) < 1000 and list(pickle.loads(blob)) == list(table)
    assert list(map_table(path)) == list(table)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped byte":
        data[-100] ^= 0x40
    elif how == "truncated":
        del data[-64:]
    elif how == "appended":
        data += b"\0" * 64
    elif how == "bad header":
        data[20:30] = b"}}}}}}}}}}"
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped byte", "truncated", "appended", "bad header", "empty"])
def test_a_damaged_file_is_refused_with_the_reason(tmp_path, how):
    table = load_manifests([ManifestSpec(write_corpus(tmp_path, 300), None)], LIMITS)
    path = tmp_path / "t.samples"
    write_table(path, table, "key", {})
    _damage(path, how)
    with pytest.raises(TableFileError):
        map_file(path, verify=True)


def test_a_consistent_checksum_over_inconsistent_indices_is_still_refused(tmp_path):
    """A file written by a buggy or foreign writer: its checksum holds, its indices do not."""
    table = load_manifests([ManifestSpec(write_corpus(tmp_path, 30), None)], LIMITS)
    arrays = dict(table.arrays)
    arrays["codes"] = arrays["codes"].copy()
    arrays["codes"][7] = 99  # no such file
    path = tmp_path / "t.samples"
    write_table(path, SampleTable(arrays), "key", {})
    with pytest.raises(TableFileError, match="codes points outside"):
        map_file(path, verify=True)
