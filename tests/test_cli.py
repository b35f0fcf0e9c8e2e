"""User errors stop before any work, with a message that names the file, line or flag."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.slowness import scaled
from trainers.main import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INDEXTTS_TRAIN_KILL_AT", raising=False)


def _tiny_data(root: Path, lines: list[dict]) -> Path:
    feats = root / "f"
    feats.mkdir(parents=True)
    np.save(feats / "t.npy", np.array([5, 6, 7], dtype=np.int32))
    np.save(feats / "c.npy", np.arange(10, dtype=np.int32))
    np.save(feats / "cond.npy", np.zeros((32, 64), dtype=np.float32))
    np.save(feats / "emo.npy", np.zeros(64, dtype=np.float32))
    manifest = root / "train.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


def _line(**overrides: object) -> dict:
    line = {"id": "u1", "text_ids_path": "f/t.npy", "text_len": 3, "codes_path": "f/c.npy", "code_len": 10,
            "condition_path": "f/cond.npy", "emo_vec_path": "f/emo.npy"}
    line.update(overrides)
    return {k: v for k, v in line.items() if v is not None}


def _run(tmp_path: Path, manifest: Path, *extra: str) -> int:
    tokenizer = tmp_path / "demo" / "demo_data" / "bpe.model"
    if not tokenizer.exists():  # generate the demo tokenizer once through a tiny demo run
        assert main(["--demo", "--output-dir", str(tmp_path / "demo"), "--max-steps", "1"]) == 0
    return main(["--train-manifest", str(manifest), "--tokenizer", str(tokenizer),
                 "--config", str(REPO / "checkpoints" / "demo.yaml"), "--output-dir", str(tmp_path / "run"),
                 "--num-workers", "0", *extra])


@pytest.mark.parametrize("bad, message", [
    (_line(code_len=None), "missing"),
    (_line(codes_path="f/nope.npy"), "nope.npy"),
    (_line(code_len=500), "max_mel_tokens"),
])
def test_bad_manifest_line_is_reported_with_file_and_line(tmp_path, capsys, bad, message):
    manifest = _tiny_data(tmp_path / "data", [_line(), _line(id="u2"), bad])
    assert _run(tmp_path, manifest) == 2
    err = capsys.readouterr().err
    assert f"{manifest}:3:" in err and message in err
    assert not (tmp_path / "run").exists()  # nothing was trained or written


def test_unknown_flag_value_names_the_flag(tmp_path, capsys):
    manifest = _tiny_data(tmp_path / "data", [_line()])
    assert _run(tmp_path, manifest, "--batch-size", "-1") == 2
    assert "--batch-size" in capsys.readouterr().err


def test_missing_base_checkpoint_names_the_flag(tmp_path, capsys):
    manifest = _tiny_data(tmp_path / "data", [_line()])
    assert _run(tmp_path, manifest, "--base-checkpoint", str(tmp_path / "gpt.pth")) == 2
    assert "--base-checkpoint" in capsys.readouterr().err


def test_resume_path_that_does_not_exist(tmp_path, capsys):
    assert main(["--resume", str(tmp_path / "nope.pth")]) == 2
    assert "--resume" in capsys.readouterr().err


def test_sample_that_breaks_at_load_time_stops_with_file_and_line(tmp_path, capsys):
    # The manifest says 9 codes, the file holds 10: only loading the array can tell.
    manifest = _tiny_data(tmp_path / "data", [_line(), _line(id="u2", code_len=9)])
    assert _run(tmp_path, manifest, "--batch-size", "1", "--grad-accumulation", "2") == 2
    err = capsys.readouterr().err
    assert f"{manifest}:2:" in err and "c.npy" in err and "--resume auto" in err


def test_failed_checkpoint_write_stops_with_status_4(tmp_path, capsys, monkeypatch):
    from trainers.checkpoint import step_files as checkpoint_io

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_io.CheckpointManager, "save", disk_full)
    assert main(["--demo", "--output-dir", str(tmp_path / "run"), "--max-steps", "2"]) == 4
    err = capsys.readouterr().err
    assert "No space left on device" in err and "--resume auto" in err


SCRIPT = REPO / "trainers" / "train_gpt_v2.py"
# Runs the entry point as `python trainers/train_gpt_v2.py ARGS` would, then says whether torch got imported.
_AS_SCRIPT = ("import runpy, sys\nsys.argv = [sys.argv[1], *sys.argv[2:]]\ntry:\n    runpy.run_path(sys.argv[0], "
              "run_name='__main__')\nexcept SystemExit as e:\n    print('status', e.code, 'torch imported', "
              "'torch' in sys.modules)\n")


@pytest.mark.parametrize("args, status", [(["--help"], 0), (["--batch-size", "x"], 2), (["--no-such-flag"], 2)])
def test_help_and_usage_errors_answer_before_torch_is_imported(args, status):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _AS_SCRIPT, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=scaled(60))
    assert done.stdout.strip().endswith(f"status {status} torch imported False"), (done.stdout, done.stderr)
    if status:
        assert "usage: train_gpt_v2.py" in done.stderr and "Traceback" not in done.stderr


# The entry point run as a script, with a stop signal sent to the process just as `import torch` begins.
_SIGNAL_IN_IMPORT = (
    "import importlib.abc, os, runpy, signal, sys\n"
    "SIGNUM = int(sys.argv[1])\n"
    "class SignalOnTorch(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path, target=None):\n"
    "        if name == 'torch':\n"
    "            sys.meta_path.remove(self)\n"
    "            os.kill(os.getpid(), SIGNUM)\n"
    "        return None\n"
    "sys.meta_path.insert(0, SignalOnTorch())\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@pytest.mark.parametrize("signum", [2, 15])  # SIGINT, SIGTERM
def test_a_stop_signal_during_the_imports_ends_the_start_up_quietly(tmp_path, signum):
    """A handler that raises in the middle of `import torch` can leave half-imported modules, crash in
    C++ or be swallowed by the import machinery (seen at random instants in the reliability campaign).
    The signal is only noted there, and start-up stops at its first safe point: 128 + N, a clear
    line, no traceback, nothing created."""
    import subprocess
    import sys

    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", _SIGNAL_IN_IMPORT, str(signum), str(SCRIPT), "--demo",
                           "--output-dir", str(out)], cwd=REPO, capture_output=True, text=True, timeout=scaled(120),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    name = {2: "SIGINT", 15: "SIGTERM"}[signum]
    assert done.returncode == 128 + signum, done.stderr[-3000:]
    assert f"stopped by {name} during start-up: nothing was trained" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_stop_signals_after_the_exit_status_is_decided_change_nothing(demo_assets, tmp_path, signal_name):
    """Two stop signals as the finished trainer shuts down (its atexit handlers: the fault point `exit`): the
    status stays 0. A Python handler would take the second as "stop at once" (or, once the interpreter has
    reset its handlers, die of it: -2 after a saved Ctrl-C stop); the trainer ignores them from the moment it
    exits."""
    from tests.demo_runs import train

    point = f"{signal_name}@exit"
    done = train(tmp_path / "run", *demo_assets, "--max-steps", "1", "--val-interval", "0",
                 kill_at=f"{point},{point}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training finished at step 1" in done.stderr
