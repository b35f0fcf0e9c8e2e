"""IndexTTS-2.5's GPT: upstream's UnifiedVoice in "campplus" mode, trained as its inference runs it
(shared/reference/indextts25-gpt.md, sections 2 and 4).

The trunk (blocks, heads, position tables, packing, dropout) is UnifiedVoiceGPT's. What differs:
- the prefix is 3 positions: [spk_emb_proj(CAMPPlus vector of the prompt) + emo_vec], then two zero vectors
  (upstream's duration slots are literal zeros: no speed_emb);
- `lang_embedding[lang_id]` is added to every text position, start and stop included, as upstream's
  `prepare_gpt_inputs` adds it at inference (its training `forward()` forgets it; training without it would
  teach a model that inference then runs with an extra vector on every text position);
- no conditioning_encoder / perceiver_encoder (campplus mode builds neither; the emotion branch is carried).
Text ids reach the model without ids 0 and 1, which prepare_gpt_inputs drops from the content (the family's
FeatureSpec drops them from the data, so the step's token counts are those the model sees).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from trainers.families.indextts25.languages import LANGUAGE_ROWS
from trainers.model.cross_entropy import chunked_head_cross_entropy
from trainers.model.gpt_model import _OFFICIAL, GPTConfig, UnifiedVoiceGPT

SPEAKER_DIM = 192  # CAMPPlus speaker vector, spk_emb_proj's input
PREFIX_LEN = 3  # [speaker + emotion][0][0]
# Rows of text logits computed at a time (60,510 columns each: 242 MB per 1024 rows in fp32), recomputed in backward.
TEXT_LOSS_ROWS = 1024


@dataclass(frozen=True)
class IndexTTS25Config(GPTConfig):
    """The gpt section of an IndexTTS-2.5 config.yaml: the keys of 2.0's, with its own official values."""

    OFFICIAL: ClassVar[Mapping[str, int]] = {**_OFFICIAL, "number_text_tokens": 60509}

    @classmethod
    def section_problems(cls, values: Mapping[str, Any], supplied: tuple[str, ...] = ()) -> list[str]:
        """GPTConfig's checks, and start/stop text ids 0 and 1: the ids upstream's prepare_gpt_inputs drops from the
        text (the ranks of "!" and '"'), which the family's data drops (features.py DROPPED_IDS)."""
        problems = super().section_problems(values, supplied)
        for name, wanted in (("start_text_token", 0), ("stop_text_token", 1)):
            if values.get(name, wanted) != wanted:
                problems.append(f"gpt.{name} must be {wanted} in an IndexTTS-2.5 config (as in the official one), got "
                                f"{values[name]!r}")
        return problems


class IndexTTS25GPT(UnifiedVoiceGPT):
    """UnifiedVoice(spk_cond_mode="campplus"), training path: inputs spk_emb [B, 192], emo_vec [B, D], lang_id [B]."""

    CONDITIONING = ("spk_emb", "emo_vec", "lang_id")
    prefix_len = PREFIX_LEN

    def _prefix_modules(self, d: int) -> None:
        self.spk_emb_proj = nn.Linear(SPEAKER_DIM, d)
        self.lang_embedding = nn.Embedding(LANGUAGE_ROWS, d)

    def conditioning_prefix(self, spk_emb: torch.Tensor, emo_vec: torch.Tensor, lang_id: torch.Tensor) -> torch.Tensor:
        first = (self.spk_emb_proj(spk_emb) + emo_vec).unsqueeze(1)
        return torch.cat([first, first.new_zeros(first.shape[0], 2, first.shape[2])], dim=1)

    def text_embeddings(self, text_in: torch.Tensor, lang_id: torch.Tensor, **rest: torch.Tensor) -> torch.Tensor:
        return super().text_embeddings(text_in) + self.lang_embedding(lang_id).unsqueeze(1)

    def text_cross_entropy(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """In blocks of TEXT_LOSS_ROWS rows: the 60,510-column text logits of a micro-batch never all at once."""
        return chunked_head_cross_entropy(h, targets, self.text_head, TEXT_LOSS_ROWS, self.deterministic_loss)

    def example_conditioning(self, n: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        return {"spk_emb": torch.zeros(n, SPEAKER_DIM, device=device),
                "emo_vec": torch.zeros(n, self.cfg.model_dim, device=device),
                "lang_id": torch.zeros(n, dtype=torch.long, device=device)}

    def forward(self, spk_emb: torch.Tensor, emo_vec: torch.Tensor, lang_id: torch.Tensor, text_ids: torch.Tensor,
                text_lens: torch.Tensor, codes: torch.Tensor, code_lens: torch.Tensor,
                dropout_keys: torch.Tensor | None = None, layout: str = "packed") -> tuple[torch.Tensor, torch.Tensor]:
        """Text logits [B, T+2, Nt+1] and mel logits [B, M+2, Nm] (UnifiedVoiceGPT.forward, campplus inputs)."""
        return self._logits({"spk_emb": spk_emb, "emo_vec": emo_vec, "lang_id": lang_id}, text_ids, text_lens, codes,
                            code_lens, dropout_keys, layout)

    def loss_sums(self, spk_emb: torch.Tensor, emo_vec: torch.Tensor, lang_id: torch.Tensor, text_ids: torch.Tensor,
                  text_lens: torch.Tensor, codes: torch.Tensor, code_lens: torch.Tensor,
                  dropout_keys: torch.Tensor | None = None, packed_len: int | None = None) -> dict[str, torch.Tensor]:
        """Summed cross-entropies and counts (UnifiedVoiceGPT.loss_sums, campplus inputs)."""
        return self._loss_sums({"spk_emb": spk_emb, "emo_vec": emo_vec, "lang_id": lang_id}, text_ids, text_lens,
                               codes, code_lens, dropout_keys, packed_len)
