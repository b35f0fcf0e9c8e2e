"""The seam between indextts-prepare's pipeline and a feature backend: what a backend is given and returns.

The pipeline (trainers/tools/prepare/) reads the utterance list, checks every line, decodes nothing itself
but through the backend's `audio`, batches by length, writes every file atomically, resumes, shards and writes
the manifests. A backend computes one model family's features from text and audio, in memory: no file is
written by it. Two kinds exist: the demo backend (demo_backend.py: tiny stand-in models made here, for
`--demo` and the tests) and the upstream backends (upstream's own feature code and the official checkpoints).

A backend is made by a factory `make_backend(request: BackendRequest) -> FeatureBackend`, named in
BACKENDS below as "module:function" and imported only when chosen (an upstream backend imports upstream's
code, which the demo never needs).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from trainers.errors import UserError

SPEECH_RATE = 16000  # both families' feature models (w2v-BERT 2.0, CAMPPlus fbank) take 16 kHz audio
CONDITIONING_SECONDS = 15.0  # inference conditions on at most the first 15 s of a reference clip


@dataclass(frozen=True)
class Clip:
    """One utterance's audio, as a backend's `audio` returns it and its `encode` takes it.

    `waveform` is the whole utterance, mono float32 in [-1, 1] at `rate` (the backend's `audio_rate`): its
    codes are made from all of it. The conditioning (inference's first 15 s) is the backend's to cut.
    `source_rate` / `source_channels` are the file's, for the report. `extras` carries what a backend wants
    beside the waveform (e.g. the clip as inference's other resampling path makes it); the pipeline passes it
    through untouched."""

    id: str
    waveform: np.ndarray  # [N] float32
    rate: int
    source_rate: int
    source_channels: int
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.waveform.shape[0] / self.rate


@dataclass(frozen=True)
class TextIds:
    """A text as the family stores it: `ids` int32 exactly as written to the text ids file (IndexTTS2:
    SentencePiece ids after its front end, no start/stop; IndexTTS-2.5: tiktoken ids of "<|lang|> " + text
    after its front end, ids 0 and 1 dropped as its model drops them). `unknown`: how many of them stand for
    text the tokenizer does not know (SentencePiece's <unk>; a line with any is skipped). `normalised`: the
    string that was tokenised, for messages."""

    ids: np.ndarray
    unknown: int = 0
    normalised: str = ""


@dataclass(frozen=True)
class Features:
    """One utterance's features, its own and no other's: `codes` int [code_length(len(waveform))] (never a
    padded row), and the conditioning computed from this clip as inference computes it for a reference clip,
    float32 by name: IndexTTS2 `condition` [32, D] and `emo_vec` [D]; IndexTTS-2.5 `spk_emb` [192] (raw CAMPPlus,
    not projected) and `emo_vec` [D]."""

    codes: np.ndarray
    conditioning: dict[str, np.ndarray]


class AudioProblem(Exception):
    """A clip a backend cannot use, said for its line: `what` is wrong and `todo` what to do about it
    (e.g. AudioProblem("cannot be decoded as MP3 (no decoder)", "install soundfile, or convert it to WAV")).
    `reason` is the summary's key ("unreadable" unless said)."""

    def __init__(self, what: str, todo: str, reason: str = "unreadable") -> None:
        super().__init__(f"{what}; {todo}")
        self.what, self.todo, self.reason = what, todo, reason


@runtime_checkable
class FeatureBackend(Protocol):
    """What the pipeline calls. torch in, numpy out; no file writes.

    family      the trainers.families name: "indextts2" or "indextts25"
    audio_rate  the rate `audio` returns clips at (SPEECH_RATE for both families)
    code_rate   codes per second, nominal (50 for IndexTTS2, 25 for IndexTTS-2.5), for messages and the summary
    """

    family: str
    audio_rate: int
    code_rate: int

    def fingerprint(self) -> dict[str, str]:
        """The identity of everything the features depend on: weights and config files (sha256), the tokenizer
        file, the text normaliser and its version, the code that computes them (package versions). Saved with
        the output: a later run with any value changed is refused (docs/data_preparation.md)."""
        ...

    def text(self, text: str, language: str | None) -> TextIds:
        """The text's ids as the family's inference makes them (normalised, tokenised)."""
        ...

    def audio(self, path: Path, clip_id: str) -> Clip:
        """The file decoded as the family's inference loads audio, at `audio_rate`, mono (channels averaged as
        librosa does). Raises AudioProblem for a file it cannot use; the pipeline then checks the clip (empty,
        NaN, silence, length). A backend may delegate to the pipeline's AudioLoader (audio.py)."""
        ...

    def code_length(self, samples: int) -> int:
        """Exactly how many codes `encode` returns for a clip of `samples` samples at `audio_rate` (0: too short
        to make any): the pipeline checks lengths and forms batches before encoding."""
        ...

    def encode(self, clips: Sequence[Clip]) -> list[Features]:
        """One batch (the pipeline groups similar lengths; any size from 1). Each Features holds that clip's own
        arrays, cut to its own frames, and equals encode([clip]) alone: codes identical, floats within rounding
        (a model whose output depends on padding must crop each row before it, or run rows alone). Raises
        torch.OutOfMemoryError unchanged (the pipeline halves the batch and goes on)."""
        ...


@dataclass(frozen=True)
class BackendRequest:
    """What a factory is given: the family, the model files and where the computation runs.

    config        the config.yaml (the official full one for an upstream backend; its gpt section sets the
                  limits the pipeline checks lines against)
    model_dir     the official checkpoints folder (None for the demo)
    indextts_dir  a checkout of upstream's code (None: the installed package; unused by the demo)
    tokenizer     a tokenizer file overriding the one of model_dir (None: the model_dir's / the config's)
    device        a torch device name: "cpu", "cuda", "cuda:1"
    seed          the demo's stand-in models are drawn from it; upstream backends ignore it
    """

    family: str
    config: Path
    model_dir: Path | None = None
    indextts_dir: Path | None = None
    tokenizer: Path | None = None
    device: str = "cpu"
    seed: int = 0


# --backend NAME -> "module:function" of its factory, imported only when chosen.
BACKENDS: dict[str, str] = {
    "demo": "trainers.tools.prepare.demo_backend:make_backend",
    "upstream": "trainers.tools.prepare.upstream:make_backend",
}


def backend_factory(name: str) -> Callable[[BackendRequest], FeatureBackend]:
    """The factory of --backend `name`; UserError when it is unknown or its module is not in this version."""
    target = BACKENDS.get(name)
    if target is None:
        raise UserError(f"--backend {name}: no such backend; choose one of {', '.join(BACKENDS)}")
    module_name, _, function = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise UserError(f"--backend {name}: this version of the trainer has no {module_name}; update it, or use "
                        "--backend demo to try the pipeline with stand-in models") from None
    return getattr(module, function)


def check_features(backend: FeatureBackend, clips: Sequence[Clip], features: Sequence[Features]) -> None:
    """What the pipeline checks of every batch a backend returns: one Features per clip, codes of exactly
    code_length() (a padded row is refused here, never written). A failure is the backend's bug: RuntimeError."""
    if len(features) != len(clips):
        raise RuntimeError(f"backend {type(backend).__name__} returned {len(features)} results for {len(clips)} clips")
    for clip, feats in zip(clips, features):
        want = backend.code_length(clip.waveform.shape[0])
        codes = np.asarray(feats.codes)
        if codes.ndim != 1 or codes.shape[0] != want:
            raise RuntimeError(f"backend {type(backend).__name__} returned codes of shape {list(codes.shape)} for "
                               f"{clip.id} ({clip.waveform.shape[0]} samples), expected [{want}]: not cut to the clip")
