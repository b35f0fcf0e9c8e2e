"""The demo backend: tiny, randomly initialised STAND-IN feature models, so the pipeline runs anywhere (--demo, the
tests, the benchmark) without upstream's code or its multi-GB checkpoints. Its features have the right shapes,
rates and dtypes and nothing else: a model trained on them learns nothing about speech.

What stands in for what (upstream's real path: the upstream backend, shared/reference/features.md):
  w2v-BERT 2.0 layer 17   log energies of 25 ms frames every 10 ms in 32 random Hann-windowed "bands",
                          normalised per utterance, pairs of frames stacked (50 frames a second, as the real
                          extractor's count: ceil((1 + (N - 400) // 160) / 2)), one masked self-attention layer
  semantic codec          two convolutions (kernel 7, zero beyond the clip: masked) and the nearest of
                          start_mel_token unit vectors; IndexTTS-2.5 adds a stride-2 convolution first (25 codes
                          a second, ceil(T / 2)), as its EnhancedCodec does
  conditioning (2.0)      32 random latents attending to the first 15 s of the frames -> [32, model_dim]
  CAMPPlus (2.5)          mean and spread of the first 15 s of the bands -> a random projection to 192
  emotion vector          the mean of the first 15 s of the frames -> model_dim
  text                    the family's front end as this trainer implements it (trainers/data/text_front_end.py,
                          trainers/families/indextts25/front_end.py) and the given tokenizer file

Every row of a batch is masked to its own frames at every step, so a batch gives each clip what it gets alone
(within float rounding); the weights are drawn from the seed alone.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from trainers.config.config_yaml import read_config_yaml
from trainers.errors import UserError
from trainers.families import FAMILIES
from trainers.files import dict_sha256, file_sha256
from trainers.tools.prepare.audio import AudioLoader
from trainers.tools.prepare.backend import (
    CONDITIONING_SECONDS, SPEECH_RATE, BackendRequest, Clip, Features, TextIds,
)

VERSION = "demo-1"  # of these stand-ins: part of the fingerprint
WINDOW, HOP, BANDS, HIDDEN = 400, 160, 16, 32
PART = 80  # a frame is WINDOW / PART parts, a hop HOP / PART of them
CONDITION_LATENTS, SPEAKER_DIM = 32, 192


def fbank_frames(samples: int) -> int:
    return 1 + (samples - WINDOW) // HOP if samples >= WINDOW else 0


def feature_frames(samples: int) -> int:
    return -(-fbank_frames(samples) // 2)


class StandInModels:
    """The stand-in weights, drawn from a seed, and their forward pass over a padded batch."""

    def __init__(self, family: str, model_dim: int, num_codes: int, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g) / math.sqrt(rows)).to(device)

        self.family, self.device = family, device
        window = torch.hann_window(WINDOW, periodic=False, dtype=torch.float32)
        self.bands = (window[:, None] * torch.randn(WINDOW, BANDS, generator=g) / math.sqrt(WINDOW)).to(device)
        self.proj = w(2 * BANDS, HIDDEN)
        self.q, self.k, self.v, self.ffn = (w(HIDDEN, HIDDEN) for _ in range(4))
        self.conv = [w(HIDDEN * 7, HIDDEN) for _ in range(2)]  # kernel 7 over HIDDEN channels, as one matrix
        self.down = w(HIDDEN * 3, HIDDEN)
        codebook = torch.randn(num_codes, HIDDEN, generator=g)
        self.codebook = (codebook / codebook.norm(dim=1, keepdim=True)).to(device)
        self.latents = torch.randn(CONDITION_LATENTS, HIDDEN, generator=g).to(device)
        self.cond_out = w(HIDDEN, model_dim)
        self.emo = w(HIDDEN, model_dim)
        self.spk = w(2 * BANDS, SPEAKER_DIM)

    def _framed(self, batch: torch.Tensor, frames: int) -> torch.Tensor:
        """Each 400-sample frame (every 160 samples) times the windowed band matrix [400, BANDS]: a frame is 5 parts
        of 80 samples, so the product is the sum of 5 products of the parts (no copy of overlapping frames)."""
        parts = batch.reshape(batch.shape[0], -1, PART)  # [B, N / 80, 80]
        step, count = HOP // PART, WINDOW // PART
        total = None
        for j in range(count):
            term = parts[:, j: j + step * (frames - 1) + 1: step] @ self.bands[j * PART:(j + 1) * PART]
            total = term if total is None else total + term
        return total

    @staticmethod
    def _mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
        return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]

    @staticmethod
    def _masked_conv(x: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor, stride: int = 1) -> torch.Tensor:
        """A 1-D convolution [B, T, H] -> [B, T', H] (one matrix product over the unfolded windows); frames beyond a
        clip are zeros, as the padding of that clip alone is."""
        width = weight.shape[0] // x.shape[-1]
        x = torch.nn.functional.pad(x * mask[..., None], (0, 0, width // 2, width // 2))
        return x.unfold(1, width, stride).flatten(2) @ weight

    @torch.no_grad()
    def __call__(self, waves: list[torch.Tensor], cond_samples: list[int]) -> list[dict[str, np.ndarray]]:
        dev = self.device
        n = [w.shape[0] for w in waves]
        fb = torch.tensor([fbank_frames(s) for s in n], device=dev)
        longest = -(-max(max(n), WINDOW) // PART) * PART
        batch = torch.zeros(len(waves), longest, device=dev)
        for i, w in enumerate(waves):
            batch[i, : w.shape[0]] = w.to(dev)
        bands = torch.log(self._framed(batch, int(fb.max())) ** 2 + 1e-6)  # [B, F, BANDS]
        fmask = self._mask(fb, bands.shape[1])[..., None].float()
        count = fmask.sum(1).clamp(min=1)
        mean = (bands * fmask).sum(1) / count[..., 0:1]
        std = (((bands - mean[:, None]) ** 2 * fmask).sum(1) / count[..., 0:1]).sqrt() + 1e-3
        bands = (bands - mean[:, None]) / std[:, None] * fmask  # zeros beyond each clip, as its own padding
        if bands.shape[1] % 2:
            bands = torch.nn.functional.pad(bands, (0, 0, 0, 1))
        stacked = bands.reshape(bands.shape[0], bands.shape[1] // 2, 2 * BANDS)
        lengths = (fb + 1) // 2
        mask = self._mask(lengths, stacked.shape[1])
        x = torch.tanh(stacked @ self.proj)
        scores = (x @ self.q) @ (x @ self.k).transpose(1, 2) / math.sqrt(HIDDEN)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        x = x + torch.softmax(scores, dim=-1) @ (x @ self.v)
        x = x + torch.tanh(x @ self.ffn)  # the "layer-17 features" [B, T, H]
        codes, code_lens = self._codes(x, mask, lengths)
        cond_frames = torch.minimum(lengths, torch.tensor([feature_frames(c) for c in cond_samples], device=dev))
        out = [{"codes": codes[i, : int(code_lens[i])].cpu().numpy().astype(np.int32)} for i in range(len(waves))]
        cmask = self._mask(cond_frames, x.shape[1])
        pooled = (x * cmask[..., None]).sum(1) / cond_frames[:, None].clamp(min=1)
        emo = torch.tanh(pooled @ self.emo)
        if self.family == "indextts25":
            bmask = self._mask(2 * cond_frames, bands.shape[1])[..., None].float()
            c = bmask.sum(1).clamp(min=1)
            m = (bands * bmask).sum(1) / c
            s = (((bands - m[:, None]) ** 2 * bmask).sum(1) / c).sqrt()
            spk = torch.cat([m, s], dim=1) @ self.spk
            for i, row in enumerate(out):
                row.update(spk_emb=spk[i].cpu().numpy(), emo_vec=emo[i].cpu().numpy())
        else:
            scores = (self.latents @ self.q)[None] @ (x @ self.k).transpose(1, 2) / math.sqrt(HIDDEN)
            scores = scores.masked_fill(~cmask[:, None, :], float("-inf"))
            condition = (torch.softmax(scores, dim=-1) @ (x @ self.v)) @ self.cond_out
            for i, row in enumerate(out):
                row.update(condition=condition[i].cpu().numpy(), emo_vec=emo[i].cpu().numpy())
        return out

    def _codes(self, x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.gelu(self._masked_conv(x, mask, self.conv[0]))
        h = self._masked_conv(h, mask, self.conv[1])
        if self.family == "indextts25":
            h = torch.nn.functional.gelu(self._masked_conv(h, mask, self.down, stride=2))
            lengths = (lengths + 1) // 2
        h = h / h.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        return (h @ self.codebook.T).argmax(-1), lengths


class DemoBackend:
    """FeatureBackend (backend.py) over the stand-in models, the family's front end and a tokenizer file."""

    audio_rate = SPEECH_RATE

    def __init__(self, request: BackendRequest) -> None:
        family = FAMILIES[request.family]
        self.family = family.name
        self.code_rate = 25 if family.name == "indextts25" else 50
        data = read_config_yaml(request.config, f"--config {request.config}", "pass the model's config.yaml")
        gpt = family.read_config(data["gpt"])
        if request.tokenizer is None or not request.tokenizer.is_file():
            raise UserError(f"--tokenizer {request.tokenizer}: no such file; the demo backend needs the tokenizer "
                            f"file ({family.demo_tokenizer_name} for {family.title})")
        self._tokenizer_path = request.tokenizer
        self._tokenizer = family.tokenizer.load(str(request.tokenizer))
        self._device = torch.device(request.device)
        self._models = StandInModels(family.name, gpt.model_dim, gpt.start_mel_token, request.seed, self._device)
        self._loader = AudioLoader(SPEECH_RATE)
        self._fingerprint = {"backend": VERSION, "seed": str(request.seed), "gpt": dict_sha256(gpt.to_dict()),
                             "tokenizer": file_sha256(request.tokenizer)}

    def fingerprint(self) -> dict[str, str]:
        return dict(self._fingerprint)

    def text(self, text: str, language: str | None) -> TextIds:
        if self.family == "indextts25":
            from trainers.families.indextts25.front_end import front_end, text_ids

            ids = text_ids(self._tokenizer, text, language or "")
            return TextIds(np.asarray(ids, dtype=np.int32), 0, front_end(text, language or ""))
        from trainers.data.text_front_end import front_end

        normalised = front_end(text)
        ids = np.asarray(self._tokenizer.encode(normalised, out_type=int), dtype=np.int32)
        return TextIds(ids, int(np.count_nonzero(ids == self._tokenizer.unk_id())), normalised)

    def audio(self, path: Path, clip_id: str) -> Clip:
        return self._loader.load(path, clip_id)

    def code_length(self, samples: int) -> int:
        frames = feature_frames(samples)
        return -(-frames // 2) if self.family == "indextts25" else frames

    def encode(self, clips: Sequence[Clip]) -> list[Features]:
        cond = int(CONDITIONING_SECONDS * SPEECH_RATE)
        rows = self._models([torch.from_numpy(np.ascontiguousarray(c.waveform)) for c in clips],
                            [min(c.waveform.shape[0], cond) for c in clips])
        return [Features(row.pop("codes"), row) for row in rows]


def make_backend(request: BackendRequest) -> DemoBackend:
    return DemoBackend(request)
