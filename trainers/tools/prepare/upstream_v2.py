"""IndexTTS2 (2.0) features by upstream's own code (indextts/infer_v2.py's namespace; trainers/tools/prepare/
upstream.py says what is shared and why), in infer_v2's order (shared/reference/features.md, section 1):

  text       TextNormalizer(enable_glossary=True).load() (+ model_dir/glossary.yaml), TextTokenizer(bpe.model):
             tokenize (normalise, CJK split, upper case, SentencePiece) then convert_tokens_to_ids, no start/stop
  codes      MaskGCT's RepCodec (build_semantic_codec(cfg.semantic_codec), amphion/MaskGCT
             semantic_codec/model.safetensors from model_dir/hf_cache) .quantize, one code per feature frame (50 Hz)
  condition  gpt.get_conditioning on the first 15 s's features -> [32, D]
  emo_vec    gpt.get_emovec on the same -> [D]  (inference's merge_emovec with the prompt as its own emotion
             reference and alpha 1)

The GPT is upstream's UnifiedVoice(**cfg.gpt), loaded strictly from model_dir/<gpt_checkpoint> as 2.0 loads it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from trainers.errors import UserError
from trainers.tools.prepare.backend import BackendRequest, Clip, Features, TextIds
from trainers.tools.prepare.upstream_common import (
    Installation, conditioning_features, files_fingerprint, installation_fingerprint, load_clip, load_weights,
    alone, need_file, quantized, to_array, read_config, semantic_features, state_of, text_normalizer, torch_file,
    w2v_frames,
)

HUB_W2V = "facebook/w2v-bert-2.0"  # infer_v2: from_pretrained of this hub id, through HF_HUB_CACHE
HUB_CODEC, CODEC_FILE = "amphion/MaskGCT", "semantic_codec/model.safetensors"
HF_CACHE = "hf_cache"  # infer_v2 sets HF_HUB_CACHE to ./checkpoints/hf_cache: model_dir/hf_cache
FETCH = (f"run IndexTTS2 inference once with this checkpoints folder (it downloads {HUB_W2V} and {HUB_CODEC} into "
         f"its {HF_CACHE}/), or download them there with huggingface-cli")


def hub_file(cache: Path, repo: str, filename: str) -> Path:
    """A file of the hub cache `cache` (hf_hub_download without the network), or a UserError saying how to get it."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename=filename, cache_dir=str(cache), local_files_only=True))
    except Exception:  # huggingface_hub's errors for a file not in the cache
        raise UserError(f"{repo} {filename} is not in {cache}; {FETCH}") from None


class IndexTTS2Backend:
    """The FeatureBackend of IndexTTS2 on upstream's code and the official checkpoints."""

    family = "indextts2"
    audio_rate = 16000
    code_rate = 50

    def __init__(self, inst: Installation, request: BackendRequest) -> None:
        import torch

        self.inst, self.device = inst, request.device
        model_dir = request.model_dir
        cfg = read_config(request.config)
        self.files: dict[str, Path] = {"config": request.config}
        bpe = request.tokenizer or model_dir / str(cfg.get("dataset", {}).get("bpe_model", "bpe.model"))
        self.files["tokenizer"] = need_file(bpe, "the SentencePiece model",
                                            "pass --tokenizer or the checkpoints folder")
        self.tokenizer = inst.TextTokenizer(str(bpe), text_normalizer(inst, model_dir, self.files))

        gpt_path = need_file(model_dir / str(cfg.get("gpt_checkpoint", "gpt.pth")), "the GPT checkpoint",
                             "pass the official checkpoints folder as --model-dir")
        self.files["gpt"] = gpt_path
        with torch.device("cpu"):
            self.gpt = inst.UnifiedVoice(**cfg.gpt)
        load_weights(self.gpt, state_of(torch_file(gpt_path, "GPT checkpoint"), gpt_path), gpt_path)  # 2.0: strict
        self.gpt = self.gpt.to(self.device).eval()

        cache = model_dir / HF_CACHE
        codec_path = hub_file(cache, HUB_CODEC, CODEC_FILE)
        self.files["codec"] = codec_path
        self.codec = inst.build_semantic_codec(cfg.semantic_codec)
        from safetensors.torch import load_file

        load_weights(self.codec, load_file(str(codec_path)), codec_path)  # infer_v2 loads it strictly too
        self.codec = self.codec.to(self.device).eval()
        stats = need_file(model_dir / str(cfg.get("w2v_stat", "wav2vec2bert_stats.pt")), "w2v-BERT statistics",
                          "pass the official checkpoints folder as --model-dir")
        self.files["w2v stats"] = stats
        self.semantic = semantic_features(inst, HUB_W2V, stats, self.device, cache_dir=str(cache))
        for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
            self.files[f"w2v {name}"] = hub_file(cache, HUB_W2V, name)

        self._fingerprint = {"family": self.family, **installation_fingerprint(inst), **files_fingerprint(self.files)}

    def fingerprint(self) -> dict[str, str]:
        return dict(self._fingerprint)

    def text(self, text: str, language: str | None) -> TextIds:
        """infer_v2's ids: tokenize (its front end) then convert_tokens_to_ids; unknown pieces counted."""
        tokens = self.tokenizer.tokenize(text)
        ids = self.tokenizer.convert_tokens_to_ids(tokens)
        unknown = sum(1 for i in ids if i == self.tokenizer.unk_token_id)
        return TextIds(np.asarray(ids, dtype=np.int32), unknown, " ".join(tokens))

    def audio(self, path: Path, clip_id: str) -> Clip:
        return load_clip(self.inst, path, clip_id)

    def code_length(self, samples: int) -> int:
        return w2v_frames(samples)

    def encode(self, clips: Sequence[Clip]) -> list[Features]:
        import torch

        whole = self.semantic([c.waveform for c in clips])
        prompts = conditioning_features(self.semantic, clips, whole)
        out = []
        with torch.no_grad():
            for feats, prompt in zip(whole, prompts):
                x, length = alone(prompt)
                out.append(Features(quantized(self.codec, feats), {
                    "condition": to_array(self.gpt.get_conditioning(x.transpose(1, 2), length)[0]),
                    "emo_vec": to_array(self.gpt.get_emovec(x, length)[0])}))
        return out

