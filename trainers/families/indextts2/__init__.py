"""The IndexTTS2 (2.0) family: upstream's UnifiedVoice in its default "conformer" mode, trained on
precomputed conditioning (shared/reference/indextts2-gpt.md).

Its parts live where the trainer had them before families existed, so they are only named here:
GPTConfig and UnifiedVoiceGPT (trainers/model/gpt_model.py: the 34-position prefix of 32 conditioning
latents plus emo_vec and two speed embeddings), FeatureSpec (trainers/data/features.py: .npy text ids,
codes, condition [32, D] and emo_vec [D]), the paired and single-utterance manifest lines
(trainers/data/manifest_lines.py), the state-dict groups (trainers/model/weights.py), the SentencePiece
tokenizer (trainers/model/vocabulary.py) and the demo (trainers/data/demo_data.py, trainers/model/demo_base.py).
"""
from __future__ import annotations

from pathlib import Path

from trainers.config.inference_keys import INFERENCE_GPT_KEYS, INFERENCE_KEYS
from trainers.data.demo_data import DemoCorpusSpec, ensure_demo_assets
from trainers.data.features import FeatureSpec
from trainers.data.manifest_lines import INDEXTTS2_FORMS
from trainers.families.family import ModelFamily
from trainers.model.demo_base import ensure_demo_base
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.vocabulary import SentencePieceTokenizer
from trainers.model.weights import INDEXTTS2_LAYOUT


def make_demo(root: Path, gpt: GPTConfig) -> None:
    """The demo corpus (its tokenizer trained to the config's number_text_tokens) and tiny base checkpoint."""
    ensure_demo_assets(root, DemoCorpusSpec(model_dim=gpt.model_dim, vocab_size=gpt.number_text_tokens,
                                            num_codes=gpt.start_mel_token))
    ensure_demo_base(root, gpt)


FAMILY = ModelFamily(
    name="indextts2",
    title="IndexTTS2 (2.0)",
    config=GPTConfig,
    inference_gpt_keys=INFERENCE_GPT_KEYS,
    model=UnifiedVoiceGPT,
    features=FeatureSpec,
    manifest_forms=INDEXTTS2_FORMS,
    layout=INDEXTTS2_LAYOUT,
    tokenizer=SentencePieceTokenizer(),
    inference_keys=INFERENCE_KEYS,
    tokenizer_config_key="dataset.bpe_model",
    claims=lambda model_yaml: True,  # the first family: every config that no other family claims
    make_demo=make_demo,
    state_signature=("speed_emb.weight",),
)
