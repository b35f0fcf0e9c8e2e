"""The validation samples generated at each validation: a few per language, bounded, and a pure function
of the validation set's ids and the seed (not of row order, batch sizes or processes)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from trainers.data.generation_samples import choose, generation_samples
from trainers.data.manifest import ManifestSpec, load_manifests
from trainers.data.manifest_lines import DataLimits

from tests.test_sample_table import write_corpus

LIMITS = DataLimits(max_text_tokens=100, max_mel_tokens=100)


def shuffled_copy(manifest: Path, folder: Path, seed: int) -> Path:
    """The same lines in another order, in a manifest of its own beside the same feature files."""
    lines = manifest.read_text().splitlines()
    random.Random(seed).shuffle(lines)
    copy = folder / "shuffled.jsonl"
    copy.write_text("".join(line + "\n" for line in lines))
    return copy


def test_the_choice_is_the_same_whatever_order_the_manifest_lists_the_samples_in(tmp_path):
    manifest = write_corpus(tmp_path, 60)
    first = generation_samples(load_manifests([ManifestSpec(manifest, None)], LIMITS), seed=7)
    other = load_manifests([ManifestSpec(shuffled_copy(manifest, tmp_path, 1), None)], LIMITS)
    second = generation_samples(other, seed=7)
    assert first.ids == second.ids and first.languages == second.languages
    assert first.indices != second.indices  # other rows, the same samples
    assert [other.ids[i] for i in second.indices] == list(second.ids)
    assert generation_samples(other, seed=8).ids != first.ids  # the seed chooses


def test_a_few_per_language_and_the_unlabelled_group_last(tmp_path):
    table = load_manifests([ManifestSpec(write_corpus(tmp_path, 60), None)], LIMITS)
    chosen = generation_samples(table, seed=0, per_language=3, max_total=100)
    assert chosen.languages == ("am",) * 3 + ("en",) * 3 + (None,) * 3 and chosen.left_out == ()
    for index, sample_id, lang in zip(chosen.indices, chosen.ids, chosen.languages):
        assert table[index].id == sample_id and table[index].lang == lang


def test_the_total_is_bounded_and_every_language_gets_one_before_any_gets_two():
    ids = [f"u{i}" for i in range(40)]
    langs = ["de", "am", "zh", "en"] * 10
    chosen, left_out = choose(ids, langs, seed=3, per_language=4, max_total=6)
    picked = [langs[p] for p in chosen]
    assert len(chosen) == 6 and picked == ["am", "am", "de", "de", "en", "zh"] and left_out == []
    chosen, left_out = choose(ids, langs, seed=3, per_language=4, max_total=3)
    assert [langs[p] for p in chosen] == ["am", "de", "en"] and left_out == ["zh"]


def test_adding_a_sample_changes_the_choice_only_where_the_new_id_ranks_in():
    ids = [f"u{i}" for i in range(30)]
    before, _ = choose(ids, [None] * 30, seed=5, per_language=4, max_total=4)
    after, _ = choose(ids + ["new"], [None] * 31, seed=5, per_language=4, max_total=4)
    old = {ids[p] for p in before}
    new = {(ids + ["new"])[p] for p in after}
    assert new == old or (len(new - old) == 1 and new - old == {"new"})


def test_a_repeated_id_is_one_candidate():
    chosen, _ = choose(["a", "a", "a", "b"], [None] * 4, seed=0, per_language=4, max_total=4)
    assert sorted(chosen) == [0, 3]


def test_the_choice_does_not_depend_on_the_process(tmp_path):
    """blake2b, not Python's salted hash(): another interpreter (another torchrun process, a resume)
    chooses the same ids."""
    code = ("import json; from trainers.data.generation_samples import choose; "
            "ids = [f'u{i}' for i in range(50)]; print(json.dumps(choose(ids, [None] * 50, 11, 4, 4)[0]))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      env={**os.environ, "PYTHONHASHSEED": seed}).stdout)  # PYTHONPATH: conftest
            for seed in ("1", "2")]
    here, _ = choose([f"u{i}" for i in range(50)], [None] * 50, 11, 4, 4)
    assert runs[0] == runs[1] == here


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="per_language and max_total must be >= 1"):
        choose(["a"], [None], seed=0, per_language=0)
