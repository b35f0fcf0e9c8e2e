"""The IndexTTS-2.5 family: upstream's UnifiedVoice in "campplus" mode, trained as its inference runs it
(shared/reference/indextts25-gpt.md; docs/indextts25.md is the user's guide).

Its parts: the model (model.py: a 3-position prefix from the prompt's CAMPPlus vector, the language embedding on
every text position), the samples (features.py: the community 2.5 preprocessing's .npz files and .npy lines, ids
0 and 1 dropped), the languages (languages.py), the tiktoken tokenizer (tokenizer.py) and the demo (demo.py). A
config is this family's when it says `version: 2.5`, as upstream's 2.5 config does.
"""
from __future__ import annotations

from typing import Any, Mapping

from trainers.config.inference_keys import INFERENCE_GPT_KEYS
from trainers.families.family import ModelFamily
from trainers.families.indextts25.demo import TOKENIZER_NAME, make_demo
from trainers.families.indextts25.features import FORMS, IndexTTS25Features
from trainers.families.indextts25.languages import trained_rows
from trainers.families.indextts25.model import IndexTTS25Config, IndexTTS25GPT
from trainers.families.indextts25.tokenizer import UPSTREAM_NAME, TiktokenTokenizer
from trainers.model.weights import StateLayout

VERSION = "2.5"
# The keys of config.yaml infer_v2_5 reads (reference section 1); the tokenizer's file name is fixed, no key.
INFERENCE_KEYS = ("gpt", "gpt_checkpoint", "w2v_stat", "s2mel_checkpoint", "s2mel", "emo_matrix", "spk_matrix",
                  "qwen_emo_path", "version", "semantic_codec", "emo_num")
# The campplus state dict: the model's tensors (group A), the emotion branch carried for inference (group B), and
# keys dropped: upstream's inference wrapper, and the 2.0 speaker encoders and speed_emb, which campplus mode
# never builds (a 2.5 gpt.pth holding them loads non-strictly upstream; an export leaves them out).
LAYOUT = StateLayout(
    ("gpt.", "text_", "mel_", "final_norm.", "spk_emb_proj.", "lang_embedding."),
    ("emovec_layer.", "emo_layer.", "emo_conditioning_encoder.", "emo_perceiver_encoder."),
    ("inference_model.", "gpt.wte.", "conditioning_encoder.", "perceiver_encoder.", "speed_emb."),
)


def claims(model_yaml: Mapping[str, Any]) -> bool:
    """A 2.5 config says `version: 2.5` (upstream's config_v2_5.yaml and the released config.yaml)."""
    return str(model_yaml.get("version")) == VERSION


FAMILY = ModelFamily(
    name="indextts25",
    title="IndexTTS-2.5",
    config=IndexTTS25Config,
    inference_gpt_keys=INFERENCE_GPT_KEYS,
    model=IndexTTS25GPT,
    features=IndexTTS25Features,
    manifest_forms=FORMS,
    layout=LAYOUT,
    tokenizer=TiktokenTokenizer(),
    inference_keys=INFERENCE_KEYS,
    tokenizer_config_key=None,
    claims=claims,
    make_demo=make_demo,
    state_signature=("spk_emb_proj.weight", "lang_embedding.weight"),
    demo_tokenizer_name=TOKENIZER_NAME,
    export_tokenizer_name=UPSTREAM_NAME,
    inference_name="IndexTTS-2.5",
    demo_output_dir="runs/demo25",
    language_rows=trained_rows,
)
