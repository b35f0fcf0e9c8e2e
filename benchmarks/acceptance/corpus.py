"""Inputs for trainer runs at the official model size, generated in seconds (nothing is downloaded), and the
model of the config under test.

* A config: the config under test (checkpoints/config.yaml, IndexTTS2's official gpt section, unless
  gpu_acceptance.py --config names another), optionally with a few values changed (fewer layers for the
  forced out-of-memory run; a small width for the CPU side of a dry run).
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
import torch
import yaml

from tests.demo_runs import REPO
from trainers.tools.tokenizer import sp_model_proto as proto
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.layout import CONDITION_LEN, PREFIX_LEN

OFFICIAL_CONFIG = REPO / "checkpoints" / "config.yaml"  # IndexTTS2's; --config names another model under test
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

    def flags(self, validation: bool = True) -> list[str]:
        """The trainer's flags naming this corpus (validation False: no validation set, so no validation and no
        best.pth, a whole checkpoint, at step 0)."""
        return ["--train-manifest", str(self.train), *(["--val-manifest", str(self.val)] if validation else []),
                "--tokenizer", str(self.tokenizer), "--config", str(self.config)]

    @property
    def positions(self) -> int:
        return positions(self.text_len, self.code_len)


def official_gpt(**changes: Any) -> GPTConfig:
    """The official model config (checkpoints/config.yaml's gpt section), with `changes`."""
    return read_gpt(OFFICIAL_CONFIG, **changes)


def read_gpt(config: Path, **changes: Any) -> GPTConfig:
    """The gpt section of `config`, with `changes`."""
    return GPTConfig.from_yaml_section(_yaml(config)["gpt"], **changes)


def build_model(cfg: GPTConfig, device: torch.device | str = "cpu") -> UnifiedVoiceGPT:
    """The model a config describes, initialised on `device` as the trainer initialises it (seed 0). The one
    place the acceptance checks build a model of the config under test: a model family other than IndexTTS2's
    (IndexTTS-2.5) is chosen here, from its config."""
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        return UnifiedVoiceGPT(cfg).train()


def write_config(path: Path, source: Path = OFFICIAL_CONFIG, **changes: Any) -> Path:
    """The config `source` with the gpt values in `changes` replaced."""
    data = _yaml(source)
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
                 code_len: int = LONG_CODES, samples: int = 128, val_samples: int = 8, seed: int = 0,
                 source: Path = OFFICIAL_CONFIG) -> Corpus:
    """Config (`source` with `changes`), tokenizer and manifests (single-utterance lines) under `root`; random
    features of the right shapes and ranges: text ids of the tokenizer, codes below start_mel_token."""
    config = write_config(root / "config.yaml", source, **(changes or {}))
    gpt = read_gpt(source, **(changes or {}))
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


def _yaml(config: Path) -> dict[str, Any]:
    return yaml.safe_load(config.read_text(encoding="utf-8"))
