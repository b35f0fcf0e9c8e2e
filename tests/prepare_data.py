"""indextts-prepare in the tests: small synthesised corpora (the demo's audio), the command run in this process or
forked as a process of its own (tests/trainer_process.py), and comparisons of two outputs.

Two outputs are compared as `assert_same_output` does: the manifests, skipped.txt and the summary byte for byte,
and every feature file byte for byte (`exact=True`: two runs with the same batches on this machine) or its arrays
within float rounding with codes and text ids identical (`exact=False`: other batches, as shards or an
out-of-memory halving make them).
"""
from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

import numpy as np

from tests.demo_runs import REPO, environment, subprocess_env
from trainers.tools.prepare.demo import DEMO_CONFIGS, make_audio

STATE = ".prepare"
INTEGER_ARRAYS = ("codes", "text_ids")


def corpus(folder: Path, family: str, per_speaker: int = 4) -> tuple[Path, Path, Path]:
    """(list.jsonl, tokenizer, config) of the demo's audio: 4 speakers at 16-44.1 kHz, one in stereo."""
    listing, tokenizer = make_audio(folder, family, per_speaker)
    return listing, tokenizer, REPO / "checkpoints" / DEMO_CONFIGS[family]


def flags(listing: Path, tokenizer: Path, config: Path, out: Path, *more: str) -> list[str]:
    return ["--input", str(listing), "--out", str(out), "--backend", "demo", "--config", str(config),
            "--tokenizer", str(tokenizer), "--device", "cpu", *more]


def prepare_here(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """indextts-prepare's main() in this process: its status, stdout and stderr."""
    from trainers.tools.prepare.cli import main

    out, err = io.StringIO(), io.StringIO()
    with environment(env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return subprocess.CompletedProcess(list(argv), status, out.getvalue(), err.getvalue())


def prepare_process(*argv: str, env: dict[str, str] | None = None):
    """indextts-prepare as a process of its own (a real SIGKILL ends it), forked from the tests' server."""
    from tests.trainer_process import TrainerProcess

    return TrainerProcess(list(argv), subprocess_env(env=env), command="prepare")


def output_files(out: Path) -> dict[str, bytes]:
    """Every file of an output but its state folder, by path below it."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and STATE not in p.relative_to(out).parts}


def arrays(data: bytes, name: str) -> dict[str, np.ndarray]:
    loaded = np.load(io.BytesIO(data), allow_pickle=False)
    if name.endswith(".npz"):
        return {k: loaded[k] for k in loaded.files}
    return {_role(name): loaded}


def _role(name: str) -> str:
    for role in ("text_ids", "codes", "condition", "emo_vec"):
        if name.endswith(f"_{role}.npy"):
            return role
    return name


def assert_same_output(a: Path, b: Path, exact: bool = True) -> None:
    fa, fb = output_files(a), output_files(b)
    assert fa.keys() == fb.keys(), f"files differ: {sorted(fa.keys() ^ fb.keys())[:6]}"
    for name in fa:
        if not name.startswith("features/"):
            assert fa[name] == fb[name], f"{name} differs"
        elif exact:
            assert fa[name] == fb[name], f"{name} differs"
        else:
            xa, xb = arrays(fa[name], name), arrays(fb[name], name)
            assert xa.keys() == xb.keys(), name
            for key in xa:
                if key in INTEGER_ARRAYS:
                    assert np.array_equal(xa[key], xb[key]), f"{name} {key} differ"
                else:
                    np.testing.assert_allclose(xa[key], xb[key], rtol=1e-4, atol=1e-5, err_msg=f"{name} {key}")
    assert not [n for n in fa if "/." in n or n.startswith(".")], "temporary files left"
