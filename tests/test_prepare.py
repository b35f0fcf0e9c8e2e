"""indextts-prepare (trainers/tools/prepare/): batches that equal clips alone, the trainer training on what it
writes, shards, out-of-memory halving, changed inputs, pairs. The pipeline runs in this process on the demo's
synthesised audio with the demo backend's stand-in models (tests/prepare_data.py); its kills are
tests/test_prepare_resume.py, its lines tests/test_prepare_lines.py."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.demo_runs import assert_output_fits
from tests.prepare_data import assert_same_output, corpus, flags, prepare_here
from trainers.data.demo_corpus import _sentence, _train_tokenizer, front_end
from trainers.tools.prepare.backend import BackendRequest, Clip, Features, check_features
from trainers.tools.prepare.demo_backend import DemoBackend
from trainers.tools.prepare.pairs import Utterance, draw_pairs, validation_ids

FAMILIES = ("indextts2", "indextts25")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    root = tmp_path_factory.mktemp("prepare_corpora")
    return {family: corpus(root / family, family) for family in FAMILIES}


def _clips(rng: np.random.Generator, seconds: list[float]) -> list[Clip]:
    return [Clip(f"c{i}", (0.1 * rng.standard_normal(int(16000 * s))).astype(np.float32), 16000, 16000, 1)
            for i, s in enumerate(seconds)]


def assert_batch_equals_alone(encode, clips: list[Clip]) -> None:
    """The issue's check: each clip's features from a batch equal its features alone (codes identical, floats within
    rounding)."""
    batched = encode(clips)
    for clip, got in zip(clips, batched):
        alone = encode([clip])[0]
        assert np.array_equal(got.codes, alone.codes), f"{clip.id}: codes differ from the clip alone"
        for name, array in alone.conditioning.items():
            np.testing.assert_allclose(got.conditioning[name], array, rtol=1e-4, atol=1e-5, err_msg=name)


def padded_rows(backend: DemoBackend, clips: list[Clip]) -> list[Features]:
    """A copy of the community 2.0 preprocessing's batching: the batch padded to its longest clip, and each
    utterance saved as its row of the padded batch (`save_numpy(code_path, semantic_code[idx])`)."""
    longest = max(c.waveform.shape[0] for c in clips)
    padded = [Clip(c.id, np.pad(c.waveform, (0, longest - c.waveform.shape[0])), c.rate, c.source_rate, 1)
              for c in clips]
    return backend.encode(padded)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_equals_each_clip_alone_and_padded_rows_do_not(corpora, family):
    listing, tokenizer, config = corpora[family]
    backend = DemoBackend(BackendRequest(family, config, tokenizer=tokenizer))
    clips = _clips(np.random.default_rng(0), [1.9, 1.2, 0.7, 1.5, 0.6, 2.3])
    assert_batch_equals_alone(backend.encode, clips)
    check_features(backend, clips, backend.encode(clips))
    # The padded rows fail the same check (the shorter clips get the longest one's number of codes, the tail
    # made from padding), and the pipeline refuses them before anything is written.
    with pytest.raises(AssertionError, match="codes differ"):
        assert_batch_equals_alone(lambda cs: padded_rows(backend, cs) if len(cs) > 1 else backend.encode(cs), clips)
    with pytest.raises(RuntimeError, match="not cut to the clip"):
        check_features(backend, clips, padded_rows(backend, clips))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_demo_prepares_audio_and_the_trainer_trains_on_it(tmp_path, family):
    """--demo: synthesised audio at four rates (one speaker in stereo) prepared into the family's manifests, then
    trained by the trainer's own main(): its manifest check, feature readers and two steps accept them."""
    result = prepare_here("--demo", "--family", family, "--out", str(tmp_path), "--demo-steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kept 40 utterances" in result.stdout and "converted: 30 resampled to 16000 Hz" in result.stdout
    assert "10 mixed to mono" in result.stdout
    assert "training finished at step 2" in result.stderr
    assert "stand-in features" in result.stdout and "indextts-train \\\n    --config" in result.stdout
    lines = [json.loads(x) for x in (tmp_path / "prepared" / "train_pairs.jsonl").read_text().splitlines()]
    assert len(lines) == 38 and all(x["id"].split("__")[0] != x["id"].split("__")[1] for x in lines)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_shards_merged_equal_one_process(corpora, tmp_path, family):
    listing, tokenizer, config = corpora[family]
    one = prepare_here(*flags(listing, tokenizer, config, tmp_path / "one", "--batch-size", "3"))
    assert one.returncode == 0, one.stderr
    two = tmp_path / "two"
    first = prepare_here(*flags(listing, tokenizer, config, two, "--shard", "1/2"))
    assert first.returncode == 0 and "shard 1/2 is done" in first.stdout, first.stdout + first.stderr
    assert_output_fits(first.stdout + first.stderr, tmp_path, listing.parent)
    assert not (two / "train_pairs.jsonl").exists()
    second = prepare_here(*flags(listing, tokenizer, config, two, "--shard", "2/2"))
    assert second.returncode == 0 and "kept 16 utterances" in second.stdout, second.stderr
    assert_same_output(tmp_path / "one", two, exact=False)
    summary = json.loads((two / "prepare_summary.json").read_text())
    seconds = [json.loads(line)["duration"] for name in ("train_utterances.jsonl", "val_utterances.jsonl")
               for line in (two / name).read_text().splitlines()]
    assert summary["hours"] == round(sum(seconds) / 3600, 4) and summary["kept"] == 16 and summary["skipped"] == 0
    mine = [json.loads(line)["id"] for p in sorted((two / ".prepare").glob("records-*-of-2.jsonl"))
            for line in p.read_text().splitlines()]
    assert sorted(mine) == sorted(set(mine)) and len(mine) == 16  # each utterance once, by one shard
    again = prepare_here(*flags(listing, tokenizer, config, two, "--merge"))  # --merge alone writes the same
    assert again.returncode == 0, again.stderr
    assert_same_output(tmp_path / "one", two, exact=False)


def test_torchrun_ranks_are_shards_and_shard_numbers_are_checked():
    from trainers.tools.prepare.settings import Shard

    assert Shard.parse(None, {"RANK": "1", "WORLD_SIZE": "4"}) == Shard(2, 4)
    assert Shard.parse("3/4", {"RANK": "0", "WORLD_SIZE": "2"}) == Shard(3, 4)
    for bad in ("0/2", "3/2", "1-2", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            Shard.parse(bad, {})


def test_out_of_memory_halves_the_batch_and_the_output_stays_the_same(corpora, tmp_path):
    listing, tokenizer, config = corpora["indextts2"]
    plain = prepare_here(*flags(listing, tokenizer, config, tmp_path / "plain", "--batch-size", "8"))
    assert plain.returncode == 0, plain.stderr
    halved = prepare_here(*flags(listing, tokenizer, config, tmp_path / "halved", "--batch-size", "8"),
                          env={"INDEXTTS_PREPARE_OOM_ABOVE": "3"})
    assert halved.returncode == 0, halved.stderr
    assert "out of memory with 8 clips, redone in halves; later batches hold half" in halved.stderr
    assert "out of memory with 4 clips, redone in halves" in halved.stderr
    assert_output_fits(halved.stderr + halved.stdout, tmp_path, corpora["indextts2"][0].parent)
    assert_same_output(tmp_path / "plain", tmp_path / "halved", exact=False)
    stopped = prepare_here(*flags(listing, tokenizer, config, tmp_path / "stopped"),
                           env={"INDEXTTS_PREPARE_OOM_ABOVE": "0"})
    assert stopped.returncode == 5 and "out of memory with one clip" in stopped.stderr, stopped.stderr


def test_the_gpu_probe_finds_the_largest_batch_that_fits(corpora):
    """The probe's search (batching.probe_batch_size, as the trainer's micro-batch probe), on a CPU with
    out-of-memory injected above 5 clips."""
    import torch

    from trainers.tools.prepare.batching import Encoder, probe_batch_size

    listing, tokenizer, config = corpora["indextts2"]
    backend = DemoBackend(BackendRequest("indextts2", config, tokenizer=tokenizer))
    encoder = Encoder(backend, torch.device("cpu"), 0, oom_above=5)
    assert probe_batch_size(encoder, 8000, torch.device("cpu")) == 5


def test_a_changed_list_tokenizer_or_model_is_refused_and_update_takes_a_changed_list(corpora, tmp_path):
    listing, tokenizer, config = corpora["indextts2"]
    audio = tmp_path / "audio"
    shutil.copytree(listing.parent, audio)
    changed = audio / "list.jsonl"
    out = tmp_path / "out"
    assert prepare_here(*flags(changed, tokenizer, config, out)).returncode == 0
    before = {p.name: p.stat().st_mtime_ns for p in (out / "features").iterdir()}
    rows = changed.read_text().splitlines()
    edited = json.loads(rows[1])
    edited["text"] = "the red cat ."
    changed.write_text("\n".join([rows[0], json.dumps(edited), *rows[2:]]) + "\n")
    refused = prepare_here(*flags(changed, tokenizer, config, out))
    assert refused.returncode == 2 and "--input changed since" in refused.stderr and "--update" in refused.stderr
    updated = prepare_here(*flags(changed, tokenizer, config, out, "--update"))
    assert updated.returncode == 0, updated.stderr
    assert "(15 done before)" in updated.stderr
    remade = {p.name for p in (out / "features").iterdir() if p.stat().st_mtime_ns != before.get(p.name)}
    assert remade == {f"{edited['id']}_{role}.npy" for role in ("text_ids", "codes", "condition", "emo_vec")}
    fresh = prepare_here(*flags(changed, tokenizer, config, tmp_path / "fresh"))
    assert fresh.returncode == 0
    assert_same_output(tmp_path / "fresh", out)
    other_tokenizer = tmp_path / "other.model"
    other_tokenizer.write_bytes(_train_tokenizer([front_end(_sentence(np.random.default_rng(1))) for _ in range(500)],
                                                 80))
    refused = prepare_here(*flags(changed, other_tokenizer, config, out))
    assert refused.returncode == 2 and "features.tokenizer: saved" in refused.stderr, refused.stderr
    other_config = tmp_path / "other.yaml"
    other_config.write_text(config.read_text().replace("max_mel_tokens: 150", "max_mel_tokens: 140"))
    refused = prepare_here(*flags(changed, tokenizer, other_config, out))
    assert refused.returncode == 2 and "limits.max_mel_tokens: saved 150, now 140" in refused.stderr, refused.stderr
    assert_same_output(tmp_path / "fresh", out)  # nothing was written by the refusals


def test_an_out_folder_holding_files_of_its_own_is_refused(corpora, tmp_path):
    listing, tokenizer, config = corpora["indextts2"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "train_pairs.jsonl").write_text("mine\n")
    refused = prepare_here(*flags(listing, tokenizer, config, out))
    assert refused.returncode == 2 and "already holds train_pairs.jsonl, not written by indextts-prepare" in \
        refused.stderr, refused.stderr
    assert (out / "train_pairs.jsonl").read_text() == "mine\n" and sorted(p.name for p in out.iterdir()) == [
        "train_pairs.jsonl"]


def test_a_changed_audio_file_is_made_again(corpora, tmp_path):
    listing, tokenizer, config = corpora["indextts25"]
    audio = tmp_path / "audio"
    shutil.copytree(listing.parent, audio)
    out = tmp_path / "out"
    assert prepare_here(*flags(audio / "list.jsonl", tokenizer, config, out)).returncode == 0
    wav = audio / "spk0_01.wav"
    wav.write_bytes(wav.read_bytes()[:-3200])  # 0.1 s shorter
    again = prepare_here(*flags(audio / "list.jsonl", tokenizer, config, out))
    assert again.returncode == 0 and "spk0_01.wav changed since its features were made" in again.stderr
    fresh = prepare_here(*flags(audio / "list.jsonl", tokenizer, config, tmp_path / "fresh"))
    assert fresh.returncode == 0
    assert_same_output(tmp_path / "fresh", out, exact=False)


def test_pairs_never_pair_an_utterance_with_itself_and_depend_on_the_seed_alone():
    pool = [Utterance(f"{s}_{i}", s, "en" if i % 3 else "ja") for s in ("a", "b", "c") for i in range(6)]
    pool.append(Utterance("lonely_0", "lonely", "en"))
    pairing = draw_pairs(pool, pool, 2, cross_lingual=False, seed=7)
    assert pairing.pairs and all(t.id != p.id and t.speaker == p.speaker and t.language == p.language
                                 for t, p in pairing.pairs)
    assert pairing.alone == {"lonely": (["lonely_0"], False)}
    shuffled = draw_pairs(pool[::-1], pool[::-1], 2, cross_lingual=False, seed=7)
    assert sorted((t.id, p.id) for t, p in shuffled.pairs) == sorted((t.id, p.id) for t, p in pairing.pairs)
    other_seed = draw_pairs(pool, pool, 2, cross_lingual=False, seed=8)
    assert other_seed.pairs != pairing.pairs
    crossed = draw_pairs(pool, pool, 5, cross_lingual=True, seed=7)
    assert any(t.language != p.language for t, p in crossed.pairs)
    assert all(t.id != p.id for t, p in crossed.pairs)
    held = validation_ids([u.id for u in pool], 0.1, 7)
    assert len(held) == 2 and held == validation_ids([u.id for u in pool[::-1]], 0.1, 7)


def test_a_speaker_with_one_utterance_is_reported(corpora, tmp_path):
    listing, tokenizer, config = corpora["indextts2"]
    rows = listing.read_text().splitlines()
    lone = json.loads(rows[0])
    lone.update(id="solo", speaker="solo")
    with_solo = tmp_path / "list.jsonl"
    with_solo.write_text("\n".join([*rows, json.dumps(lone)]) + "\n")
    for name in [p.name for p in listing.parent.glob("*.wav")]:
        (tmp_path / name).symlink_to(listing.parent / name)
    result = prepare_here(*flags(with_solo, tokenizer, config, tmp_path / "out", "--val-fraction", "0"))
    assert result.returncode == 0, result.stderr
    assert ("speaker 'solo': 1 training utterance(s) in no pair, no prompt (solo): none other among the "
            "training ones") in result.stdout
    summary = json.loads((tmp_path / "out" / "prepare_summary.json").read_text())
    assert summary["manifests"] == {"train_pairs.jsonl": 16, "train_utterances.jsonl": 17}


def test_the_progress_bar_shows_utterances_per_second_and_the_time_left(monkeypatch):
    import io
    import sys

    from trainers.tools.prepare import report

    terminal = io.StringIO()
    terminal.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = report.Progress(10)
    bar.advance(3)
    bar.advance(3)
    bar.close()
    drawn = terminal.getvalue().split("\r")[-1]
    assert "6/10" in drawn and "utt/s" in drawn and "<00:" in drawn, drawn  # [elapsed<left, rate]
    piped = io.StringIO()  # no terminal: a line every PROGRESS_SECONDS instead
    monkeypatch.setattr(sys, "stderr", piped)
    monkeypatch.setattr(report, "PROGRESS_SECONDS", 0.0)
    bar = report.Progress(10)
    bar.advance(4)
    bar.close()
    assert re.search(r"^prepared 4/10 utterances, [\d.]+ utt/s, about 0:\d\d:\d\d left$", piped.getvalue(), re.M)


def test_settings_out_of_range_are_refused_naming_the_flag(capsys):
    """indextts-prepare's settings are declared as the trainer's (trainers/config/declare.py): ranges and
    misspelt flags are refused before anything is read (exit 2)."""
    from trainers.tools.prepare.cli import main
    from trainers.tools.prepare.settings import PrepareSettings, parse_settings

    assert main(["--val-fraction", "0.9", "--input", "x", "--out", "y"]) == 2
    assert "--val-fraction must be a finite number >= 0 and <= 0.5, got 0.9" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        parse_settings(["--min-secnds", "1"])
    assert exited.value.code == 2 and "did you mean --min-seconds?" in capsys.readouterr().err
    assert set(PrepareSettings().fingerprinted()) == {"family", "backend", "speaker", "language", "min_seconds",
                                                      "silence_db"}
