"""The user's IndexTTS2 installation, used to turn generated mel codes into audio as its inference does.

Nothing here imports upstream at module import: `import_upstream` does, when the command runs, from
--indextts-dir (a checkout of https://github.com/index-tts/index-tts) or the installed `indextts`
package. When that fails it raises a UserError saying what to install (exit 2, no traceback).

The pipeline is upstream's own `IndexTTS2(cfg_path, model_dir)` (indextts/infer_v2.py): it loads
the GPT, w2v-BERT 2.0, the MaskGCT semantic codec, the s2mel model, CAMPPlus and BigVGAN exactly as
inference does. From generated codes, inference makes a waveform in two parts, which `render_codes`
and `prompt_voice` call in the same order with the same arguments (upstream ee40fa7):

  the voice prompt (once): the prompt audio, cut to 15 s, resampled to 16 and 22.05 kHz; w2v-BERT
      features -> semantic codec -> s2mel length regulator (the prompt condition); its mel; its
      CAMPPlus style embedding from 80-bin fbank
  each sample: the GPT's latent of the codes (a teacher-forced forward over text and codes), the
      s2mel gpt_layer on it added to the codes' codec embeddings, the length regulator at 1.72
      frames per code, the CFM (25 steps, cfg rate 0.7) after the prompt condition, the prompt's
      frames cut off, BigVGAN

One difference, on purpose: inference conditions the GPT's forward on the prompt audio's features;
here it is conditioned on the sample's own precomputed conditioning latent and emotion vector (the
manifest's), the ones the codes were generated from, so the latent belongs to the codes.

IndexTTS-2.5 (indextts/infer_v2_5.py, upstream v2.5.0, chosen by the config's `version: 2.5`) needs no GPT
latent: its s2mel model reads the codes alone. `prompt_voice` (given the family) and `render_codes_25` follow its order:

  the voice prompt: cut to 15 s, resampled to 22.05 and 16 kHz; the w2v-BERT features themselves (not
      quantized) -> length regulator (the prompt condition); its mel; CAMPPlus on the fbank of the clip
      loaded and resampled again, as infer_v2_5 does
  each sample: semantic_codec.decode(codes) (25 Hz codes -> 50 Hz features), the length regulator at 1.72
      frames per feature frame, the CFM after the prompt condition, the prompt's frames cut off, BigVGAN
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import yaml

from trainers.config.inference_keys import missing_inference_keys, value_at
from trainers.errors import UserError

REPOSITORY = "https://github.com/index-tts/index-tts"
MODELS = "https://huggingface.co/IndexTeam/IndexTTS-2"
MODELS_25 = "https://huggingface.co/IndexTeam/IndexTTS-2.5"
SAMPLE_RATE = 22050  # infer_v2 writes its waveforms at this rate (BigVGAN 22 kHz, 80 bands, hop 256)
PROMPT_SECONDS = 15  # infer_v2 cuts the prompt audio to this
FRAMES_PER_CODE = 1.72  # infer_v2's target mel length per code
DIFFUSION_STEPS = 25
CFG_RATE = 0.7
# config.yaml's files the pipeline opens in model_dir (QwenEmotion is not loaded here where upstream allows it).
MODEL_FILE_KEYS = ("gpt_checkpoint", "dataset.bpe_model", "s2mel_checkpoint", "w2v_stat", "emo_matrix", "spk_matrix")
# infer_v2_5 opens these beside the config's files; its tokenizer and codec names are fixed, not config keys.
MODEL_FILE_KEYS_25 = ("gpt_checkpoint", "s2mel_checkpoint", "w2v_stat", "emo_matrix", "spk_matrix")
MODEL_FILES_25 = ("codec.pth", "multilingual_zh_ja_yue_char_del.tiktoken")
INDEXTTS25 = "indextts25"


def install_help(problem: str, indextts_dir: Path | None, product: str = "IndexTTS2") -> str:
    where = f"under --indextts-dir {indextts_dir}" if indextts_dir else f"in this Python ({sys.executable})"
    return (f"{product} cannot be imported {where}: {problem}.\n"
            f"  Install it into this Python: git clone {REPOSITORY} && pip install -e ./index-tts "
            "(its requirements come with it; pass --indextts-dir ./index-tts to use a checkout without installing)\n"
            f"  --model-dir needs its checkpoints folder ({MODELS}): config.yaml, gpt.pth, bpe.model, s2mel.pth, "
            "wav2vec2bert_stats.pt, feat1.pt, feat2.pt (or an indextts-export folder with those linked in); "
            "IndexTTS2 fetches w2v-BERT 2.0, the MaskGCT semantic codec, CAMPPlus and BigVGAN on first use")


@dataclass
class Upstream:
    """The imported inference module and the audio library it uses."""

    infer_v2: ModuleType
    torchaudio: ModuleType


def import_upstream(indextts_dir: Path | None, family: str = "indextts2") -> Upstream:
    """import_inference for the model family, with the torchaudio it calls."""
    name, product = ("infer_v2_5", "IndexTTS-2.5") if family == INDEXTTS25 else ("infer_v2", "IndexTTS2")
    module = import_inference(indextts_dir, name, product)
    return Upstream(module, module_global(module, "torchaudio", indextts_dir))


def import_inference(indextts_dir: Path | None, name: str, product: str) -> ModuleType:
    """indextts.<name> (infer_v2 for IndexTTS2, infer_v2_5 for IndexTTS-2.5) of the user's installation: from
    `indextts_dir` (a checkout's root or its indextts/ folder) or the installed package. The module must define
    the class IndexTTS2 (both versions name their pipeline so); a UserError with the install instructions, naming
    `product`, when it or a module it needs cannot be imported."""
    if indextts_dir is not None:
        if not indextts_dir.is_dir():
            raise UserError(install_help(f"no such folder {indextts_dir}", indextts_dir, product))
        root = indextts_dir.parent if (indextts_dir / f"{name}.py").is_file() else indextts_dir
        if not (root / "indextts" / f"{name}.py").is_file():
            raise UserError(install_help(f"{root} holds no indextts/{name}.py (not an {product} checkout)",
                                         indextts_dir, product))
    try:
        if indextts_dir is not None:
            _load_package("indextts", root)
        module = importlib.import_module(f"indextts.{name}")
    except ModuleNotFoundError as exc:
        missing = exc.name or str(exc)
        what = "no module named 'indextts'" if missing.split(".")[0] == "indextts" else \
            f"the module '{missing}' it needs is missing ({product}'s requirements are not installed)"
        raise UserError(install_help(what, indextts_dir, product)) from None
    except Exception as exc:  # a broken install: a compiled extension that does not load, a syntax error
        raise UserError(install_help(f"importing it failed ({type(exc).__name__}: {exc})", indextts_dir,
                                     product)) from None
    if not hasattr(module, "IndexTTS2"):
        raise UserError(install_help(f"{module.__file__} has no IndexTTS2 class (IndexTTS 1.x?)", indextts_dir,
                                     product))
    return module


def module_global(module: ModuleType, name: str, indextts_dir: Path | None) -> ModuleType:
    """A library the inference module imported (torchaudio, librosa): the one inference itself calls."""
    found = getattr(module, name, None)
    if found is None:
        try:
            found = importlib.import_module(name)
        except ModuleNotFoundError:
            raise UserError(install_help(f"the module '{name}' it needs is missing (IndexTTS's requirements are "
                                         "not installed)", indextts_dir)) from None
    return found


def _load_package(name: str, root: Path) -> None:
    """Import package `name` from the folder `root` alone (its submodules follow from the package's
    own path), leaving the import path of this process as it is."""
    spec = importlib.machinery.PathFinder.find_spec(name, [str(root)])
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no module named {name!r} in {root}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def config_family(model_dir: Path) -> str:
    """The model family of --model-dir's config.yaml ("indextts2" when it cannot be read: read_model_dir says why)."""
    from trainers.families import family_for_config

    try:
        data = yaml.safe_load((model_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return "indextts2"
    return family_for_config(data).name if isinstance(data, dict) else "indextts2"


def read_model_dir(model_dir: Path) -> dict[str, Any]:
    """--model-dir's config.yaml, checked for the keys and files the pipeline opens (those of its model family's
    inference); UserError naming what lacks."""
    from trainers.families import family_for_config

    config = model_dir / "config.yaml"
    if not config.is_file():
        raise UserError(f"--model-dir {model_dir} has no config.yaml: pass IndexTTS2's checkpoints folder ({MODELS}) "
                        "or an indextts-export folder with the other model files linked in")
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{config} cannot be read as YAML ({' '.join(str(exc).split())})") from None
    data = data if isinstance(data, dict) else {}
    family = family_for_config(data)
    name, models = family.inference_name, MODELS_25 if family.name == INDEXTTS25 else MODELS
    missing = missing_inference_keys(data, family.inference_keys)
    if missing:
        raise UserError(f"{config} lacks the keys {name} inference reads: {', '.join(missing)}; use the full "
                        f"config.yaml of {name}'s checkpoints folder (a trimmed training config cannot drive it)")
    keys, fixed = (MODEL_FILE_KEYS_25, MODEL_FILES_25) if family.name == INDEXTTS25 else (MODEL_FILE_KEYS, ())
    absent = [f"{key}: {value_at(data, key)}" for key in keys if not (model_dir / str(value_at(data, key))).exists()]
    absent += [f for f in fixed if not (model_dir / f).exists()]
    if absent:
        raise UserError(f"--model-dir {model_dir} lacks files its config.yaml names ({'; '.join(absent)}); copy or "
                        f"link them from {name}'s checkpoints folder ({models})")
    return data


def exported_step(model_dir: Path) -> int | None:
    """The training step of the gpt.pth in `model_dir` when indextts-export wrote it, else None."""
    try:
        step = json.loads((model_dir / "export.json").read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def load_pipeline(upstream: Upstream, model_dir: Path, device: str | None) -> Any:
    """upstream's IndexTTS2 for `model_dir`, in fp32, without the text-to-emotion model where it allows."""
    cls = upstream.infer_v2.IndexTTS2
    accepted = inspect.signature(cls).parameters
    options = {"use_fp16": False, "use_bf16": False, "use_cuda_kernel": False, "device": device,
               "use_qwen_emo": False}
    kwargs = {k: v for k, v in options.items() if k in accepted}
    try:
        return cls(cfg_path=str(model_dir / "config.yaml"), model_dir=str(model_dir), **kwargs)
    except Exception as exc:  # upstream's loaders raise many types; each means the models could not load
        raise UserError(f"IndexTTS2 could not load the models of --model-dir {model_dir} ({type(exc).__name__}: "
                        f"{exc}); check the files listed in its config.yaml ({MODELS})") from None


@dataclass
class Voice:
    """What the s2mel model takes from the voice prompt, computed once for every sample."""

    prompt_condition: Any  # tensors on the pipeline's device
    ref_mel: Any
    style: Any


def prompt_voice(upstream: Upstream, tts: Any, audio: Path, family: str = "indextts2") -> Voice:
    """The prompt audio's condition, mel and style embedding, made by upstream's models as its inference makes
    them. IndexTTS2: the condition from the codec-quantized w2v-BERT features. IndexTTS-2.5 (infer_v2_5): from the
    features themselves, and CAMPPlus on the clip loaded and resampled a second time."""
    import torch

    ta = upstream.torchaudio
    v25 = family == INDEXTTS25
    try:
        wav, rate = tts._load_and_cut_audio(str(audio), PROMPT_SECONDS, False)
        again = tts._load_and_cut_audio(str(audio), PROMPT_SECONDS, False)[0] if v25 else None
    except Exception as exc:
        raise UserError(f"--prompt-audio {audio} cannot be read as audio ({type(exc).__name__}: {exc})") from None
    with torch.no_grad():
        wav_22k = ta.transforms.Resample(rate, SAMPLE_RATE)(wav)
        wav_16k = ta.transforms.Resample(rate, 16000)(wav)
        inputs = tts.extract_features(wav_16k, sampling_rate=16000, return_tensors="pt")
        features = tts.get_emb(inputs["input_features"].to(tts.device), inputs["attention_mask"].to(tts.device))
        semantic = features if v25 else tts.semantic_codec.quantize(features)[1]
        ref_mel = tts.mel_fn(wav_22k.to(features.device).float())
        campplus_16k = ta.transforms.Resample(rate, 16000)(again) if v25 else wav_16k
        fbank = ta.compliance.kaldi.fbank(campplus_16k.to(ref_mel.device), num_mel_bins=80, dither=0,
                                          sample_frequency=16000)
        style = tts.campplus_model((fbank - fbank.mean(dim=0, keepdim=True)).unsqueeze(0))
        frames = torch.LongTensor([ref_mel.size(2)]).to(ref_mel.device)
        condition = tts.s2mel.models["length_regulator"](semantic, ylens=frames, n_quantizers=3, f0=None)[0]
    return Voice(condition, ref_mel, style)


def gpt_latent(tts: Any, text_ids: np.ndarray, codes: np.ndarray, condition: np.ndarray, emo_vec: np.ndarray) -> Any:
    """The GPT's latent of the codes [1, M, D]: upstream's forward over the text and codes (as infer_v2 calls
    it after generating) on the sample's own conditioning latent and emotion vector."""
    import torch

    dev = tts.device
    text = torch.as_tensor(np.asarray(text_ids), dtype=torch.int32, device=dev).unsqueeze(0)
    code = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=dev).unsqueeze(0)
    with torch.no_grad():
        # emo_vec given: upstream's forward skips the emotion encoder, so its audio-feature input is unused.
        return tts.gpt(torch.as_tensor(condition, device=dev).unsqueeze(0), text,
                       torch.tensor([text.shape[1]], device=dev), code, torch.tensor([code.shape[1]], device=dev),
                       None, emo_vec=torch.as_tensor(emo_vec, device=dev).unsqueeze(0),
                       use_speed=torch.zeros(1, dtype=torch.long, device=dev))


def render_codes(tts: Any, voice: Voice, text_ids: np.ndarray, codes: np.ndarray, condition: np.ndarray,
                 emo_vec: np.ndarray) -> np.ndarray:
    """One sample's waveform (floats, about [-1, 1], at SAMPLE_RATE) from its codes, text and conditioning."""
    import torch

    dev = tts.device
    latent = gpt_latent(tts, text_ids, codes, condition, emo_vec)
    code = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=dev).unsqueeze(0)
    code_lens = torch.tensor([code.shape[1]], device=dev)
    with torch.no_grad():
        semantic = tts.semantic_codec.quantizer.vq2emb(code.unsqueeze(1)).transpose(1, 2)
        semantic = semantic + tts.s2mel.models["gpt_layer"](latent)
        return _waveform(tts, voice, semantic, (code_lens * FRAMES_PER_CODE).long())


def render_codes_25(tts: Any, voice: Voice, codes: np.ndarray) -> np.ndarray:
    """One sample's waveform (floats, about [-1, 1], at SAMPLE_RATE) from its 25 Hz codes, as infer_v2_5 renders
    generated codes: the codec decodes them to 50 Hz features, 1.72 mel frames per feature frame."""
    import torch

    dev = tts.device
    code = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=dev).unsqueeze(0)
    with torch.no_grad():
        semantic = tts.semantic_codec.decode(code)
        return _waveform(tts, voice, semantic, torch.LongTensor([int(semantic.shape[1] * FRAMES_PER_CODE)]).to(dev))


def _waveform(tts: Any, voice: Voice, semantic: Any, lengths: Any) -> np.ndarray:
    """The waveform of semantic features stretched to `lengths` mel frames, spoken after the voice's prompt (under
    no_grad)."""
    import torch

    models = tts.s2mel.models
    cond = models["length_regulator"](semantic, ylens=lengths, n_quantizers=3, f0=None)[0]
    both = torch.cat([voice.prompt_condition, cond], dim=1)
    mel = models["cfm"].inference(both, torch.LongTensor([both.size(1)]).to(tts.device), voice.ref_mel, voice.style,
                                  None, DIFFUSION_STEPS, inference_cfg_rate=CFG_RATE)
    wav = tts.bigvgan(mel[:, :, voice.ref_mel.size(-1):].float()).squeeze()
    return wav.detach().float().cpu().numpy().reshape(-1)
