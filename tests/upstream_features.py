"""Upstream's real feature models, tiny and randomly initialised, for indextts-prepare's upstream backends
(trainers/tools/prepare/upstream*.py), and upstream's inference path to compare them with.

Where the code comes from (tests/upstream_models.py fetches each pinned wheel):
- IndexTTS2 (2.0): the indextts2-cli 1.0.2 wheel's whole `indextts` package is the "checkout" passed as
  --indextts-dir: its infer_v2.py, UnifiedVoice, maskgct_utils (RepCodec), TextNormalizer/TextTokenizer.
- IndexTTS-2.5: no installable package carries upstream v2.5.0's infer_v2_5.py. `checkout_25` writes a folder
  whose indextts/infer_v2_5.py binds the names upstream's module holds (the only thing the backend reads from
  it) to upstream-derived code of the two wheels: indextts25-inference 0.2.0's campplus UnifiedVoice, CAMPPlus,
  TextNormalizer, tokenizer, nemo/Japanese front ends and apply_pronunciation_annotations; and for EnhancedCodec
  (indextts25-inference carries only its decoding half) indextts2-cli's RepCodec built with downsample_scale 2,
  whose constructor and quantize are line for line upstream v2.5.0's EnhancedCodec's (codec/models.py against
  kmeans/repcodec_model.py; vocos.py and the quantizers are the same files but for import paths).
  The reference path for 2.5 is indextts25-inference's own inference methods, a rewrite of upstream's.
- torchaudio: the 2.8.0 wheel's Python code (its Resample and Kaldi fbank are plain torch), what the inference
  modules call; it equals indextts25-inference's reimplementation bit for bit (tests/test_prepare_upstream.py).
- Stood in for (never the features' code): librosa.load reads 16-bit WAV files and resamples with torchaudio's
  Resample (real librosa resamples with soxr; the test clips are written at 22,050 Hz, librosa's rate, so only
  inference's separate 16 kHz emotion load goes through it); WeTextProcessing's normalisers spell out digits
  (the real grammars take minutes to build); nemo and fugashi are not reached (English and Chinese text only);
  omegaconf, modelscope, json5, scipy, munch are imported by upstream modules but not called here.

Sizes: w2v-BERT 2.0 at its real width (1024: upstream's conformers take that input) with 18 layers (layer 17 is
read; the 18th shows that the backend's 17-layer build changes nothing) and a 2-wide feed-forward; the codecs,
GPTs and conformers a few units wide; CAMPPlus at its only size (upstream builds it without arguments). Built once
under .upstream/ (git-ignored) and reused.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import math
import shutil
import sys
import tempfile
import types
import wave
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import yaml

from tests.demo_runs import INFERENCE_SECTIONS
from tests.upstream_models import (
    CACHE, TORCHAUDIO, UPSTREAM_V2_CODE, UPSTREAM_V25_CODE, fetched, locked,
)

MODELS = CACHE / "prepare-models-2"  # bump when the tiny models change
TEST_RATE = 22050  # librosa's default rate: clips written at it are loaded as they are
W2V_REV = "0" * 40  # the hub cache's snapshot name
ENCODER = {"output_size": 16, "linear_units": 16, "attention_heads": 2, "num_blocks": 1, "input_layer": "conv2d2",
           "perceiver_mult": 2}
GPT = {"model_dim": 32, "max_mel_tokens": 150, "max_text_tokens": 48, "heads": 2, "use_mel_codes_as_input": True,
       "mel_length_compression": 1024, "layers": 1, "number_text_tokens": 160, "number_mel_codes": 130,
       "start_mel_token": 128, "stop_mel_token": 129, "start_text_token": 0, "stop_text_token": 1,
       "train_solo_embeddings": False, "condition_type": "conformer_perceiver", "condition_module": ENCODER,
       "emo_condition_module": ENCODER}
GPT25 = {**GPT, "number_text_tokens": 2400}  # the 2.5 demo's tiktoken file: 727 ranks + 1673 special tokens
CODEC = {"codebook_size": 128, "hidden_size": 1024, "codebook_dim": 8, "vocos_dim": 16, "vocos_intermediate_dim": 16,
         "vocos_num_layers": 1}
W2V = {"num_hidden_layers": 18, "intermediate_size": 2, "hidden_size": 1024}
# facebook/w2v-bert-2.0's preprocessor_config.json
PREPROCESSOR = {"feature_extractor_type": "SeamlessM4TFeatureExtractor", "feature_size": 80, "num_mel_bins": 80,
                "padding_side": "right", "padding_value": 1, "processor_class": "Wav2Vec2BertProcessor",
                "return_attention_mask": True, "sampling_rate": 16000, "stride": 2}
STAND_IN_NAMES = ("librosa", "torchaudio", "omegaconf", "modelscope", "json5", "scipy", "munch", "tn", "wetext",
                  "nemo_text_processing", "fugashi", "whisper")


# ------------------------------------------------------------------------------------------------ stand-ins

def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


class NotCalled:
    """A name an upstream module imports but the tests never reach: calling it fails loudly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("a stand-in that the tests never call was called")


def read_wav(path: str) -> tuple[np.ndarray, int]:
    with wave.open(path, "rb") as f:
        assert f.getsampwidth() == 2, "the librosa stand-in reads 16-bit PCM only"
        data = np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768.0
        return data.reshape(-1, f.getnchannels()).mean(axis=1).astype(np.float32), f.getframerate()


def write_wav(path: Path, wave_: np.ndarray, rate: int = TEST_RATE) -> Path:
    pcm = np.clip(np.round(np.asarray(wave_) * 32768.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return path


def librosa_stand_in(torchaudio: types.ModuleType) -> dict[str, types.ModuleType]:
    def load(path: str, sr: int | None = TEST_RATE, mono: bool = True) -> tuple[np.ndarray, int]:
        data, rate = read_wav(path)
        if sr is None or sr == rate:
            return data, rate
        return torchaudio.transforms.Resample(rate, sr)(torch.from_numpy(data)).numpy(), sr

    def get_samplerate(path: str) -> int:
        with wave.open(path, "rb") as f:
            return f.getframerate()

    return {"librosa": _module("librosa", load=load, get_samplerate=get_samplerate, __path__=[]),
            "librosa.filters": _module("librosa.filters", mel=NotCalled),
            "librosa.util": _module("librosa.util", normalize=NotCalled)}


class DigitNormalizer:
    """Stands in for WeTextProcessing's zh/en Normalizer: writes each digit d as the demo's word d (the tiny
    tokenizers know those words), so a test sees whether normalisation ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def normalize(self, text: str) -> str:
        from trainers.data.demo_corpus import WORDS

        return "".join(f" {WORDS[int(c)]} " if c.isdigit() else c for c in text)


def torchaudio_code() -> dict[str, types.ModuleType]:
    """torchaudio as its 2.8.0 wheel's Python files, with its compiled extension answered as absent."""
    root = fetched(TORCHAUDIO)
    package = _module("torchaudio", __path__=[str(root / "torchaudio")])
    package.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None, is_package=True)

    def absent(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return False if name.startswith("_IS_") else (lambda f=None, *a, **k: f)

    extension = _module("torchaudio._extension", __getattr__=absent)
    return {"torchaudio": package, "torchaudio._extension": extension}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # a module in sys.modules without a spec: not an installation
        return False


# Stood in only where not installed: transformers imports scipy.optimize whenever scipy's metadata is there (a
# machine with scipy installed failed every subprocess prepare against a bare stand-in); the real one does.
REAL_WHEN_INSTALLED = ("scipy",)


def _ours(name: str, real: frozenset[str] = frozenset()) -> bool:
    top = name.split(".")[0]
    return (top in STAND_IN_NAMES and top not in real) or top in ("indextts", "indextts25")


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """Upstream's imports answered (see the module docstring) while the block runs; afterwards sys.modules is as
    it was (tests/test_render_samples.py puts its own fakes there)."""
    importlib.import_module("transformers")  # first: it probes for torchaudio at import
    real = frozenset(n for n in REAL_WHEN_INSTALLED if _installed(n))
    saved = {n: m for n, m in sys.modules.items() if _ours(n, real)}
    for n in saved:
        del sys.modules[n]
    modules = torchaudio_code()
    sys.modules.update(modules)
    torchaudio = importlib.import_module("torchaudio")
    importlib.import_module("torchaudio.compliance.kaldi")
    importlib.import_module("torchaudio.transforms")
    torchaudio.transforms = sys.modules["torchaudio.transforms"]
    torchaudio.compliance = sys.modules["torchaudio.compliance"]
    sys.modules.update(librosa_stand_in(torchaudio))
    simple = {
        "omegaconf": _module("omegaconf", OmegaConf=NotCalled),
        "modelscope": _module("modelscope", AutoModelForCausalLM=NotCalled),
        "json5": _module("json5", loads=NotCalled),
        "munch": _module("munch", Munch=NotCalled),
        "tn": _module("tn", __path__=[]), "tn.chinese": _module("tn.chinese", __path__=[]),
        "tn.english": _module("tn.english", __path__=[]),
        "tn.chinese.normalizer": _module("tn.chinese.normalizer", Normalizer=DigitNormalizer),
        "tn.english.normalizer": _module("tn.english.normalizer", Normalizer=DigitNormalizer),
        "scipy": _module("scipy", __path__=[]), "scipy.io": _module("scipy.io", __path__=[]),
        "scipy.io.wavfile": _module("scipy.io.wavfile", read=NotCalled, write=NotCalled),
    }
    sys.modules.update({n: m for n, m in simple.items() if _ours(n, real)})  # not over REAL_WHEN_INSTALLED ones
    try:
        yield
    finally:
        for n in [n for n in sys.modules if _ours(n, real)]:
            del sys.modules[n]
        sys.modules.update(saved)


def bare_package(root: Path, name: str) -> None:
    """`name` importable from `root/name` without running its __init__ (indextts25's imports everything)."""
    package = _module(name, __path__=[str(root / name)])
    package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = package


# ------------------------------------------------------------------------------------------------ installations

def checkout_20() -> Path:
    """indextts2-cli's whole package: the --indextts-dir of an IndexTTS2 installation (import it in stand_ins())."""
    return fetched(UPSTREAM_V2_CODE)


CHECKOUT_25 = '''"""TEST DOUBLE of upstream IndexTTS v2.5.0's indextts/infer_v2_5.py (tests/upstream_features.py):
the names its namespace holds, bound to upstream-derived code of the pinned wheels. Not upstream's file."""
from tests.upstream_features import namespace_25

globals().update(namespace_25())
'''


def checkout_25() -> Path:
    """A folder holding indextts/infer_v2_5.py (the test double above): the --indextts-dir of IndexTTS-2.5."""
    folder = CACHE / "prepare-checkout-25-1"
    if not (folder / "indextts" / "infer_v2_5.py").is_file():
        (folder / "indextts").mkdir(parents=True, exist_ok=True)
        (folder / "indextts" / "__init__.py").write_text("")
        (folder / "indextts" / "infer_v2_5.py").write_text(CHECKOUT_25)
    return folder


def _import_from(root: Path, package: str, module: str) -> Any:
    """package.module of the wheel folder `root`, with `package` bare; the caller restores sys.modules."""
    bare_package(root, package)
    return importlib.import_module(f"{package}.{module}")


def enhanced_codec_class() -> type:
    """upstream v2.5.0's EnhancedCodec as far as preprocessing runs it: indextts2-cli's RepCodec with the
    downsample_scale default of 2 (see the module docstring)."""
    repcodec = _wheel_module(UPSTREAM_V2_CODE, "indextts", "utils.maskgct.models.codec.kmeans.repcodec_model").RepCodec

    class EnhancedCodec(repcodec):
        def __init__(self, *args: Any, downsample_scale: int = 2, **kwargs: Any) -> None:
            super().__init__(*args, downsample_scale=downsample_scale, **kwargs)

    return EnhancedCodec


def _wheel_module(wheel: Any, package: str, module: str) -> Any:
    """A module of a wheel's package imported under its own name and then taken out of sys.modules again (the
    objects stay usable), so two packages named `indextts` never meet."""
    saved = {n: m for n, m in sys.modules.items() if n == package or n.startswith(package + ".")}
    for n in saved:
        del sys.modules[n]
    try:
        return _import_from(fetched(wheel), package, module)
    finally:
        for n in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[n]
        sys.modules.update(saved)


def namespace_25() -> dict[str, Any]:
    """What the backend reads from upstream's infer_v2_5 module, from the wheels (inside stand_ins())."""
    from transformers import SeamlessM4TFeatureExtractor, Wav2Vec2BertModel

    codec = enhanced_codec_class()
    root = fetched(UPSTREAM_V25_CODE)
    bare_package(root, "indextts25")
    infer = importlib.import_module("indextts25.infer_v2_5")
    tokenizer = importlib.import_module("indextts25.utils.tokenizer")

    def get_tokenizer(multilingual: bool, model_dir: str = "checkpoints", **_: Any) -> Any:
        # upstream's wraps the same tiktoken encoding in whisper's Tokenizer, whose encode is the encoding's
        assert multilingual
        return tokenizer.get_encoding("multilingual_zh_ja_yue_char_del", model_dir=model_dir)

    return {"IndexTTS2": infer.IndexTTS2, "UnifiedVoice": infer.UnifiedVoice, "CAMPPlus": infer.CAMPPlus,
            "EnhancedCodec": codec, "get_tokenizer": get_tokenizer, "lang_to_token": infer.lang_to_token,
            "TextNormalizer": infer.TextNormalizer, "nemo_text_normalize": infer.nemo_text_normalize,
            "JapaneseG2PProcessor": infer.JapaneseG2PProcessor,
            "apply_pronunciation_annotations": infer.apply_pronunciation_annotations,
            "SeamlessM4TFeatureExtractor": SeamlessM4TFeatureExtractor, "Wav2Vec2BertModel": Wav2Vec2BertModel,
            "librosa": sys.modules["librosa"], "torchaudio": sys.modules["torchaudio"], "torch": torch}


def checkout(family: str) -> Path:
    return checkout_25() if family == "indextts25" else checkout_20()


# ------------------------------------------------------------------------------------------------ tiny models

def model_dir(family: str) -> Path:
    """The tiny checkpoints folder of `family` in the official layout, built on first use."""
    folder = MODELS / family
    if (folder / "COMPLETE").is_file():
        return folder
    with locked(CACHE / "prepare-models.lock"):
        if not (folder / "COMPLETE").is_file():
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                built = Path(tmp) / family
                with stand_ins():
                    (_build_25 if family == "indextts25" else _build_20)(built)
                (built / "COMPLETE").write_text("tiny random models for tests/upstream_features.py\n")
                shutil.rmtree(folder, ignore_errors=True)
                folder.parent.mkdir(parents=True, exist_ok=True)
                built.rename(folder)
    return folder


def _config(folder: Path, gpt: dict[str, Any], version: str) -> None:
    sections = yaml.safe_load(INFERENCE_SECTIONS.read_text(encoding="utf-8"))
    data = {"dataset": sections.pop("dataset"), "gpt": gpt, **sections, "semantic_codec": CODEC, "version": version}
    if version == "2.5":
        del data["dataset"]  # 2.5's config has no bpe_model
    (folder / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def _w2v(folder: Path) -> None:
    """The tiny w2v-BERT 2.0 and its preprocessor config in `folder`: hard links to one copy for both families
    (stored in float16, 250 MB; from_pretrained loads it as float32, as the real model's weights are)."""
    shared = MODELS / "w2v-bert-2.0"
    if not (shared / "COMPLETE").is_file():
        from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

        shutil.rmtree(shared, ignore_errors=True)
        torch.manual_seed(17)
        Wav2Vec2BertModel(Wav2Vec2BertConfig(**W2V)).half().save_pretrained(str(shared), safe_serialization=True)
        (shared / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
        (shared / "COMPLETE").write_text("")
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        (folder / name).hardlink_to(shared / name)


def _stats(path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    torch.save({"mean": 0.1 * torch.randn(1024, generator=g), "var": 0.5 + torch.rand(1024, generator=g)}, path)


def _build_20(folder: Path) -> None:
    from safetensors.torch import save_file

    from trainers.tools.prepare.upstream_common import ConfigSection

    folder.mkdir(parents=True)
    _config(folder, GPT, "2.0")
    from trainers.data.demo_corpus import _sentence, _train_tokenizer, front_end

    rng = np.random.default_rng(0)
    sentences = [front_end(_sentence(rng)) for _ in range(400)]  # the demo's: upper-cased, as IndexTTS2 tokenises
    (folder / "bpe.model").write_bytes(_train_tokenizer(sentences, GPT["number_text_tokens"]))
    _stats(folder / "wav2vec2bert_stats.pt")
    bare_package(checkout_20(), "indextts")
    gpt_module = importlib.import_module("indextts.gpt.model_v2")
    maskgct = importlib.import_module("indextts.utils.maskgct_utils")
    torch.manual_seed(20)
    torch.save(gpt_module.UnifiedVoice(**GPT).state_dict(), folder / "gpt.pth")
    cache = folder / "hf_cache"
    w2v = cache / "models--facebook--w2v-bert-2.0"
    _w2v(w2v / "snapshots" / W2V_REV)
    codec = cache / "models--amphion--MaskGCT"
    (codec / "snapshots" / W2V_REV / "semantic_codec").mkdir(parents=True)
    save_file(maskgct.build_semantic_codec(ConfigSection(CODEC)).state_dict(),
              str(codec / "snapshots" / W2V_REV / "semantic_codec" / "model.safetensors"))
    for repo in (w2v, codec):
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(W2V_REV)


def _build_25(folder: Path) -> None:
    from tests.upstream_gpt import campplus_model
    from trainers.families.indextts25.demo import tiktoken_file

    folder.mkdir(parents=True)
    _config(folder, GPT25, "2.5")
    (folder / "multilingual_zh_ja_yue_char_del.tiktoken").write_bytes(tiktoken_file(GPT25["number_text_tokens"]))
    _stats(folder / "wav2vec2bert_stats.pt")
    names = namespace_25()
    torch.manual_seed(25)
    torch.save(campplus_model(GPT25).state_dict(), folder / "gpt.pth")
    torch.save({"model": names["EnhancedCodec"](**CODEC).state_dict()}, folder / "codec.pth")
    _w2v(folder / "hf_cache" / "w2v-bert-2.0")
    torch.manual_seed(192)
    torch.save(names["CAMPPlus"](feat_dim=80, embedding_size=192).state_dict(),
               folder / "hf_cache" / "campplus_cn_common.bin")


# ------------------------------------------------------------------------------------------------ audio

def voice(seconds: float, seed: int, rate: int = TEST_RATE) -> np.ndarray:
    """A voice-like test clip: a few harmonics with a wandering pitch, syllable-like bursts and a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = 110 + 60 * rng.random() + 20 * np.sin(2 * np.pi * rng.uniform(0.5, 2.0) * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    tone = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(3, 6) * t) ** 2
    return (0.2 * tone * envelope + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


# ------------------------------------------------------------------------------------------------ backends

def open_backend(family: str, **request: Any) -> Any:
    """The upstream backend of `family` on the tiny models (inside stand_ins() while it imports)."""
    from trainers.tools.prepare.backend import BackendRequest
    from trainers.tools.prepare.upstream import make_backend

    folder = model_dir(family)
    with stand_ins():
        return make_backend(BackendRequest(family, folder / "config.yaml", folder, checkout(family), **request))


# ------------------------------------------------------------------------------------------------ reference

class Stop(Exception):
    """Raised where inference goes on to the s2mel model: what preprocessing needs is computed by then."""


def reference_20(folder: Path, audios: list[Path], text: str) -> list[dict[str, Any]]:
    """Upstream's own IndexTTS2.infer (indextts2-cli's infer_v2.py) on each of `audios` with `text` and the tiny
    models, recording what it computes on the way: the text ids it hands the GPT, the codes of the prompt's
    features (the first value of its semantic_codec.quantize), the conditioning latent get_conditioning gives
    inference_speech, and the emotion vector merge_emovec gives. The s2mel model is where it stops."""
    from huggingface_hub import hf_hub_download
    from safetensors.torch import load_model
    from transformers import SeamlessM4TFeatureExtractor, Wav2Vec2BertModel

    from trainers.tools.prepare.upstream_common import ConfigSection

    cfg = ConfigSection(yaml.safe_load((folder / "config.yaml").read_text()))
    cache = str(folder / "hf_cache")
    with stand_ins():
        bare_package(checkout_20(), "indextts")  # infer_v2 itself: its real imports, on the stand-ins
        infer = importlib.import_module("indextts.infer_v2")
        tts = infer.IndexTTS2.__new__(infer.IndexTTS2)  # its __init__ also loads s2mel, BigVGAN, Qwen: skipped
        tts.device, tts.dtype, tts.stop_mel_token, tts.gr_progress = "cpu", None, cfg.gpt.stop_mel_token, None
        tts.cache_spk_cond = tts.cache_emo_cond = None
        tts.gpt = infer.UnifiedVoice(**cfg.gpt)
        infer.load_checkpoint(tts.gpt, str(folder / "gpt.pth"))
        tts.gpt.eval().post_init_gpt2_config(kv_cache=True)
        hub = {"cache_dir": cache, "local_files_only": True}  # what HF_HUB_CACHE=checkpoints/hf_cache finds
        tts.extract_features = SeamlessM4TFeatureExtractor.from_pretrained("facebook/w2v-bert-2.0", **hub)
        tts.semantic_model = Wav2Vec2BertModel.from_pretrained("facebook/w2v-bert-2.0", **hub).eval()
        stats = torch.load(folder / cfg.w2v_stat)
        tts.semantic_mean, tts.semantic_std = stats["mean"], torch.sqrt(stats["var"])
        tts.semantic_codec = infer.build_semantic_codec(cfg.semantic_codec)
        load_model(tts.semantic_codec, hf_hub_download("amphion/MaskGCT", "semantic_codec/model.safetensors", **hub))
        tts.semantic_codec.eval()
        normalizer = infer.TextNormalizer(enable_glossary=True)
        normalizer.load()
        tts.tokenizer = infer.TextTokenizer(str(folder / cfg.dataset["bpe_model"]), normalizer)
        tts.mel_fn = lambda wav: torch.zeros(1, 80, wav.shape[-1] // 256)
        tts.campplus_model = lambda feat: torch.zeros(1, 192)  # s2mel's style: not a GPT input in 2.0
        seen: dict[str, Any] = {}

        def gpt_layer(*_: Any) -> None:
            raise Stop

        tts.s2mel = types.SimpleNamespace(models={"length_regulator": lambda x, **_: (x,), "gpt_layer": gpt_layer})
        _record(tts.semantic_codec, "quantize", seen, "codes", lambda out: out[0][0])
        _record(tts.gpt, "get_conditioning", seen, "condition", lambda out: out[0])
        _record(tts.gpt, "merge_emovec", seen, "emo_vec", lambda out: out[0])
        _record(tts.gpt, "inference_speech", seen, "text_ids", lambda out: None,
                args=lambda a, k: a[1][0].tolist())
        results = []
        for audio in audios:  # a new prompt each time: infer recomputes its conditioning
            seen.clear()
            with pytest.raises(Stop), torch.no_grad():
                tts.infer(str(audio), text, None, max_mel_tokens=2, num_beams=1)
            results.append(dict(seen))
    return results


def _record(obj: Any, name: str, seen: dict[str, Any], key: str, pick: Any, args: Any = None) -> None:
    """obj.name wrapped: `seen[key]` gets pick(its output), or args(its arguments) when given."""
    original = getattr(obj, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        out = original(*a, **k)
        if key not in seen:
            seen[key] = args(a, k) if args else pick(out)
        return out

    setattr(obj, name, wrapped)


def reference_25(folder: Path, audios: list[Path], text: str, lang: str) -> list[dict[str, Any]]:
    """indextts25-inference's own inference methods (its IndexTTS2's _speaker_conditioning,
    _emotion_conditioning, _prepare_text, the tokenizer call and merge_emovec of its infer_generator) on each of
    `audios` with the tiny models; codes by EnhancedCodec.quantize of the speaker features (upstream's get_scode)."""
    from safetensors import safe_open
    from transformers import SeamlessM4TFeatureExtractor, Wav2Vec2BertModel

    from trainers.tools.prepare.upstream_common import ConfigSection

    cfg = ConfigSection(yaml.safe_load((folder / "config.yaml").read_text()))
    with stand_ins():
        names = namespace_25()
        infer = sys.modules["indextts25.infer_v2_5"]
        tts = infer.IndexTTS2.__new__(infer.IndexTTS2)  # its __init__ also loads s2mel, BigVGAN: skipped
        tts.device, tts.dtype, tts._spk_cache, tts._emo_cache, tts._ja_text_process = "cpu", None, {}, {}, None
        tts.gpt = names["UnifiedVoice"](**cfg.gpt)
        importlib.import_module("indextts25.utils.checkpoint").load_checkpoint(tts.gpt, str(folder / "gpt.pth"))
        tts.gpt.eval()
        w2v = str(folder / "hf_cache" / "w2v-bert-2.0")
        tts.extract_features = SeamlessM4TFeatureExtractor.from_pretrained(w2v, local_files_only=True)
        tts.semantic_model = Wav2Vec2BertModel.from_pretrained(w2v, local_files_only=True).eval()
        with safe_open(str(Path(w2v) / "model.safetensors"), "pt") as f:  # full-size, as upstream builds it
            assert any(k.startswith("encoder.layers.17.") for k in f.keys())
        stats = torch.load(folder / cfg.w2v_stat)
        tts.semantic_mean, tts.semantic_std = stats["mean"], torch.sqrt(stats["var"])
        codec = names["EnhancedCodec"](**cfg.semantic_codec, cfg=cfg.semantic_codec)
        codec.load_state_dict(torch.load(folder / "codec.pth")["model"])
        tts.campplus_model = names["CAMPPlus"](feat_dim=80, embedding_size=192)
        tts.campplus_model.load_state_dict(torch.load(folder / "hf_cache" / "campplus_cn_common.bin"))
        tts.campplus_model.eval()
        tts.tokenizer = names["get_tokenizer"](True, model_dir=str(folder))
        tts.text_process = names["TextNormalizer"](enable_glossary=True)
        tts.mel_fn = lambda wav: torch.zeros(1, 80, wav.shape[-1] // 256)
        tts.s2mel = types.SimpleNamespace(models={"length_regulator": lambda x, **_: (x,)})
        results = []
        for audio in audios:
            with torch.no_grad():
                key = (str(audio), 0)
                spk, style, _, _ = tts._speaker_conditioning(str(audio), key)
                emo = tts._emotion_conditioning(str(audio), key)
                lengths = torch.tensor([spk.shape[-1]])
                emo_vec = tts.gpt.merge_emovec(spk, emo, lengths, torch.tensor([emo.shape[-1]]), alpha=1.0)
                codes = codec.eval().quantize(spk)[0][0]
                prepared = tts._prepare_text(text, lang)
                ids = tts.tokenizer.encode(f"<|{lang}|> " + prepared, allowed_special="all")
            results.append({"codes": codes, "spk_emb": style[0], "emo_vec": emo_vec[0], "text_ids": ids})
    return results


def code_count(samples_22k: int, family: str) -> int:
    """Codes of a clip of that many samples at TEST_RATE, by the feature frame rule (a cross-check)."""
    n = math.ceil(samples_22k * 16000 / TEST_RATE)
    frames = math.ceil((1 + (n - 400) // 160) / 2)
    return math.ceil(frames / 2) if family == "indextts25" else frames
