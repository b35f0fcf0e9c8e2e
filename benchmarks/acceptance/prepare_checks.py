"""indextts-prepare's feature backends at the official sizes with random weights: how fast upstream's feature models
make training features from audio (the real-time factor: compute seconds per second of audio), both families.

The models are upstream's own classes (from the pinned wheels, tests/upstream_features.py; the suite fetches them
into .upstream/), built at the official sizes straight on the device with random weights: w2v-BERT 2.0 (its
first 17 of 24 layers, all that layer 17's output needs), the MaskGCT RepCodec (2.0) and EnhancedCodec (2.5),
the GPT's conditioning and emotion encoders inside the official UnifiedVoice, CAMPPlus (2.5). The backends'
`encode` then runs on clips of 3-12 s in length-sorted batches of 8, as indextts-prepare batches them, after one
warm-up batch. Reading the checkpoint files is not timed (the tests load tiny copies of them). The CPU side is
the same at the tests' tiny sizes on a few short clips.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from benchmarks.acceptance.context import Context
from benchmarks.acceptance.runner import Outcome

CLIPS = 24
BATCH = 8
SECONDS = (3.0, 12.0)
OFFICIAL_GPT = {"model_dim": 1280, "max_mel_tokens": 1815, "max_text_tokens": 600, "heads": 20,
                "use_mel_codes_as_input": True, "mel_length_compression": 1024, "layers": 24,
                "number_text_tokens": 12000, "number_mel_codes": 8194, "start_mel_token": 8192, "stop_mel_token": 8193,
                "start_text_token": 0, "stop_text_token": 1, "train_solo_embeddings": False,
                "condition_type": "conformer_perceiver",
                "condition_module": {"output_size": 512, "linear_units": 2048, "attention_heads": 8, "num_blocks": 6,
                                     "input_layer": "conv2d2", "perceiver_mult": 2},
                "emo_condition_module": {"output_size": 512, "linear_units": 1024, "attention_heads": 4,
                                         "num_blocks": 4, "input_layer": "conv2d2", "perceiver_mult": 2}}
OFFICIAL_CODEC = {"codebook_size": 8192, "hidden_size": 1024, "codebook_dim": 8, "vocos_dim": 384,
                  "vocos_intermediate_dim": 2048, "vocos_num_layers": 12}


def missing_code() -> str | None:
    """Why upstream's code cannot be had here (None: it can): the wheels the suite fetches into .upstream/."""
    from tests.upstream_models import TORCHAUDIO, UPSTREAM_V2_CODE, UPSTREAM_V25_CODE, _fetched

    for wheel in (UPSTREAM_V2_CODE, UPSTREAM_V25_CODE, TORCHAUDIO):
        found = _fetched(wheel)
        if isinstance(found, str):
            return f"{found} (run the test suite once with PyPI reachable, or carry .upstream/ to this machine)"
    return None


def build(official: bool, device: str) -> dict[str, Any]:
    """Both families' backends on upstream's classes: official sizes on `device`, or the tests' tiny ones."""
    from tests import upstream_features as uf
    from trainers.tools.prepare.upstream_common import ConfigSection, SemanticFeatures
    from trainers.tools.prepare.upstream_v2 import IndexTTS2Backend
    from trainers.tools.prepare.upstream_v25 import IndexTTS25Backend
    from transformers import SeamlessM4TFeatureExtractor, Wav2Vec2BertConfig, Wav2Vec2BertModel

    gpt = OFFICIAL_GPT if official else uf.GPT
    codec = ConfigSection(OFFICIAL_CODEC if official else uf.CODEC)
    w2v = {"num_hidden_layers": 17} if official else {**uf.W2V, "num_hidden_layers": 17}
    backends = {}
    with uf.stand_ins(), torch.device(device), torch.no_grad():
        uf.bare_package(uf.checkout_20(), "indextts")
        model_v2 = __import__("importlib").import_module("indextts.gpt.model_v2")
        maskgct = __import__("importlib").import_module("indextts.utils.maskgct_utils")
        names = uf.namespace_25()
        torch.manual_seed(0)
        semantic = SemanticFeatures(SeamlessM4TFeatureExtractor(**uf.PREPROCESSOR),
                                    Wav2Vec2BertModel(Wav2Vec2BertConfig(**w2v)).eval(), torch.zeros(1024),
                                    torch.ones(1024), device)
        b2 = IndexTTS2Backend.__new__(IndexTTS2Backend)
        b2.device, b2.semantic = device, semantic
        b2.gpt = model_v2.UnifiedVoice(**gpt).eval()
        b2.codec = maskgct.build_semantic_codec(codec).eval()
        b25 = IndexTTS25Backend.__new__(IndexTTS25Backend)
        b25.device, b25.semantic = device, semantic
        b25.gpt = names["UnifiedVoice"](**{**gpt, "number_text_tokens": 60509}, spk_cond_mode="campplus").eval()
        b25.codec = names["EnhancedCodec"](**codec, cfg=codec).eval()
        b25.campplus = names["CAMPPlus"](feat_dim=80, embedding_size=192).eval()
        b25.inst = type("Installation", (), {"torchaudio": names["torchaudio"]})()
        backends = {"indextts2": b2, "indextts25": b25}
    return backends


def clips(count: int, seconds: tuple[float, float]) -> list[Any]:
    """Voice-like clips at 16 kHz of lengths spread over `seconds`, sorted as the pipeline's batches are."""
    from tests.upstream_features import voice
    from trainers.tools.prepare.backend import Clip

    lengths = np.linspace(seconds[0], seconds[1], count)
    return [Clip(f"clip{i}", voice(float(s), seed=i, rate=16000), 16000, 16000, 1) for i, s in enumerate(lengths)]


def measure(backend: Any, batch: list[Any], device: str) -> tuple[float, list[Any]]:
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    features = backend.encode(batch)
    sync()
    return time.perf_counter() - start, features


def rtf(ctx: Context, official: bool, count: int, seconds: tuple[float, float], batch: int) -> Outcome:
    why = missing_code()
    if why:
        return Outcome(None, {}, why)
    device = ctx.device
    start = time.perf_counter()
    backends = build(official, device)
    built_s = time.perf_counter() - start
    audio = clips(count, seconds)
    total_audio = sum(c.seconds for c in audio)
    figures: dict[str, Any] = {"clips": count, "audio_s": round(total_audio, 1), "batch": batch,
                               "build_s": round(built_s, 1), "device": device}
    lines, ok = [], True
    for family, backend in backends.items():
        measure(backend, audio[:min(batch, 2)], device)  # warm-up: kernels chosen, memory pooled
        spent, made = 0.0, []
        for i in range(0, count, batch):
            seconds_, feats = measure(backend, audio[i:i + batch], device)
            spent, made = spent + seconds_, made + feats
        good = all(len(f.codes) == backend.code_length(c.waveform.shape[0]) for c, f in zip(audio, made))
        ok = ok and good
        figures[f"{family}_rtf"] = round(spent / total_audio, 5)
        figures[f"{family}_audio_hours_per_hour"] = round(total_audio / spent, 1)
        lines.append(f"{family}: {spent:.2f} s for {total_audio:.0f} s of audio: real-time factor "
                     f"{spent / total_audio:.4f} ({total_audio / spent:.0f}x real time); codes of every clip's "
                     f"length: {'yes' if good else 'NO'}")
    if device.startswith("cuda"):
        figures["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 1)
    return Outcome(ok, figures, "" if ok else "a clip's codes are not of its length", tuple(lines))


def prepare_rtf(ctx: Context) -> Outcome:
    """Official sizes on the GPU."""
    return rtf(ctx, official=True, count=CLIPS, seconds=SECONDS, batch=BATCH)


def prepare_rtf_cpu_side(ctx: Context) -> Outcome:
    """The same code at the tests' tiny sizes on the CPU, on a few short clips."""
    outcome = rtf(ctx, official=False, count=3, seconds=(0.5, 0.8), batch=2)
    return outcome
