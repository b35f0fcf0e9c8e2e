"""Data mistakes a new user makes (issue 28.3): each is refused at start-up (exit 2, naming the file and line,
nothing written) or said with numbers, instead of training silently or stopping later.

Every case runs the trainer's own main() in this process on the small corpus of tests/fixtures/v1_run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.demo_runs import small_corpus_flags, train_here
from tests.test_validation import assert_refused, run_main, snapshot


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    """The small corpus (24 training, 8 validation samples) copied to tmp_path/data, and its flags."""
    folder = tmp_path / "data"
    return folder, small_corpus_flags(folder)


def manifest_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_lines(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


# --- --output-dir naming a file -----------------------------------------------------------------------

@pytest.mark.parametrize("demo", [False, True])
def test_an_output_dir_that_is_a_file_is_named_as_a_file(tmp_path, corpus, demo):
    """Was "File exists; check that it is writable and the disk has space" (and with --demo a traceback
    while the demo corpus was written into it)."""
    _, flags = corpus
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    args = ["--demo", "--max-steps", "1"] if demo else [*flags, "--max-steps", "1"]
    for out, named in ((notes, f"--output-dir {notes} is a file, not a directory"),
                       (notes / "run", f"--output-dir {notes / 'run'} cannot be made: {notes} is a file")):
        status, err = run_main(out, *args)
        assert status == 2 and "Traceback" not in err, err
        assert named in err and "pass a directory" in err and "File exists" not in err, err
        assert notes.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]  # nothing written beside it


# --- a feature file too short to be a .npy ------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 40])
def test_an_empty_or_cut_off_feature_file_is_refused_at_start_up_with_its_line(tmp_path, corpus, size):
    """A 0-byte (or header-truncated) codes file passed the start-up check and stopped the run at the step that
    met it; the stat the check already takes shows it."""
    folder, flags = corpus
    manifest = folder / "train.jsonl"
    line = manifest_lines(manifest)[4]
    codes = folder / line["target_codes_path"]
    codes.write_bytes(codes.read_bytes()[:size])
    err = assert_refused(tmp_path / "run", [*flags, "--max-steps", "2"], f"{manifest}:5: target_codes_path {codes} "
                         f"is empty or cut off ({size} bytes; a .npy file is at least 64)", "extract this feature again")
    assert "relative paths are resolved" not in err  # the path is right: the file is not
    assert not (tmp_path / "run").exists()


# --- validation that is not held out -----------------------------------------------------------------

def test_a_val_manifest_that_is_a_train_manifest_is_refused(tmp_path, corpus):
    """Trained and validated on the same file, without a word."""
    folder, flags = corpus
    train = folder / "train.jsonl"
    link = folder / "also_train.jsonl"  # another name for the same file
    link.hardlink_to(train)
    for val in (str(train), f"{train}::en", str(link)):
        args = [*flags[:2], "--val-manifest", val, *flags[4:], "--max-steps", "1"]
        assert_refused(tmp_path / "run", args, f"--val-manifest {val.split('::')[0]} is also a --train-manifest",
                       "leave --val-manifest out")
    assert not (tmp_path / "run").exists()


def test_validation_samples_that_are_training_samples_are_counted_with_an_example(tmp_path, corpus):
    """By id, or by the target's codes file (the same utterance paired with another prompt); warned, trained."""
    folder, flags = corpus
    train, val = folder / "train.jsonl", folder / "val.jsonl"
    rows = manifest_lines(val)
    same_id, other = manifest_lines(train)[6], manifest_lines(train)[9]
    rows[2] = same_id  # val.jsonl:3 is train.jsonl:7
    rows[5] = {**other, "id": "renamed_but_the_same_target"}  # val.jsonl:6 trains as train.jsonl:10
    write_lines(val, rows)
    result = train_here(tmp_path / "run", *flags, "--max-steps", "1", "--effective-batch", "4")
    assert result.returncode == 0, result.stderr
    assert "validation is not held out: 2 of 8 validation samples are training samples too" in result.stderr
    assert "(the same id or codes file): their losses measure memorising" in result.stderr
    assert f"e.g. {val}:3 is {train}:7 (id {same_id['id']!r})" in result.stderr


def test_held_out_validation_says_nothing(tmp_path, corpus):
    _, flags = corpus
    result = train_here(tmp_path / "run", *flags, "--max-steps", "1", "--effective-batch", "4")
    assert result.returncode == 0 and "not held out" not in result.stderr, result.stderr


# --- text ids another tokenizer made -----------------------------------------------------------------

def other_tokenizer(path: Path, size: int) -> Path:
    """A SentencePiece model of `size` pieces, trained as the demo's is but on its words spelt backwards."""
    import numpy as np

    from trainers.data.demo_corpus import _sentence, _train_tokenizer, front_end

    rng = np.random.default_rng(5)
    sentences = [" ".join(w[::-1] for w in front_end(_sentence(rng)).split()) for _ in range(2000)]
    path.write_bytes(_train_tokenizer(sentences, size))
    return path


def test_another_tokenizer_of_the_same_size_is_refused_on_a_fresh_start(tmp_path, corpus):
    """It trained silently on ids the tokenizer never produces (only a resume refused the change)."""
    import sentencepiece as spm

    folder, flags = corpus
    given = Path(flags[flags.index("--tokenizer") + 1])
    size = spm.SentencePieceProcessor(model_file=str(given)).get_piece_size()
    wrong = other_tokenizer(tmp_path / "other.model", size)
    args = [*flags, "--max-steps", "1", "--effective-batch", "4"]
    args[args.index(str(given))] = str(wrong)
    line = manifest_lines(folder / "train.jsonl")[0]
    err = assert_refused(tmp_path / "run", args, f"--tokenizer {wrong} does not make the manifests' text ids (0 of 8 "
                         "lines checked match", f"{folder / 'train.jsonl'}:1: the text {line['target_text']!r} is "
                         "stored as ids [72, 72, 142,", "retokenize_manifest.py", "--no-tokenizer-check")
    assert float(err.split("mean similarity ")[1][:4]) < 0.3  # the ids differ throughout, not here and there
    # The escape for a preprocessing with a front end of its own trains on (and the right tokenizer, every test).
    assert train_here(tmp_path / "run", *args, "--no-tokenizer-check").returncode == 0


# --- an effective batch larger than the data ----------------------------------------------------------

def test_an_effective_batch_larger_than_the_data_is_the_data_size_and_trains_the_same(tmp_path, corpus):
    """`--effective-batch 100` on 24 samples logged "effective batch 100 = 16 x 7" while every step held 24.
    The run takes 24, says so with both numbers, trains exactly as --effective-batch 24 does (weights, optimizer,
    samples of every step), and a resume given 100 again continues it bit for bit."""
    import torch

    from tests.demo_runs import assert_same_training

    _, flags = corpus
    common = [*flags, "--warmup-steps", "1", "--lr-decay-steps", "4", "--val-interval", "2", "--log-interval", "1",
              "--log-sample-ids"]
    torch.manual_seed(0)  # without --base-checkpoint the model starts from torch's global generator
    first = train_here(tmp_path / "big", *common, "--effective-batch", "100", "--max-steps", "2")
    assert first.returncode == 0, first.stderr
    assert "--effective-batch 100 is more than the 24 training samples (the training manifests)" in first.stderr
    assert "training with effective batch 24: every step holds all 24, one step per epoch" in first.stderr
    assert "batch: effective batch 24 = micro-batch 16 x accumulation 2" in first.stderr, first.stderr
    assert "effective batch 100" not in first.stderr and "16 x 7" not in first.stderr
    resumed = train_here(tmp_path / "big", *common, "--effective-batch", "100", "--max-steps", "4", "--resume", "auto")
    assert resumed.returncode == 0 and "changes the result" not in resumed.stderr, resumed.stderr
    torch.manual_seed(0)
    exact = train_here(tmp_path / "exact", *common, "--effective-batch", "24", "--max-steps", "4")
    assert exact.returncode == 0 and "more than the" not in exact.stderr, exact.stderr
    assert_same_training(tmp_path / "big", tmp_path / "exact", 4)
    steps = (tmp_path / "big" / "sample_ids.tsv").read_text().splitlines()
    assert [len(line.split("\t")[2].split(",")) for line in steps] == [24] * 4


# --- a resume after the training manifest changed -----------------------------------------------------

def test_a_resume_after_the_manifest_changed_says_what_changed_and_what_allowing_it_means(tmp_path, corpus):
    """Was two sha256 values and --allow-config-change as the only way on, without saying that the manifest lost
    a line, nor that continuing makes the run differ from an uninterrupted one."""
    folder, flags = corpus
    manifest = folder / "train.jsonl"
    run = tmp_path / "run"
    args = [*flags, "--effective-batch", "8", "--warmup-steps", "1", "--lr-decay-steps", "6", "--val-interval", "0"]
    assert train_here(run, *args, "--max-steps", "4").returncode == 0
    rows = manifest_lines(manifest)
    dropped = rows.pop(4)  # train.jsonl:5
    rows[1] = {**rows[1], "target_codes_path": rows[2]["target_codes_path"]}  # train.jsonl:2 another codes file
    rows.append({**rows[9], "id": "an_added_line"})
    write_lines(manifest, rows)
    before = {k: v for k, v in snapshot(run).items() if k != ".trainer.lock"}  # the lock's time: trainers/run/lock.py
    status, err = run_main(run, *args, "--max-steps", "6", "--resume", "auto")
    assert status == 2 and "Traceback" not in err, err
    assert {k: v for k, v in snapshot(run).items() if k != ".trainer.lock"} == before
    for text in ("data (the training manifests' sha256): saved ",
                 "the training manifests changed since the checkpoint: 24 samples then, 24 now",
                 f"1 line removed (line numbers as they were), e.g.\n      {manifest}:5 (id {dropped['id']!r})",
                 f"1 line added, e.g.\n      {manifest}:24 (id 'an_added_line')",
                 f"1 line changed (same id, other lengths or codes file), e.g.\n      {manifest}:2 (id {rows[1]['id']!r})",
                 "continuing (--allow-config-change) trains from step 4 on today's samples:",
                 "the rest of epoch 1 is drawn anew over them",
                 "every later epoch differs: the run equals no uninterrupted run on either manifest"):
        assert text in err, text
    saved, now = err.split("sha256): saved ")[1].split(" (changes the result)")[0].split(", now ")
    assert len(saved) == len(now) == 15 and saved.endswith("...") and saved != now  # 12 digits each, not 64
    allowed = train_here(run, *args, "--max-steps", "6", "--resume", "auto", "--allow-config-change")
    assert allowed.returncode == 0, allowed.stderr
    assert "WARNING 1 line removed (line numbers as they were), e.g." in allowed.stderr
    assert f"WARNING {manifest}:5 (id " in allowed.stderr and "WARNING and every later epoch differs" in allowed.stderr
