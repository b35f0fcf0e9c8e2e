"""What the trainer prints (issue 28.4): lines a new user reads on a terminal, in a nohup log, after a typo.

Each case runs the trainer's own entry point (main() in this process, or the flag parser the script calls).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
import torch

from tests.demo_runs import FAULT_VARS, long_lines, small_corpus_flags, train_here

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


@pytest.fixture(autouse=True)
def _no_fault_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FAULT_VARS:
        monkeypatch.delenv(name, raising=False)


# --- a mistyped flag ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, unknown, meant", [
    (["--learning_rate", "1e-4"], "--learning_rate 1e-4", "did you mean --learning-rate?"),
    (["--output_dir=runs/x", "--max_steps", "3"], "--output_dir=runs/x --max_steps 3",
     "did you mean --output-dir for --output_dir, --max-steps for --max_steps?"),
    (["--max-step", "3"], "--max-step 3", "did you mean --max-steps?"),
    (["--reconfigure", "--resume", "auto"], "--reconfigure", "did you mean --reconfigure-scheduler?"),
])
def test_a_mistyped_flag_gets_two_lines_naming_the_flag_it_meant(capsys, argv, unknown, meant):
    """`--learning_rate` got 44 lines of usage and no suggestion."""
    from trainers.config.flags import parse_command_line

    with pytest.raises(SystemExit) as stopped:
        parse_command_line(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "usage: train_gpt_v2.py [FLAGS] (--help lists them all)",
        f"train_gpt_v2.py: error: unrecognized arguments: {unknown}; {meant}"]


def test_a_bad_value_gets_two_lines_too(capsys):
    from trainers.config.flags import parse_command_line

    with pytest.raises(SystemExit):
        parse_command_line(["--max-steps", "abc"])
    assert len(capsys.readouterr().err.splitlines()) == 2


# --- a demo run and its resume, as printed ------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """`--demo --max-steps 4`, then a resume to step 6 (its corpus generated in the run directory just before, as
    on a first demo): both logs."""
    out = tmp_path_factory.mktemp("console") / "demo"
    common = ["--demo", "--lr-decay-steps", "6", "--warmup-steps", "2", "--log-interval", "3", "--val-interval", "0"]
    first = train_here(out, *common, "--max-steps", "4")
    assert first.returncode == 0, first.stderr
    resumed = train_here(out, *common, "--max-steps", "6", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    return out, first.stderr, resumed.stderr


def test_every_run_holds_its_info_and_warning_lines_to_120_characters(demo_resumed):
    """train and train_here (tests/demo_runs.py) check the log of every run they make with long_lines, so every run of
    the suite is held to it; here long_lines itself: it finds a long INFO line and a long continued line of a WARNING,
    counts an absolute path by its last name, and leaves ERROR records and tracebacks out. 8 of 19 lines of a normal
    run were longer (one 369), and 48 of 583 of a new user's walk-through (up to 505)."""
    _, first, resumed = demo_resumed
    assert long_lines(first) == long_lines(resumed) == []
    stamp, folders = "2026-01-01 00:00:00", "/a/long/folder" * 20
    fits = f"{stamp} INFO saved checkpoint {folders}/model_step4.pth (step 4) " + "x" * 50
    long_info, long_more = f"{stamp} INFO " + "x" * 96, "  " + "y" * 119
    assert long_lines(f"{fits}\n{long_info}\n{stamp} WARNING short\n{long_more}\n") == [long_info, long_more]
    assert long_lines(f"{stamp} ERROR {long_more}\n{long_more}\nTraceback (most recent call last):\n{long_more}\n") == []


def test_a_demo_resume_says_each_thing_once(demo_resumed):
    """'features was changed within 2 s ...' twice (once per manifest flag), and 'validated manifests cached'
    right after 'reusing the check'."""
    _, _, resumed = demo_resumed
    assert resumed.count("stat'ing the feature files again:") == 1, resumed
    assert resumed.count("manifests: reusing the check of") == 2
    assert "manifest check cached" not in resumed


def test_a_short_demo_is_not_warned_about_a_warmup_nobody_gave(tmp_path, demo_assets):
    """`--demo --max-steps 4` warned about `--warmup-steps 20`, a value the user never gave; and its schedule line was
    157 characters long."""
    done = train_here(tmp_path / "run", *demo_assets, "--max-steps", "4", "--val-interval", "0")
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr and "--warmup-steps 20" not in done.stderr, done.stderr
    assert "learning rate: the demo's 20 warmup steps outlast the 4-step horizon: it stays below 0.003" in done.stderr


def test_the_start_up_summary_says_its_counts_as_they_are(demo_resumed):
    _, first, resumed = demo_resumed
    assert "epoch: 24 steps, random order" in first and "; 151K trained parameters" in first, first
    assert re.search(r"training to step 4\n\S+ \S+ INFO learning rate: warmup 2 steps to 0\.003, cosine to 0\.0003 at "
                     r"step 6\n", first), first


def test_the_periodic_line_says_elapsed_time_and_time_left(demo_resumed):
    """Without a terminal (nohup, the cloud scripts' logs) no line said how long the run had taken or would."""
    _, first, resumed = demo_resumed
    pace = re.compile(r"INFO step (\d)/(\d) grad_norm [\d.]+ samples/s [\d.]+ elapsed \d+:\d\d:\d\d eta (\d+:\d\d:\d\d)$",
                      re.M)
    assert [m.group(1, 2) for m in pace.finditer(first)] == [("3", "4"), ("4", "4")], first
    assert [m.group(1, 2) for m in pace.finditer(resumed)] == [("6", "6")], resumed
    assert all(m.group(3) == "0:00:00" for m in pace.finditer(resumed))  # at the end nothing is left
    assert re.search(r"INFO step 3/4 epoch 0 text_loss [\d.]+ mel_loss [\d.]+ mel_top1 [\d.]+ lr [\d.e+-]+$", first,
                     re.M), first


def test_counts_are_worded_as_they_are(tmp_path, demo_assets):
    """'0.0M trained parameters' for a LoRA run of a small model; 'warmup 1 steps'."""
    done = train_here(tmp_path / "run", *demo_assets, "--lora-rank", "2", "--max-steps", "1", "--val-interval", "0",
                      "--warmup-steps", "1", "--lr-decay-steps", "4")
    assert done.returncode == 0, done.stderr
    # (train_here holds its lines to 120 characters: the LoRA line was 158)
    count = re.search(r"; (\S+) trained parameters", done.stderr).group(1)
    assert re.fullmatch(r"\d+(\.\d+)?K", count), count
    assert "learning rate: warmup 1 step to 0.003, cosine to 0.0003 at step 4" in done.stderr, done.stderr


def test_a_default_warmup_longer_than_the_run_is_said_to_be_the_default(tmp_path):
    done = train_here(tmp_path / "run", *small_corpus_flags(tmp_path / "data"), "--max-steps", "3",
                      "--effective-batch", "8", "--val-interval", "0")
    assert done.returncode == 0, done.stderr
    assert "--warmup-steps 500 (the default) is not shorter than the learning-rate horizon of 3 steps:" in done.stderr
    # (train_here holds its lines to 120 characters: the trimmed config's keys were one line of 236)
    resumed = train_here(tmp_path / "run", *small_corpus_flags(tmp_path / "data2"), "--max-steps", "3",
                         "--resume", "auto")
    assert "--warmup-steps" not in resumed.stderr  # said once, at the start; the resume keeps the schedule


# --- the progress bar ---------------------------------------------------------------------------------

class Terminal(io.StringIO):
    """stderr as a terminal: tqdm draws its bar (frames separated by carriage returns)."""

    def isatty(self) -> bool:
        return True


def test_the_progress_bar_shows_the_last_logged_loss_and_is_not_drawn_after_the_end(tmp_path, demo_assets):
    """The bar's mel_loss stayed at its first value (the last steps' line did not reach it) and the bar was drawn
    again under 'training finished'."""
    from trainers.main import main

    err = Terminal()
    with contextlib.redirect_stderr(err):  # as tests/demo_runs.py train_here, with a terminal
        status = main(["--output-dir", str(tmp_path / "run"), *demo_assets, "--max-steps", "6", "--log-interval", "4",
                       "--val-interval", "0"])
    text = err.getvalue()
    assert status == 0, text
    lines = re.split(r"[\r\n]", text)
    bars = [k for k, line in enumerate(lines) if "step/s" in line or "s/step" in line]
    logged = re.findall(r"INFO step \d/6 epoch \d text_loss [\d.]+ mel_loss ([\d.]+)", text)
    assert len(logged) == 2, text  # steps 1-4, then 5-6 at the end
    last_bar = lines[bars[-1]]
    assert f"mel_loss={float(logged[-1]):.3f}" in last_bar, (last_bar, logged)
    end = next(k for k, line in enumerate(lines) if "validation step 6" in line)
    assert bars[-1] < end, "the bar was drawn again after the training steps"


# --- a busy CPU ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [2, 1])
def test_a_busy_cpu_with_several_threads_is_told_about_omp_num_threads(tmp_path, demo_assets,
                                                                      monkeypatch, threads):
    """The demo took 221 s with the default threads and 34 s with OMP_NUM_THREADS=1 on a loaded CPU; nothing said so.
    The load average is the system's: here it reads as ten times the cores."""
    monkeypatch.setattr(os, "getloadavg", lambda: (10.0 * (os.cpu_count() or 1),) * 3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        done = train_here(tmp_path / "run", *demo_assets, "--max-steps", "1", "--val-interval", "0")
    finally:
        torch.set_num_threads(before)
    assert done.returncode == 0, done.stderr
    told = "WARNING the CPU is busy: load average" in done.stderr and "OMP_NUM_THREADS=1" in done.stderr
    assert told == (threads > 1), done.stderr
    # (train_here holds its lines to 120 characters: its second line was 127)
