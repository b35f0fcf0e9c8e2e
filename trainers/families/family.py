"""What a model family is: the parts of the trainer that differ between the GPTs it trains.

The rest of the trainer (the loop, validation, the micro-batch probe, generation, checkpoints, LoRA,
torchrun) is written once against these parts and never names a family's inputs: a batch is named
tensors that the family's model takes by name (trainers/data/features.py Batch.inputs). A family is
one folder under trainers/families/ defining one `ModelFamily`, plus its line in the registry
(trainers/families/__init__.py); docs/architecture.md, "Model families", says how to add one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

from torch import nn

from trainers.data.features import FeatureSpec
from trainers.data.manifest_lines import DataLimits, ManifestForms
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.vocabulary import TokenizerAdapter
from trainers.model.weights import StateLayout


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its config, model, data, upstream state dict, tokenizer and demo."""

    name: str  # saved with a run (checkpoint run.model_family; absent means the first family, "indextts2")
    title: str  # for messages, e.g. "IndexTTS2 (2.0)"
    # The gpt section of config.yaml: from_yaml_section(), section_problems(), to_dict(), the fields.
    config: type[GPTConfig]
    # gpt keys only inference reads: kept in the run's config.yaml, never taken for misspellings of ours.
    inference_gpt_keys: frozenset[str]
    # The GPT, built as model(cfg, gradient_checkpointing=..., dropout_masks=..., deterministic_loss=...). Its
    # CONDITIONING names the batch's inputs besides text and codes; conditioning_prefix() and prefix_len the
    # prefix they become; text_embeddings() the text positions; generation's prompt is built from both.
    model: type[UnifiedVoiceGPT]
    # A sample's files -> named arrays, checked: features(model_dim=, number_text_tokens=, max_code=).
    features: type[FeatureSpec]
    manifest_forms: ManifestForms  # the forms of its manifest lines
    layout: StateLayout  # its upstream state dict: trained, carried and dropped keys
    tokenizer: TokenizerAdapter
    # Keys of config.yaml its inference reads (an export refuses a config lacking one), and the key naming
    # the tokenizer's file (None: inference opens a fixed name).
    inference_keys: tuple[str, ...]
    tokenizer_config_key: str | None
    # Whether a config.yaml (its whole mapping) belongs to this family; the first family of the registry
    # takes whatever no other claims.
    claims: Callable[[Mapping[str, Any]], bool]
    # --demo: its corpus, tokenizer and base checkpoint under a folder, for a gpt config.
    make_demo: Callable[[Path, GPTConfig], None]
    # Keys every state dict of this family holds and no other family's does (how a base checkpoint is told
    # apart; () for none), and the name of --demo's tokenizer file in the demo folder.
    state_signature: tuple[str, ...] = ()
    demo_tokenizer_name: str = "bpe.model"
    # The tokenizer's file name in an export: None keeps the run's own (inference reads it from the config key
    # above); a name where inference opens a fixed one.
    export_tokenizer_name: str | None = None
    inference_name: str = "IndexTTS2"  # upstream's inference, as messages name it
    demo_output_dir: str = "runs/demo"  # --demo's run directory when --output-dir is not given
    # --new-language: the rows of each table that train for these languages (every other row of the table held);
    # ValueError for a code it does not know. None: the family has no language rows.
    language_rows: Callable[[int, tuple[str, ...]], dict[str, list[int]]] | None = None

    def holds_state(self, keys: Collection[str]) -> bool:
        """Whether a state dict with these keys is one of this family's (by its signature)."""
        return bool(self.state_signature) and all(k in keys for k in self.state_signature)

    def read_config(self, section: Mapping[str, Any], **overrides: Any) -> GPTConfig:
        """The gpt section's config; ValueError with one `gpt.KEY ...` problem per line."""
        return self.config.from_yaml_section(section, **overrides)

    def build_model(self, cfg: GPTConfig, **options: Any) -> UnifiedVoiceGPT:
        return self.model(cfg, **options)

    def feature_spec(self, cfg: GPTConfig) -> FeatureSpec:
        return self.features(cfg.model_dim, cfg.number_text_tokens, cfg.start_mel_token)

    def data_limits(self, cfg: GPTConfig) -> DataLimits:
        return DataLimits(cfg.max_text_tokens, cfg.max_mel_tokens, self.model.prefix_len, self.manifest_forms,
                          cfg.number_text_tokens)

    def expected_keys(self, cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the model's tensors for `cfg` (the trained group of its upstream state dict)."""
        import torch

        with torch.device("meta"):
            model: nn.Module = self.build_model(cfg)
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}
