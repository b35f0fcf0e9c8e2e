"""A third model family for the tests, shaped like IndexTTS-2.5 where the seam is concerned, written as a new
family would be (docs/architecture.md, "Adding a model family"): this module stands in for the folder, and
`registered()` for the registry line.

Its GPT differs from IndexTTS2's where 2.5's does: a 3-position prefix ([projected speaker vector + emo_vec],
0, 0) instead of 34, a per-sample language embedding added to every text position, an integer input (the
language id) besides float ones, other state-dict keys (speaker_proj, lang_embedding; no speed_emb), manifest
lines of another form (`speaker_path`, `lang`), and configs it claims by their `version`. Nothing in the
trainer names these inputs: they travel as named tensors from its FeatureSpec to its model.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from trainers.config.inference_keys import INFERENCE_KEYS
from trainers.data.features import FeatureSpec, _float_array, _load_npy
from trainers.data.manifest_lines import LineForm, ManifestForms
from trainers.data.sample_table import Sample
from trainers.families import FAMILIES
from trainers.families.family import ModelFamily
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.vocabulary import SentencePieceTokenizer
from trainers.model.weights import StateLayout

SPEAKER_DIM = 8
LANGUAGES = ("en", "zh", "ja")  # a line's `lang` -> its row of lang_embedding; others take the last row
VERSION = "toy"


class ToyGPT(UnifiedVoiceGPT):
    CONDITIONING = ("speaker", "emo_vec", "lang_id")
    prefix_len = 3

    def _prefix_modules(self, d: int) -> None:
        self.speaker_proj = nn.Linear(SPEAKER_DIM, d)
        self.lang_embedding = nn.Embedding(len(LANGUAGES) + 1, d)

    def conditioning_prefix(self, speaker: torch.Tensor, emo_vec: torch.Tensor,
                            lang_id: torch.Tensor) -> torch.Tensor:
        first = (self.speaker_proj(speaker) + emo_vec).unsqueeze(1)
        return torch.cat([first, first.new_zeros(first.shape[0], 2, first.shape[2])], dim=1)

    def text_embeddings(self, text_in: torch.Tensor, lang_id: torch.Tensor, **rest: torch.Tensor) -> torch.Tensor:
        return super().text_embeddings(text_in) + self.lang_embedding(lang_id).unsqueeze(1)

    def example_conditioning(self, n: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        return {"speaker": torch.zeros(n, SPEAKER_DIM, device=device),
                "emo_vec": torch.zeros(n, self.cfg.model_dim, device=device),
                "lang_id": torch.zeros(n, dtype=torch.long, device=device)}

    def forward(self, speaker, emo_vec, lang_id, text_ids, text_lens, codes, code_lens, dropout_keys=None,
                layout="packed"):
        return self._logits({"speaker": speaker, "emo_vec": emo_vec, "lang_id": lang_id}, text_ids, text_lens, codes,
                            code_lens, dropout_keys, layout)

    def loss_sums(self, speaker, emo_vec, lang_id, text_ids, text_lens, codes, code_lens, dropout_keys=None,
                  packed_len=None):
        return self._loss_sums({"speaker": speaker, "emo_vec": emo_vec, "lang_id": lang_id}, text_ids, text_lens,
                               codes, code_lens, dropout_keys, packed_len)


class ToyFeatures(FeatureSpec):
    def conditioning(self, sample: Sample) -> dict[str, np.ndarray]:
        speaker = _float_array(sample, "speaker", sample.condition_path,
                               _load_npy(sample, "speaker", sample.condition_path), (SPEAKER_DIM,))
        lang = LANGUAGES.index(sample.lang) if sample.lang in LANGUAGES else len(LANGUAGES)
        return {"speaker": speaker, "emo_vec": self._emo_vec(sample), "lang_id": np.asarray(lang, dtype=np.int64)}

    def model_dim_files(self, sample: Sample) -> list[tuple[str, str, tuple[int, ...]]]:
        return [("emo_vec", sample.emo_vec_path, ())]


LINE = LineForm(name="toy", text_ids="text_ids_path", text_len="text_len", codes="codes_path", code_len="code_len",
                condition="speaker_path", emo_vec="emo_vec_path", language="lang")


def _claims(model_yaml: Mapping[str, Any]) -> bool:
    return str(model_yaml.get("version")) == VERSION


def _no_demo(root: Path, gpt: GPTConfig) -> None:
    raise NotImplementedError("the toy family has no demo")


FAMILY = ModelFamily(
    name="toy", title="the toy model", config=GPTConfig, inference_gpt_keys=frozenset(), model=ToyGPT,
    features=ToyFeatures,
    manifest_forms=ManifestForms("toy", lambda obj: LINE if "speaker_path" in obj else None,
                                 "a toy line has speaker_path"),
    layout=StateLayout(("gpt.", "text_", "mel_", "final_norm.", "speaker_proj.", "lang_embedding."),
                       ("emovec_layer.",), ("inference_model.",)),
    tokenizer=SentencePieceTokenizer(), inference_keys=INFERENCE_KEYS, tokenizer_config_key="dataset.bpe_model",
    claims=_claims, make_demo=_no_demo)


@contextlib.contextmanager
def registered() -> Iterator[ModelFamily]:
    """The family in the registry (its one line) while the block runs."""
    FAMILIES[FAMILY.name] = FAMILY
    try:
        yield FAMILY
    finally:
        del FAMILIES[FAMILY.name]


def toy_corpus(v1_data: Path, out: Path) -> list[str]:
    """The small corpus of tests/fixtures/v1_run rewritten as toy lines (a speaker vector per speaker, the
    language as `lang`), a config that the toy family claims; the flags naming them."""
    import json
    import shutil

    import yaml

    shutil.copytree(v1_data, out)
    rng = np.random.default_rng(0)
    for name in ("train.jsonl", "val.jsonl"):
        lines = []
        for row in map(json.loads, (out / name).read_text().splitlines()):
            speaker = out / "features" / f"{row['speaker']}_speaker.npy"
            if not speaker.exists():
                np.save(speaker, rng.standard_normal(SPEAKER_DIM).astype(np.float32))
            paired = "target_codes_path" in row
            key = {k: (f"target_{k}" if paired else k) for k in ("text_ids_path", "text_len", "codes_path", "code_len")}
            lines.append({"id": row["id"], **{k: row[v] for k, v in key.items()},
                          "speaker_path": f"features/{speaker.name}",
                          "emo_vec_path": row["prompt_emo_vec_path" if paired else "emo_vec_path"],
                          "lang": "zh" if row["speaker"] == "spk1" else "en", "speaker": row["speaker"]})
        (out / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = yaml.safe_load((out / "tiny.yaml").read_text())
    (out / "toy.yaml").write_text(yaml.safe_dump({**config, "version": VERSION}, sort_keys=False))
    # A base checkpoint in the family's layout: its model, a tensor it carries, one it drops.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = ToyGPT(GPTConfig.from_yaml_section(config["gpt"])).state_dict()
        state.update({"emovec_layer.weight": torch.randn(4, 4), "inference_model.lm_head.weight": torch.randn(2, 2)})
    torch.save({"model": state}, out / "toy_base.pth")
    return ["--train-manifest", str(out / "train.jsonl"), "--val-manifest", str(out / "val.jsonl"),
            "--tokenizer", str(out / "bpe.model"), "--config", str(out / "toy.yaml"),
            "--base-checkpoint", str(out / "toy_base.pth")]
