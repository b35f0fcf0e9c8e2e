"""The keys of config.yaml that IndexTTS2 inference reads: the one list the trainer and the exporter check.

`IndexTTS2(cfg_path, model_dir)` (upstream's indextts/infer_v2.py) builds the whole pipeline
from one config: besides the `gpt` section it reads the file names of the other models (each
looked up in model_dir) and the sections that shape them. The trainer reads only `gpt`, so a
trimmed config (this repository's checkpoints/config.yaml) trains fine but cannot drive
inference; tools/export_checkpoint.py refuses to export one.

    python trainers/config/inference_keys.py CONFIG   prints the keys CONFIG lacks, one a line
                                                      (tools/cloud/new_language.sh checks with it)
"""
from __future__ import annotations

import sys
from typing import Any, Mapping

import yaml

# Dotted paths into the YAML. From shared/reference/indextts2-gpt.md ("How inference loads a
# fine-tuned GPT"); semantic_codec, emo_num and vocoder.name are read by the same constructor
# (cfg.semantic_codec, cfg.emo_num, cfg.vocoder.name) and are in the official config.yaml too.
INFERENCE_KEYS: tuple[str, ...] = (
    "gpt", "gpt_checkpoint", "dataset.bpe_model", "w2v_stat", "s2mel_checkpoint", "s2mel", "emo_matrix",
    "spk_matrix", "qwen_emo_path", "version", "semantic_codec", "emo_num", "vocoder.name",
)
# gpt keys of the official 2.0 and 2.5 configs that only inference reads (the conditioning encoders, which 2.5's
# campplus mode ignores, and the mel front end): a config holding them is no typo (trainers/run/inputs.py).
INFERENCE_GPT_KEYS = frozenset({"use_mel_codes_as_input", "mel_length_compression", "train_solo_embeddings",
                                "condition_type", "condition_module", "emo_condition_module"})
# The other models' files, which inference opens in model_dir beside gpt.pth and the tokenizer.
OTHER_MODEL_FILE_KEYS: tuple[str, ...] = ("s2mel_checkpoint", "w2v_stat", "emo_matrix", "spk_matrix", "qwen_emo_path")


def value_at(data: Mapping[str, Any], dotted: str) -> Any:
    """The value at `dotted` ("vocoder.name"), or None where a part of the path is missing."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def missing_inference_keys(data: Mapping[str, Any], keys: tuple[str, ...] = INFERENCE_KEYS) -> list[str]:
    """The `keys` (by default IndexTTS2's INFERENCE_KEYS; a model family's) that `data` lacks (or holds as null),
    in the list's order."""
    return [key for key in keys if value_at(data, key) is None]


def other_model_files(data: Mapping[str, Any]) -> list[str]:
    """The names (files, and the Qwen model's folder) in model_dir that `data` names besides the GPT's."""
    return [str(value_at(data, key)).strip() for key in OTHER_MODEL_FILE_KEYS if value_at(data, key) is not None]


def main(argv: list[str]) -> int:
    """Print the keys the config file argv[0] lacks; status 2 (and a message) if it cannot be read."""
    try:
        with open(argv[0], encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        print(f"{argv[0]}: cannot be read ({exc.strerror})", file=sys.stderr)
        return 2
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        print(f"{argv[0]}: not a YAML file ({' '.join(str(exc).split())})", file=sys.stderr)
        return 2
    for key in missing_inference_keys(data if isinstance(data, dict) else {}):
        print(key)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
