"""Upstream IndexTTS's own GPT code for the parity tests, from two pinned wheels on PyPI.

No package on PyPI installs upstream's `UnifiedVoice` alone: the repackagings pin torch 2.8 or pull in
librosa, torchaudio, nemo-text-processing and more. So each wheel is fetched here with pip itself
(`pip download --no-deps`, pinned version, checked against its sha256), and only its model modules are
unpacked into .upstream/ of the checkout (git-ignored, reused by later runs) and imported from there. Their
one import-time dependency beyond the test extra (torchaudio in 2.0's utils/common.py, tiktoken in 2.5's
utils/tokenizer.py; neither is called by the model) is stood in for while they import, and no `indextts*`
module stays in sys.modules afterwards (tests/test_render_samples.py puts fakes there).

- UPSTREAM_V2: indextts2-cli 1.0.2. Its indextts/gpt/ (all 13 files: model_v2.py, the conformer and perceiver
  modules, the vendored transformers GPT-2 and generation code) and utils/arch_util.py, typical_sampling.py,
  xtransformers.py are byte-identical to index-tts v2.0.0. In conformer mode v2.5.0's model_v2.py computes
  what v2.0.0's does (v2.5.0 only adds the campplus branches and builds speed_emb earlier). Needs
  transformers 4.52.1, upstream's own pin (the vendored code imports that release's internals).
- UPSTREAM_V25: indextts25-inference 0.2.0, the only wheel with campplus code; a rewrite of upstream's
  model_v2.py, not a copy (docs/architecture.md, "Parity with upstream", lists what differs). The helpers
  in tests/upstream_campplus.py use its campplus pieces and upstream v2.0.0's code for everything shared.

Where the wheel cannot be fetched (no index reachable): the test fails under CI (CI set), else it is
skipped saying so. pip's own settings apply, so `PIP_FIND_LINKS=<folder with the wheels>` works offline.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".upstream"


@dataclass(frozen=True)
class Wheel:
    """A pinned wheel and the part of it the tests import."""

    name: str
    version: str
    sha256: str
    top: str  # its top-level package
    members: tuple[str, ...]  # unpacked: a path, or a folder ending in "/"
    stubs: tuple[str, ...]  # modules imported at module level but never called by the model code
    part: str = ""  # a second unpacking of the same wheel (other members) goes to a folder of its own
    suffix: str = ""  # only members ending so (e.g. ".py")

    @property
    def folder(self) -> Path:
        return CACHE / f"{self.name}-{self.version}{'-' + self.part if self.part else ''}"


UPSTREAM_V2 = Wheel(
    "indextts2-cli", "1.0.2", "7316452e78856a953249cd201efe66044939ef773ac09cf8aa7c83e2c2813e4d", "indextts",
    ("indextts/__init__.py", "indextts/gpt/", "indextts/utils/__init__.py", "indextts/utils/arch_util.py",
     "indextts/utils/common.py", "indextts/utils/typical_sampling.py", "indextts/utils/xtransformers.py"),
    ("torchaudio",))
UPSTREAM_V25 = Wheel(
    "indextts25-inference", "0.2.0", "2230be034884c14ce63f746970d15bbfe84fc45e22d4a847e72dcf7c3de77a3c",
    "indextts25",
    # Not indextts25/__init__.py: it imports the whole pipeline (librosa, ...). The package is made bare.
    ("indextts25/gpt/", "indextts25/utils/__init__.py", "indextts25/utils/common.py",
     "indextts25/utils/tokenizer.py", "indextts25/utils/typical_sampling.py"),
    ("tiktoken",))
# Whole packages (their Python files), for indextts-prepare's upstream backends (tests/upstream_features.py): the
# feature models, text front ends and inference modules, imported from a folder as a user's checkout is.
UPSTREAM_V2_CODE = Wheel(UPSTREAM_V2.name, UPSTREAM_V2.version, UPSTREAM_V2.sha256, "indextts", ("indextts/",), (),
                         part="code", suffix=".py")
UPSTREAM_V25_CODE = Wheel(UPSTREAM_V25.name, UPSTREAM_V25.version, UPSTREAM_V25.sha256, "indextts25",
                          ("indextts25/",), (), part="code", suffix=".py")
# torchaudio's own Python code (its Resample and Kaldi fbank, what IndexTTS inference calls): no torchaudio wheel
# exists for this torch, but those functions are plain torch, so they run from the 2.8.0 wheel's source files with
# its compiled extension left out. The wheel is CPython 3.11 / x86-64 Linux (the CI machine's): elsewhere pip
# finds another file and the sha256 check refuses it.
TORCHAUDIO = Wheel("torchaudio", "2.8.0", "776c0b4ba84b9e3ddf6304b9c47cd63549d7896a6f3d5184ece074cc3d76ed6b",
                   "torchaudio", ("torchaudio/",), (), part="python", suffix=".py")


class Unavailable(Exception):
    """The wheel could not be fetched or is not the pinned one."""


def unavailable(message: str) -> None:
    """CI must run the upstream checks: there a missing wheel fails the test; elsewhere it skips it."""
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One process at a time (the suite's xdist workers start together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def download(wheel: Wheel, into: Path) -> Path:
    """The pinned wheel, through pip (so its index and proxy settings apply), checked against its sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(into), f"{wheel.name}=={wheel.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    found = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(found) != 1:
        tail = " ".join((done.stderr or done.stdout).split())[-400:]
        raise Unavailable(f"pip could not fetch {wheel.name}=={wheel.version} (upstream's model code for the parity "
                          f"tests; needs PyPI or PIP_FIND_LINKS): {tail}")
    got = sha256(found[0])
    if got != wheel.sha256:
        raise Unavailable(f"{found[0].name} has sha256 {got}, not the pinned {wheel.sha256}: not the wheel whose "
                          "model code was compared with upstream's; refusing to import it")
    return found[0]


def unpacked(wheel: Wheel) -> Path:
    """The folder holding the wheel's model modules, fetched and unpacked on first use."""
    if (wheel.folder / "COMPLETE").is_file():
        return wheel.folder
    with locked(CACHE / f"{wheel.name}.lock"):
        if (wheel.folder / "COMPLETE").is_file():
            return wheel.folder
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            whl = download(wheel, Path(tmp) / "download")
            target = Path(tmp) / "unpacked"
            with zipfile.ZipFile(whl) as z:
                names = [n for n in z.namelist() if n.endswith(wheel.suffix)
                         and any(n == m or (m.endswith("/") and n.startswith(m)) for m in wheel.members)]
                z.extractall(target, names)
            (target / "COMPLETE").write_text(f"{wheel.name}=={wheel.version} sha256={wheel.sha256}\n")
            shutil.rmtree(wheel.folder, ignore_errors=True)
            os.replace(target, wheel.folder)
    return wheel.folder


def _stub(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers probes find_spec() of some
    return module


def fetched(wheel: Wheel) -> Path:
    """The unpacked folder of `wheel`; skips or fails the calling test (see `unavailable`) when it cannot be had."""
    root = _fetched(wheel)
    if isinstance(root, str):
        unavailable(root)
    return root


@functools.cache
def _fetched(wheel: Wheel) -> Path | str:
    """The unpacked folder, or why there is none (kept: a second try offline would wait on pip again)."""
    try:
        return unpacked(wheel)
    except (Unavailable, OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)


@functools.cache
def import_module(wheel: Wheel, module: str) -> types.ModuleType:
    """`<top>.<module>` of the wheel (e.g. UPSTREAM_V2, "gpt.model_v2"), imported once per process; skips or
    fails the calling test (see `unavailable`) when the wheel cannot be had."""
    root = fetched(wheel)
    importlib.import_module("transformers")  # first: it looks for torchaudio at import, which no stub may answer

    def ours(name: str) -> bool:
        return name == wheel.top or name.startswith(wheel.top + ".") or name in wheel.stubs

    saved = {n: m for n, m in sys.modules.items() if ours(n)}
    for n in saved:
        del sys.modules[n]
    package = types.ModuleType(wheel.top)
    package.__path__ = [str(root / wheel.top)]  # bare: the wheel's own __init__ may import far more
    package.__spec__ = importlib.machinery.ModuleSpec(wheel.top, None, is_package=True)
    sys.modules[wheel.top] = package
    for name in wheel.stubs:
        sys.modules[name] = _stub(name)
    try:
        return importlib.import_module(f"{wheel.top}.{module}")
    finally:
        for n in [n for n in sys.modules if ours(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
