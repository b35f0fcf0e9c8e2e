"""Inputs for trainer runs at the official model size, generated in seconds (nothing is downloaded).

* A config: checkpoints/config.yaml (the official gpt section), optionally with a few values changed (fewer
  layers for the forced out-of-memory run; a small width for the CPU side of a dry run).
* A tokenizer of exactly gpt.number_text_tokens (12,000) pieces, so the model has the official text
  embedding and head: the demo tokenizer padded with user-defined pieces (tools/tokenizer/sp_model_proto.py).
  Only its size matters: the corpus's text ids are written directly.
* A corpus at the config's width in which every sample has the same, long lengths (LONG_TEXT, LONG_CODES):
  the micro-batch probe sizes for the longest sample, and equal lengths make every step the same work, so
  the throughput of the run is that of samples of this length.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tests.demo_runs import REPO
from trainers.tools.tokenizer import sp_model_proto as proto
from trainers.model.gpt_model import GPTConfig
from trainers.model.layout import CONDITION_LEN, PREFIX_LEN

OFFICIAL_CONFIG = REPO / "checkpoints" / "config.yaml"
# The longest sample of the synthetic TTS lengths of benchmarks/padding.py (text 10-200, codes 50-1500).
LONG_TEXT, LONG_CODES = 200, 1500
SPEAKERS = 4


def positions(text_len: int, code_len: int) -> int:
    """Sequence positions of one sample: the conditioning prefix, text and codes with their start and stop."""
    return PREFIX_LEN + text_len + 2 + code_len + 2


@dataclass(frozen=True)
class Corpus:
    train: Path
    val: Path
    tokenizer: Path
    config: Path
    text_len: int
    code_len: int
    samples: int

    def flags(self) -> list[str]:
        return ["--train-manifest", str(self.train), "--val-manifest", str(self.val), "--tokenizer",
                str(self.tokenizer), "--config", str(self.config)]

    @property
    def positions(self) -> int:
        return positions(self.text_len, self.code_len)


def official_gpt(**changes: Any) -> GPTConfig:
    """The official model config (checkpoints/config.yaml's gpt section), with `changes`."""
    return GPTConfig.from_yaml_section(_official_yaml()["gpt"], **changes)


def write_config(path: Path, **changes: Any) -> Path:
    """checkpoints/config.yaml with the gpt values in `changes` replaced."""
    data = _official_yaml()
    data["gpt"].update(changes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def write_tokenizer(path: Path, base: Path, pieces: int) -> Path:
    """`base` (a SentencePiece model) padded with user-defined pieces to `pieces` pieces."""
    model = proto.parse_model(base.read_bytes())
    extra = [proto.Piece(f"<acceptance_{i:05d}>", 0.0, proto.USER_DEFINED) for i in range(pieces - len(model.pieces))]
    padded = proto.ModelProto([*model.pieces, *extra], model.other_fields).with_trainer_vocab_size(pieces)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(proto.serialize_model(padded))
    return path


def write_corpus(root: Path, base_tokenizer: Path, changes: dict[str, Any] | None = None, text_len: int = LONG_TEXT,
                 code_len: int = LONG_CODES, samples: int = 128, val_samples: int = 8, seed: int = 0) -> Corpus:
    """Config, tokenizer and manifests (single-utterance lines) under `root`; random features of the right
    shapes and ranges: text ids of the tokenizer, codes below start_mel_token."""
    config = write_config(root / "config.yaml", **(changes or {}))
    gpt = official_gpt(**(changes or {}))
    tokenizer = write_tokenizer(root / "bpe.model", base_tokenizer, gpt.number_text_tokens)
    rng = np.random.default_rng(seed)
    features = root / "features"
    features.mkdir(parents=True, exist_ok=True)
    for s in range(SPEAKERS):
        np.save(features / f"spk{s}_condition.npy", rng.standard_normal((CONDITION_LEN, gpt.model_dim), np.float32))
    manifests = {}
    for split, count in (("train", samples), ("val", val_samples)):
        lines = []
        for i in range(count):
            name = f"{split}_{i:05d}"
            np.save(features / f"{name}_text_ids.npy", rng.integers(2, gpt.number_text_tokens, text_len, np.int32))
            np.save(features / f"{name}_codes.npy", rng.integers(0, gpt.start_mel_token, code_len, np.int32))
            np.save(features / f"{name}_emo_vec.npy", rng.standard_normal(gpt.model_dim, np.float32))
            lines.append({"id": name, "speaker": f"spk{i % SPEAKERS}", "text": "", "language": "en",
                          "text_ids_path": f"features/{name}_text_ids.npy", "text_len": text_len,
                          "codes_path": f"features/{name}_codes.npy", "code_len": code_len,
                          "condition_path": f"features/spk{i % SPEAKERS}_condition.npy",
                          "condition_len": CONDITION_LEN, "emo_vec_path": f"features/{name}_emo_vec.npy"})
        manifests[split] = root / f"{split}.jsonl"
        manifests[split].write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return Corpus(manifests["train"], manifests["val"], tokenizer, config, text_len, code_len, samples)


def _official_yaml() -> dict[str, Any]:
    return yaml.safe_load(OFFICIAL_CONFIG.read_text(encoding="utf-8"))
