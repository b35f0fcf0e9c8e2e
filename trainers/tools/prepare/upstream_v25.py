"""IndexTTS-2.5 features by upstream's own code (indextts/infer_v2_5.py's namespace; trainers/tools/prepare/
upstream.py says what is shared and why), in infer_v2_5's order (shared/reference/features.md, section 2):

  text     the punctuation map (TextNormalizer.clean_pattern / char_rep_map), normalisation (TextNormalizer for
           zh, zhen and en; nemo_text_normalize for ja and es; none for others), lower case for ja, zh, zhen, en
           and UPPER for es, apply_pronunciation_annotations, the Japanese morpheme split
           (JapaneseG2PProcessor(g2p_ratio=0)), every <|...|> upper-cased, then the tokenizer's
           encode("<|lang|> " + text, allowed_special="all"); stored without the appended stop and with ids 0
           and 1 dropped, as the trainer keeps them (upstream's model drops them from the content too). Inference
           cuts a long text into segments of 120 tokens; a line is kept whole (up to the config's max_text_tokens)
  codes    EnhancedCodec(**cfg.semantic_codec, cfg=cfg.semantic_codec) from model_dir/codec.pth, .quantize:
           a stride-2 convolution first, so ceil(T / 2) codes for T feature frames (25 Hz)
  spk_emb  CAMPPlus(feat_dim=80, embedding_size=192) from model_dir/hf_cache/campplus_cn_common.bin on the first
           15 s: torchaudio's kaldi.fbank(num_mel_bins=80, dither=0, sample_frequency=16000) less its time mean,
           one clip at a time (its statistics pooling and batch norm would see padding); raw [192], not projected
  emo_vec  gpt.get_emovec on the first 15 s's w2v-BERT features -> [D]

The GPT is upstream's UnifiedVoice(**cfg.gpt, spk_cond_mode="campplus"); upstream loads it non-strictly, so here
every tensor of the emotion branch that runs must come from the file (the rest is not used).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trainers.errors import UserError
from trainers.families.indextts25.features import kept_ids
from trainers.tools.prepare.backend import BackendRequest, Clip, Features, TextIds
from trainers.tools.prepare.upstream_common import (
    Installation, conditioning_features, files_fingerprint, installation_fingerprint, load_clip, load_weights,
    alone, need_file, quantized, to_array, prompt_wave, read_config, semantic_features, state_of, text_normalizer,
    torch_file, w2v_frames,
)

W2V_DIR = "hf_cache/w2v-bert-2.0"  # infer_v2_5: a flat folder, local files only
CAMPPLUS_FILE = "hf_cache/campplus_cn_common.bin"
CODEC_FILE = "codec.pth"
TOKENIZER_FILE = "multilingual_zh_ja_yue_char_del.tiktoken"
EMOTION_BRANCH = ("emo_conditioning_encoder.", "emo_perceiver_encoder.", "emovec_layer.", "emo_layer.")
NORMALISED_BY_TEXT_NORMALIZER = ("zh", "zhen", "en")
NORMALISED_BY_NEMO = ("ja", "es")
LOWER_CASED, UPPER_CASED = ("ja", "zh", "zhen", "en"), ("es",)
_SPECIAL = re.compile(r"<\|([^|]+)\|>")
FETCH = ("run IndexTTS-2.5 inference once with this checkpoints folder (it downloads what hf_cache/ lacks), or "
         "download the IndexTeam/IndexTTS-2.5 release into it")


class IndexTTS25Backend:
    """The FeatureBackend of IndexTTS-2.5 on upstream's code and the official checkpoints."""

    family = "indextts25"
    audio_rate = 16000
    code_rate = 25

    def __init__(self, inst: Installation, request: BackendRequest) -> None:
        import torch

        self.inst, self.device = inst, request.device
        model_dir = request.model_dir
        cfg = read_config(request.config)
        self.files: dict[str, Path] = {"config": request.config}
        tokenizer = request.tokenizer or model_dir / TOKENIZER_FILE
        self.files["tokenizer"] = need_file(tokenizer, "IndexTTS-2.5's tiktoken vocabulary", FETCH)
        # upstream's get_tokenizer reads <model_dir>/<name>: a --tokenizer elsewhere is read from its own folder
        self.tokenizer = inst.get_tokenizer(multilingual=True, model_dir=str(tokenizer.parent))
        self.normalizer = text_normalizer(inst, model_dir, self.files)
        self._japanese: Any = None

        gpt_path = need_file(model_dir / str(cfg.get("gpt_checkpoint", "gpt.pth")), "the GPT checkpoint", FETCH)
        self.files["gpt"] = gpt_path
        with torch.device("cpu"):
            self.gpt = inst.UnifiedVoice(**cfg.gpt, spk_cond_mode="campplus")
        others = tuple({k.split(".")[0] + "." for k in self.gpt.state_dict() if not k.startswith(EMOTION_BRANCH)})
        load_weights(self.gpt, state_of(torch_file(gpt_path, "GPT checkpoint"), gpt_path), gpt_path, may_lack=others,
                     may_add=True)
        self.gpt = self.gpt.to(self.device).eval()

        codec_path = need_file(model_dir / CODEC_FILE, "the semantic codec", FETCH)
        self.files["codec"] = codec_path
        self.codec = inst.EnhancedCodec(**cfg.semantic_codec, cfg=cfg.semantic_codec)
        if not hasattr(self.codec, "quantize"):
            raise UserError(f"{inst.module.__file__}: its EnhancedCodec cannot quantize (a decoding-only "
                            "repackaging): pass an index-tts checkout of 2.5 or later with --indextts-dir")
        # upstream's load_checkpoint keeps a mismatched tensor at its random value with only a warning: refused here
        load_weights(self.codec, state_of(torch_file(codec_path, "semantic codec"), codec_path), codec_path,
                     may_add=True)
        self.codec = self.codec.to(self.device).eval()

        campplus_path = need_file(model_dir / CAMPPLUS_FILE, "CAMPPlus speaker model", FETCH)
        self.files["campplus"] = campplus_path
        self.campplus = inst.CAMPPlus(feat_dim=80, embedding_size=192)
        load_weights(self.campplus, torch_file(campplus_path, "CAMPPlus"), campplus_path)  # strict, as upstream
        self.campplus = self.campplus.to(self.device).eval()
        stats = need_file(model_dir / str(cfg.get("w2v_stat", "wav2vec2bert_stats.pt")), "w2v-BERT statistics", FETCH)
        self.files["w2v stats"] = stats
        w2v = model_dir / W2V_DIR
        self.semantic = semantic_features(inst, w2v, stats, self.device)
        for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
            self.files[f"w2v {name}"] = need_file(w2v / name, "w2v-BERT 2.0", FETCH)

        self._fingerprint = {"family": self.family, **installation_fingerprint(inst), **files_fingerprint(self.files)}

    def fingerprint(self) -> dict[str, str]:
        return dict(self._fingerprint)

    def normalised(self, text: str, language: str) -> str:
        """The text infer_v2_5 encodes after "<|lang|> ", in its order (text_normalization on, its default)."""
        lang = language.lower()
        n = self.normalizer
        text = n.clean_pattern.sub(lambda m: n.char_rep_map[m.group()], text)
        if lang in NORMALISED_BY_TEXT_NORMALIZER:
            text = n.normalize(text)
        elif lang in NORMALISED_BY_NEMO:
            text = self.inst.nemo_text_normalize(text, lang)
        if lang in LOWER_CASED:
            text = text.lower()
        if lang in UPPER_CASED:
            text = text.upper()
        text = self.inst.apply_pronunciation_annotations(text)
        if lang == "ja":
            if self._japanese is None:
                self._japanese = self.inst.JapaneseG2PProcessor(g2p_ratio=0)
            text = self._japanese.process_ja_text(text)
        return _SPECIAL.sub(lambda m: f"<|{m.group(1).upper()}|>", text)

    def text(self, text: str, language: str | None) -> TextIds:
        if not language:
            raise UserError("IndexTTS-2.5 encodes each text with its language token: give the lines a language "
                            "(or a default language)")
        body = self.normalised(text, language)
        ids = self.tokenizer.encode(f"<|{language.lower()}|> " + body, allowed_special="all")
        return TextIds(kept_ids(np.asarray(ids, dtype=np.int32)), 0, body)

    def audio(self, path: Path, clip_id: str) -> Clip:
        return load_clip(self.inst, path, clip_id)

    def code_length(self, samples: int) -> int:
        return math.ceil(w2v_frames(samples) / 2)

    def encode(self, clips: Sequence[Clip]) -> list[Features]:
        import torch

        whole = self.semantic([c.waveform for c in clips])
        prompts = conditioning_features(self.semantic, clips, whole)
        out = []
        with torch.no_grad():
            for clip, feats, prompt in zip(clips, whole, prompts):
                out.append(Features(quantized(self.codec, feats), {
                    "spk_emb": self._speaker(prompt_wave(clip)),
                    "emo_vec": to_array(self.gpt.get_emovec(*alone(prompt))[0])}))
        return out

    def _speaker(self, wave: np.ndarray) -> np.ndarray:
        """CAMPPlus of one 16 kHz clip, as infer_v2_5 computes its style vector."""
        import torch

        wav = torch.as_tensor(np.asarray(wave, dtype=np.float32), device=self.device).unsqueeze(0)
        fbank = self.inst.torchaudio.compliance.kaldi.fbank(wav, num_mel_bins=80, dither=0, sample_frequency=16000)
        style = self.campplus((fbank - fbank.mean(dim=0, keepdim=True)).unsqueeze(0))
        return to_array(style[0])
