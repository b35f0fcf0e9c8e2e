"""indextts-prepare's upstream backends: each family's features made by upstream's own code, as its inference
makes them for a reference clip (shared/reference/features.md), from the user's IndexTTS installation and the
official checkpoints folder. `make_backend` (registered as `--backend upstream` in backend.py) picks the family's
backend: upstream_v2.py (IndexTTS2) or upstream_v25.py (IndexTTS-2.5); this module holds what both share.

Everything upstream is taken from the installation's inference module (indextts/infer_v2.py, infer_v2_5.py),
imported when the command runs (trainers/tools/indextts_upstream.py): its model classes, text front end, and the
libraries it calls, librosa (loading) and torchaudio (Resample, Kaldi fbank). So the features are computed by the
code inference runs, in the environment it runs in (upstream pins torch 2.8 with its torchaudio; this package
needs torch >= 2.5, so both install into that environment). What is written here is the glue inference has
inline, in its order, with what training needs beside it:

  audio     librosa.load(path) (22,050 Hz, mono), then torchaudio's Resample(22050, 16000): inference's speaker
            path. The whole clip makes the codes; its first 15 s (cut at 22,050 Hz, then resampled, as
            inference cuts its prompt) make the conditioning. Inference's emotion path loads the prompt with
            librosa straight at 16 kHz; here one 16 kHz signal feeds both (they differ by resampler noise).
  w2v-BERT  SeamlessM4TFeatureExtractor + Wav2Vec2BertModel, hidden_states[17], (h - mean) / sqrt(var) of the
            stats file; batched (it masks padding), each row then cut to the frames the clip has alone. The
            model is built with 17 layers: the rest never reach layer 17's output (tested bit for bit).
  codecs    run on each row cut to its own frames (their convolutions are non-causal: padding would leak in).
  conformer the GPT's conditioning encoders run on each clip alone (`alone`: their convolution module is not
            padding-safe), given its frame count (inference passes 1024, the feature width, which masks nothing
            for clips of 20 s or less; the 15 s cut keeps them there).

Weights are checked to load completely: a missing tensor, a shape mismatch or (where upstream's loader would
skip it silently) a tensor left at its random initialisation is refused with the file's name (UserError, exit 2).
"""
from __future__ import annotations

from trainers.errors import UserError
from trainers.tools.prepare.backend import BackendRequest, FeatureBackend
from trainers.tools.prepare.upstream_common import PROMPT_KEY, open_installation

__all__ = ["PROMPT_KEY", "make_backend"]


def make_backend(request: BackendRequest) -> FeatureBackend:
    """The upstream backend of request.family (`--backend upstream`)."""
    if request.model_dir is None:
        raise UserError("--backend upstream needs --model-dir: the official checkpoints folder of the model")
    if not request.model_dir.is_dir():
        raise UserError(f"--model-dir {request.model_dir}: no such folder")
    if request.family == "indextts25":
        from trainers.tools.prepare.upstream_v25 import IndexTTS25Backend as backend
    elif request.family == "indextts2":
        from trainers.tools.prepare.upstream_v2 import IndexTTS2Backend as backend  # type: ignore[assignment]
    else:
        raise UserError(f"--backend upstream has no backend for the model family {request.family}")
    return backend(open_installation(request.indextts_dir, request.family), request)
