"""The validated-manifest cache: reused only while the manifests, their place and their feature folders are
unchanged, never when damaged, written atomically, and a resume of a real run takes it."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from tests.demo_runs import train_here
from tests.test_sample_table import LIMITS, write_corpus
from trainers.data import manifest_cache, manifest_lines
from trainers.data.manifest import ManifestError, ManifestSpec
from trainers.data.manifest_cache import cache_path, read_manifests

LONG_AGO = 1_000_000_000  # 2001: far outside the window in which a folder's times are not trusted


def corpus(tmp_path: Path, lines: int = 40) -> tuple[list[ManifestSpec], Path]:
    manifest = write_corpus(tmp_path / "data", lines)
    os.utime(manifest.parent / "feats", (LONG_AGO, LONG_AGO))
    return [ManifestSpec(manifest, None)], tmp_path / "run" / "data_cache" / "train.samples"


def first_start(specs, cache):
    checked = read_manifests(specs, LIMITS, "--train-manifest", cache)
    checked.save()
    assert cache.is_file()
    return checked


@pytest.fixture
def full_checks(monkeypatch) -> list[int]:
    """Counts the full checks (every line parsed, every feature file stat'ed)."""
    calls = []
    real = manifest_cache.validate_manifests
    monkeypatch.setattr(manifest_cache, "validate_manifests", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.fixture
def file_stats(monkeypatch) -> list[str]:
    stats = []
    for module in (manifest_cache, manifest_lines):
        real = module.file_state
        monkeypatch.setattr(module, "file_state", lambda path, real=real: stats.append(path) or real(path))
    return stats


def test_a_resume_reuses_the_check_without_reading_a_line_or_a_feature_file(tmp_path, full_checks, file_stats):
    specs, cache = corpus(tmp_path)
    first = first_start(specs, cache)
    assert full_checks == [1] and len(file_stats) == 4
    again = read_manifests(specs, LIMITS, "--train-manifest", cache)
    assert full_checks == [1] and len(file_stats) == 4  # no line parsed, no feature file stat'ed
    assert list(again.table) == list(first.table) and again.fingerprint == first.fingerprint
    assert again.table.backing == cache and again.write is None  # mapped from the file, nothing to rewrite


def test_a_changed_byte_is_noticed_though_size_and_mtime_are_kept(tmp_path, full_checks):
    specs, cache = corpus(tmp_path)
    first_start(specs, cache)
    manifest = specs[0].path
    stamp = manifest.stat()
    manifest.write_bytes(manifest.read_bytes().replace(b'"text_len": 7,', b'"text_len": 8,', 1))
    os.utime(manifest, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert manifest.stat().st_size == stamp.st_size and manifest.stat().st_mtime_ns == stamp.st_mtime_ns
    again = read_manifests(specs, LIMITS, "--train-manifest", cache)
    assert full_checks == [1, 1] and again.table.text_len[6] == 8
    again.save()  # the new check replaces the old cache
    assert read_manifests(specs, LIMITS, "--train-manifest", cache).table.text_len[6] == 8 and full_checks == [1, 1]


def test_other_limits_or_another_place_of_the_manifest_are_another_key(tmp_path, full_checks):
    specs, cache = corpus(tmp_path)
    first_start(specs, cache)
    from trainers.data.manifest_lines import DataLimits

    read_manifests(specs, DataLimits(max_text_tokens=99, max_mel_tokens=100), "--train-manifest", cache)
    moved = tmp_path / "moved"
    specs[0].path.parent.rename(moved)
    read_manifests([ManifestSpec(moved / "train.jsonl", None)], LIMITS, "--train-manifest", cache)
    assert full_checks == [1, 1, 1]


@pytest.mark.parametrize("how", ["flipped byte", "truncated", "bad header", "empty"])
def test_a_damaged_cache_is_never_used_and_is_written_again(tmp_path, full_checks, caplog, how):
    from tests.test_sample_table import _damage

    specs, cache = corpus(tmp_path)
    first = first_start(specs, cache)
    _damage(cache, how)
    with caplog.at_level(logging.WARNING, logger="train"):
        again = read_manifests(specs, LIMITS, "--train-manifest", cache)
    assert full_checks == [1, 1] and list(again.table) == list(first.table)
    assert any("is damaged or unreadable" in r.getMessage() and str(cache) in r.getMessage() for r in caplog.records)
    again.save()
    assert read_manifests(specs, LIMITS, "--train-manifest", cache).write is None and full_checks == [1, 1]


def test_a_failed_write_keeps_the_old_cache_and_training_goes_on(tmp_path, monkeypatch, caplog):
    specs, cache = corpus(tmp_path)
    first_start(specs, cache)
    before = cache.read_bytes()
    changed = read_manifests(specs, LIMITS, "--train-manifest", cache)
    changed.write = manifest_cache._CacheWrite(cache, "another key", manifest_cache.validate_manifests(
        specs, LIMITS, "--train-manifest"), changed.fingerprint)

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with caplog.at_level(logging.WARNING, logger="train"):
        changed.save()  # no exception: the run does not need its cache
    assert cache.read_bytes() == before
    assert any("could not write the validated-manifest cache" in r.getMessage() for r in caplog.records)


def test_a_removed_feature_file_is_found_through_its_folder(tmp_path, full_checks, file_stats):
    specs, cache = corpus(tmp_path)
    first_start(specs, cache)
    (specs[0].path.parent / "feats" / "c.npy").unlink()
    with pytest.raises(ManifestError, match=r"train.jsonl:1: codes_path file not found"):
        read_manifests(specs, LIMITS, "--train-manifest", cache)
    assert full_checks == [1, 1]


def test_a_folder_changed_otherwise_costs_one_stat_per_file_then_is_trusted_again(tmp_path, full_checks, file_stats):
    specs, cache = corpus(tmp_path)
    first_start(specs, cache)
    feats = specs[0].path.parent / "feats"
    np.save(feats / "new.npy", np.zeros(1))  # another file in the folder: nothing the manifest names is gone
    os.utime(feats, (LONG_AGO + 5, LONG_AGO + 5))
    again = read_manifests(specs, LIMITS, "--train-manifest", cache)
    assert full_checks == [1] and len(file_stats) == 8  # the 4 files stat'ed again, no line parsed
    assert again.write is not None  # the new folder record is saved
    again.save()
    read_manifests(specs, LIMITS, "--train-manifest", cache)
    assert full_checks == [1] and len(file_stats) == 8


def test_a_folder_changed_during_the_check_is_not_trusted(tmp_path, full_checks, file_stats):
    specs, cache = corpus(tmp_path)
    os.utime(specs[0].path.parent / "feats")  # now: inside the window of timestamp granularity
    first_start(specs, cache)
    read_manifests(specs, LIMITS, "--train-manifest", cache)
    assert full_checks == [1] and len(file_stats) == 8


def test_a_feature_file_reached_by_a_link_is_stat_ed_on_every_resume(tmp_path, full_checks):
    specs, cache = corpus(tmp_path)
    target = tmp_path / "elsewhere" / "c.npy"
    target.parent.mkdir()
    codes = specs[0].path.parent / "feats" / "c.npy"
    codes.rename(target)
    codes.symlink_to(target)
    os.utime(codes.parent, (LONG_AGO, LONG_AGO))
    first_start(specs, cache)
    read_manifests(specs, LIMITS, "--train-manifest", cache)
    assert full_checks == [1]
    target.unlink()  # its folder is not the manifest's feature folder
    with pytest.raises(ManifestError, match="codes_path file not found"):
        read_manifests(specs, LIMITS, "--train-manifest", cache)


def test_a_resumed_run_takes_the_cache_of_its_start(tmp_path, demo_assets):
    out = tmp_path / "run"
    common = [*demo_assets, "--max-val-batches", "1", "--val-interval", "0"]
    assert train_here(out, *common, "--max-steps", "1").returncode == 0
    assert cache_path(out, "--train-manifest").is_file() and cache_path(out, "--val-manifest").is_file()
    resumed = train_here(out, *common, "--max-steps", "2", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("manifests: reusing the check of") == 2
