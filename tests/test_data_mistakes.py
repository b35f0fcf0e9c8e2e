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
