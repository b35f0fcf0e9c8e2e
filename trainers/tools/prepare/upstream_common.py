"""What indextts-prepare's two upstream backends share (trainers/tools/prepare/upstream.py says what they do and
why): the user's installation, reading config and weights with complete-load checks, loading audio as inference
does, w2v-BERT 2.0 features, per-clip runs, the fingerprint."""
from __future__ import annotations

import importlib.metadata
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import yaml

from trainers.errors import UserError
from trainers.files import file_sha256
from trainers.tools.prepare.backend import (
    CONDITIONING_SECONDS, SPEECH_RATE, AudioProblem, Clip,
)

LOAD_RATE = 22050  # librosa.load's default rate, at which inference loads a reference clip
W2V_LAYER = 17  # get_emb: hidden_states[17]
W2V_WIDTH = 1024  # w2v-BERT 2.0's hidden size, the width upstream's conformers take
FBANK_FRAME, FBANK_HOP = 400, 160  # the extractor's Kaldi frames at 16 kHz: 25 ms window, 10 ms hop
PROMPT_KEY = "prompt"  # Clip.extras: the first 15 s at 16 kHz, when the clip is longer
VERSIONED = ("torch", "torchaudio", "transformers", "librosa", "WeTextProcessing", "wetext", "nemo_text_processing",
             "sentencepiece", "tiktoken")


class ConfigSection(dict):
    """A config section as OmegaConf gives it to upstream: `**section` and `section.key` (a missing key is an
    AttributeError, so upstream's `hasattr(cfg, key)` checks read it as upstream's own loader would)."""

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return ConfigSection(value) if isinstance(value, dict) else value


def read_config(path: Path) -> ConfigSection:
    """config.yaml as a ConfigSection; UserError naming it when unreadable."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"--config {path} cannot be read as YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpt"), dict):
        raise UserError(f"--config {path} has no gpt section: pass the config.yaml of the official checkpoints folder")
    return ConfigSection(data)


def need_file(path: Path, what: str, fix: str) -> Path:
    if not path.is_file():
        raise UserError(f"{path}: no such file ({what}); {fix}")
    return path


def text_normalizer(inst: Any, model_dir: Path, files: dict[str, Path]) -> Any:
    """Upstream's TextNormalizer as both inference paths build it: glossary on, loaded, with the checkpoints folder's
    glossary.yaml where there is one (then recorded in `files`, so the fingerprint covers it)."""
    normalizer = inst.TextNormalizer(enable_glossary=True)
    normalizer.load()
    glossary = model_dir / "glossary.yaml"
    if glossary.exists():
        normalizer.load_glossary_from_yaml(str(glossary))
        files["glossary"] = glossary
    return normalizer


def upstream_name(module: ModuleType, name: str) -> Any:
    """A name of the inference module's namespace (a class, a function, a library it imported)."""
    try:
        return getattr(module, name)
    except AttributeError:
        raise UserError(f"{module.__file__} has no {name}: this IndexTTS version is not one indextts-prepare "
                        "knows (it follows upstream's infer_v2.py of 2.0 and infer_v2_5.py of 2.5)") from None


def load_weights(module: Any, state: Mapping[str, Any], where: Path, may_lack: Iterable[str] = (),
                 may_add: bool = False) -> None:
    """`state` into `module`; refuses (UserError naming `where`) a missing tensor other than those starting with
    `may_lack`, an extra one unless `may_add`, and a shape mismatch: none may stay at its random initialisation."""
    import torch

    state = dict(state)
    own = module.state_dict()
    lack = tuple(may_lack)
    missing = [k for k in own if k not in state and not (lack and k.startswith(lack))]
    extra = [k for k in state if k not in own]
    shaped = [f"{k} {list(state[k].shape)} (model {list(own[k].shape)})" for k in own
              if k in state and isinstance(state[k], torch.Tensor) and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []

    def some(keys: list[str], n: int = 3) -> str:
        return ", ".join(keys[:n]) + (", ..." if len(keys) > n else "")

    if missing:
        problems.append(f"{len(missing)} tensors missing ({some(missing)})")
    if shaped:
        problems.append(f"{len(shaped)} of another shape ({some(shaped, 2)})")
    if extra and not may_add:
        problems.append(f"{len(extra)} the model has no place for ({some(extra)})")
    if problems:
        raise UserError(f"{where} does not fit the model its config describes: {'; '.join(problems)}. Part of the "
                        "model would keep random weights; pass the files of one official release (or a config "
                        "whose sizes match them)")
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def torch_file(path: Path, what: str) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for a damaged or foreign file
        raise UserError(f"{path} ({what}) cannot be read by torch.load ({type(exc).__name__}: {exc})") from None


def state_of(data: Any, path: Path) -> Mapping[str, Any]:
    """A checkpoint's state dict: its "model" entry when it has one (as upstream's loaders read it)."""
    state = data.get("model", data) if isinstance(data, dict) else None
    if not isinstance(state, dict):
        raise UserError(f"{path} holds no state dict")
    return state


@dataclass
class Installation:
    """The user's inference module and the audio libraries it calls."""

    module: ModuleType
    librosa: Any
    torchaudio: Any

    def __getattr__(self, name: str) -> Any:
        return upstream_name(self.module, name)


def open_installation(indextts_dir: Path | None, family: str) -> Installation:
    from trainers.tools.indextts_upstream import import_inference, module_global

    name, product = ("infer_v2_5", "IndexTTS-2.5") if family == "indextts25" else ("infer_v2", "IndexTTS2")
    module = import_inference(indextts_dir, name, product)
    return Installation(module, module_global(module, "librosa", indextts_dir),
                        module_global(module, "torchaudio", indextts_dir))


# ------------------------------------------------------------------------------------------------------ audio

def load_clip(inst: Installation, path: Path, clip_id: str) -> Clip:
    """`path` as inference loads a reference clip: librosa at 22,050 Hz mono, torchaudio's Resample to 16 kHz;
    the first 15 s (cut before resampling, as inference cuts) in extras when the clip is longer."""
    import torch

    try:
        audio, rate = inst.librosa.load(str(path))
    except Exception as exc:  # librosa raises its decoders' many types
        raise AudioProblem(f"cannot be decoded by librosa ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})",
                           "convert it to WAV or FLAC") from None
    source_rate, channels = source_format(inst, path, int(rate))
    wav = torch.as_tensor(np.asarray(audio, dtype=np.float32)).reshape(1, -1)
    resample = inst.torchaudio.transforms.Resample(int(rate), SPEECH_RATE)
    with torch.no_grad():
        whole = resample(wav)[0].numpy()
        cut = int(CONDITIONING_SECONDS * rate)
        extras = {PROMPT_KEY: resample(wav[:, :cut])[0].numpy()} if wav.shape[1] > cut else {}
    return Clip(clip_id, whole, SPEECH_RATE, source_rate, channels, extras)


def source_format(inst: Installation, path: Path, loaded_rate: int) -> tuple[int, int]:
    """The file's own rate and channel count, for the report (librosa's loader hides them)."""
    try:
        import soundfile  # librosa's own decoder for WAV/FLAC/OGG

        info = soundfile.info(str(path))
        return int(info.samplerate), int(info.channels)
    except Exception:  # not installed, or a format only audioread decodes: the loaded rate, mono
        get_rate = getattr(inst.librosa, "get_samplerate", None)
        try:
            return (int(get_rate(str(path))) if get_rate else loaded_rate), 1
        except Exception:
            return loaded_rate, 1


def prompt_wave(clip: Clip) -> np.ndarray:
    """The conditioning clip: the first 15 s of `clip` at 16 kHz."""
    return clip.extras.get(PROMPT_KEY, clip.waveform)


def w2v_frames(samples: int) -> int:
    """Feature frames of a 16 kHz clip alone: Kaldi frames (25 ms, hop 10 ms), padded to an even count, stacked
    in pairs (SeamlessM4TFeatureExtractor with its defaults). A batched row is cut back to this."""
    if samples < FBANK_FRAME:
        return 0
    return math.ceil((1 + (samples - FBANK_FRAME) // FBANK_HOP) / 2)


# ---------------------------------------------------------------------------------------------------- w2v-BERT

class SemanticFeatures:
    """Normalised w2v-BERT 2.0 layer-17 features of 16 kHz clips: get_emb of both inference modules."""

    def __init__(self, extractor: Any, model: Any, mean: Any, std: Any, device: str) -> None:
        self.extractor, self.model, self.mean, self.std, self.device = extractor, model, mean, std, device

    def __call__(self, waves: Sequence[np.ndarray]) -> list[Any]:
        """Each wave's features [T_i, 1024] (T_i = w2v_frames), computed in one padded batch."""
        import torch

        inputs = self.extractor([np.asarray(w, dtype=np.float32) for w in waves], sampling_rate=SPEECH_RATE,
                                return_tensors="pt")
        with torch.no_grad():
            out = self.model(input_features=inputs["input_features"].to(self.device),
                             attention_mask=inputs["attention_mask"].to(self.device), output_hidden_states=True)
            feats = (out.hidden_states[W2V_LAYER] - self.mean) / self.std
        return [feats[i, :w2v_frames(len(w))] for i, w in enumerate(waves)]


def semantic_features(inst: Installation, source: str | Path, stats: Path, device: str,
                      **from_pretrained: Any) -> SemanticFeatures:
    """The extractor and w2v-BERT of `source` (a hub id with cache_dir, or a folder) as inference builds them,
    with 17 layers; every tensor of those layers must come from the file."""
    import torch

    extractor_cls = upstream_name(inst.module, "SeamlessM4TFeatureExtractor")
    from transformers import Wav2Vec2BertModel

    from transformers.utils import logging as hf_logging

    what = f"w2v-BERT 2.0 ({source})"
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the layers past 17 are left out on purpose: no "weights not used" notice
    try:
        extractor = extractor_cls.from_pretrained(str(source), local_files_only=True, **from_pretrained)
        model, info = Wav2Vec2BertModel.from_pretrained(str(source), local_files_only=True,
                                                        num_hidden_layers=W2V_LAYER, output_loading_info=True,
                                                        **from_pretrained)
    except (OSError, ValueError) as exc:
        raise UserError(f"{what} cannot be loaded ({' '.join(str(exc).split())[:300]}); run IndexTTS inference "
                        "once with this checkpoints folder (it downloads it into hf_cache), or download "
                        "facebook/w2v-bert-2.0 there") from None
    finally:
        hf_logging.set_verbosity(level)
    if model.config.hidden_size != W2V_WIDTH:
        raise UserError(f"{what} has hidden size {model.config.hidden_size}, not {W2V_WIDTH}: not w2v-BERT 2.0")
    bad = list(info.get("missing_keys", [])) + [str(m[0]) for m in info.get("mismatched_keys", [])]
    if bad:
        raise UserError(f"{what}: {len(bad)} tensors are not in its weights or have another shape ({bad[0]}, ...); "
                        "its layers would keep random weights")
    data = torch_file(stats, "w2v-BERT feature statistics")
    try:
        mean, var = data["mean"], data["var"]
        assert tuple(mean.shape)[-1] == tuple(var.shape)[-1] == W2V_WIDTH
    except Exception:
        raise UserError(f"{stats} is not the w2v-BERT statistics file (a dict of 'mean' and 'var', {W2V_WIDTH} wide)") \
            from None
    model = model.to(device).eval()
    return SemanticFeatures(extractor, model, mean.to(device), torch.sqrt(var).to(device), device)


def alone(feats: Any) -> tuple[Any, Any]:
    """One clip's features as a batch of one [1, T, C] and its length [T]: upstream's conformers run on each clip
    alone. Their convolution module zeroes padded frames and then applies a pointwise convolution with a bias, so
    a padded row's last frames see that bias where the clip alone sees zeros (up to 1e-1 apart at the tiny test
    sizes: tests/test_prepare_upstream.py); the models are small beside w2v-BERT, so nothing is lost."""
    import torch

    return feats.unsqueeze(0), torch.tensor([feats.shape[0]], device=feats.device)


def conditioning_features(semantic: SemanticFeatures, clips: Sequence[Clip], whole: Sequence[Any]) -> list[Any]:
    """Each clip's conditioning features: its whole-clip features when it is 15 s or less, else those of its
    first 15 s (w2v-BERT sees the whole sequence, so a prefix of the longer clip's features would differ)."""
    long = [i for i, c in enumerate(clips) if PROMPT_KEY in c.extras]
    out = list(whole)
    if long:
        for i, f in zip(long, semantic([clips[i].extras[PROMPT_KEY] for i in long])):
            out[i] = f
    return out


def quantized(codec: Any, feats: Any) -> np.ndarray:
    """One clip's codes: the codec's quantize on its own frames alone (its convolutions are non-causal, so a
    padded row's last codes would see the padding)."""
    if feats.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    codes, _ = codec.quantize(feats.unsqueeze(0))
    if codes.dim() == 3:  # several quantizers: the first is the semantic code
        codes = codes[0]
    return codes[0].cpu().numpy().astype(np.int64)


def to_array(x: Any) -> np.ndarray:
    return x.detach().float().cpu().numpy().astype(np.float32)


# ----------------------------------------------------------------------------------------------------- identity

def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[f"version {name}"] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def files_fingerprint(files: Mapping[str, Path]) -> dict[str, str]:
    """sha256 of each file the features depend on, by role."""
    return {f"sha256 {role}": file_sha256(path) for role, path in files.items()}


def installation_fingerprint(inst: Installation) -> dict[str, str]:
    """Which upstream code ran: its inference module's file and sha256, and the packages' versions."""
    path = Path(inst.module.__file__)
    return {"upstream module": str(path), "sha256 upstream module": file_sha256(path), **versions()}
