"""Inputs for trainer runs at the official model size, generated in seconds (nothing is downloaded), and the
models under test: IndexTTS2 (2.0) and IndexTTS-2.5, each from a config.yaml.

* The configs: IndexTTS2's official gpt section (checkpoints/config.yaml), and IndexTTS-2.5's made from it with
  2.5's official values (number_text_tokens 60,509; `version: 2.5`), unless gpu_acceptance.py --config names
  another of a family; optionally with a few values changed (fewer layers for the forced out-of-memory run; a
  small width for the CPU side of a dry run).
* A tokenizer of exactly gpt.number_text_tokens ids, so the model has the official text embedding and head:
  2.0's the demo's SentencePiece model padded with user-defined pieces to 12,000 (tools/tokenizer/
  sp_model_proto.py); 2.5's a tiktoken ranks file of 58,836 ranks + its 1673 special tokens (the 2.5 demo's
  maker). Only its size matters: the corpus's text ids are written directly.
* A corpus at the config's width in which every sample has the same, long lengths (LONG_TEXT, LONG_CODES):
  the micro-batch probe sizes for the longest sample, and equal lengths make every step the same work, so
  the throughput of the run is that of samples of this length. 2.0's in single-utterance .npy lines; 2.5's as
  the community 2.5 preprocessing writes it (one .npz per utterance, pair lines for training, utterance lines
  for validation) in the five languages the release was trained on, so the lines' languages pick rows of
  lang_embedding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

from tests.demo_runs import REPO
from trainers.families import FAMILIES, family_for_config
from trainers.families.family import ModelFamily
from trainers.families.indextts25.demo import tiktoken_file
from trainers.families.indextts25.languages import RELEASED, first_language_token, lang_id
from trainers.families.indextts25.model import SPEAKER_DIM
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.layout import CONDITION_LEN, PREFIX_LEN
from trainers.tools.tokenizer import sp_model_proto as proto

OFFICIAL_CONFIG = REPO / "checkpoints" / "config.yaml"  # IndexTTS2's; IndexTTS-2.5's is made from it
IDX2, IDX25 = "indextts2", "indextts25"  # the families' names (trainers/families)
LABELS = {IDX2: "2.0", IDX25: "2.5"}  # how the report names them
# The longest sample of the synthetic TTS lengths of benchmarks/padding.py (text 10-200, codes 50-1500).
LONG_TEXT, LONG_CODES = 200, 1500
SPEAKERS = 4


def positions(text_len: int, code_len: int, prefix_len: int = PREFIX_LEN) -> int:
    """Sequence positions of one sample: the conditioning prefix (2.0's 34, 2.5's 3), text and codes with their
    start and stop."""
    return prefix_len + text_len + 2 + code_len + 2


@dataclass(frozen=True)
class Corpus:
    train: Path
    val: Path
    tokenizer: Path
    config: Path
    text_len: int
    code_len: int
    samples: int
    prefix_len: int = PREFIX_LEN

    def flags(self, validation: bool = True) -> list[str]:
        """The trainer's flags naming this corpus (validation False: no validation set, so no validation and no
        best.pth, a whole checkpoint, at step 0)."""
        return ["--train-manifest", str(self.train), *(["--val-manifest", str(self.val)] if validation else []),
                "--tokenizer", str(self.tokenizer), "--config", str(self.config)]

    @property
    def positions(self) -> int:
        return positions(self.text_len, self.code_len, self.prefix_len)


def official_gpt(**changes: Any) -> GPTConfig:
    """The official IndexTTS2 config (checkpoints/config.yaml's gpt section), with `changes`."""
    return read_gpt(OFFICIAL_CONFIG, **changes)


def write_official_25(path: Path) -> Path:
    """IndexTTS-2.5's official config: checkpoints/config.yaml with 2.5's official gpt values (IndexTTS25Config.
    OFFICIAL: 2.0's but number_text_tokens 60,509; shared/reference/indextts25-gpt.md, section 1) and `version: 2.5`,
    without 2.0's dataset section (2.5 has no bpe_model). benchmarks/family_cost.py counts the same model."""
    data = _yaml(OFFICIAL_CONFIG)
    data.pop("dataset", None)
    data["gpt"].update(FAMILIES[IDX25].config.OFFICIAL)
    data["version"] = 2.5
    return _dump(path, data)


def read_gpt(config: Path, **changes: Any) -> GPTConfig:
    """The gpt section of `config`, with `changes`, as its family reads it (2.5 when it says `version: 2.5`)."""
    data = _yaml(config)
    return family_for_config(data).read_config(data["gpt"], **changes)


def family_of(cfg: GPTConfig) -> ModelFamily:
    """The family whose config `cfg` is (each family has a config class of its own)."""
    return next(family for family in FAMILIES.values() if type(cfg) is family.config)


def build_model(cfg: GPTConfig, device: torch.device | str = "cpu") -> UnifiedVoiceGPT:
    """The model of a config's family, initialised on `device` as the trainer initialises it (seed 0): the one
    place the acceptance checks build a model."""
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        return family_of(cfg).build_model(cfg).train()


def random_inputs(cfg: GPTConfig, text_lens: list[int], code_lens: list[int], seed: int) -> dict[str, torch.Tensor]:
    """The model's inputs by name for samples of these lengths (padded to the longest), on the CPU, random within
    their ranges: its family's conditioning (floats normal; 2.5's language, an integer, alternating between rows 0
    and 1, en and zh), text ids of the vocabulary without the start/stop ids, codes below start_mel_token."""
    g, n = torch.Generator().manual_seed(seed), len(text_lens)
    example = build_model(cfg, "meta").example_conditioning(n, "meta")
    inputs = {name: torch.randn(t.shape, generator=g) if t.is_floating_point() else torch.arange(n) % 2
              for name, t in example.items()}
    return {**inputs, "text_ids": torch.randint(2, cfg.number_text_tokens, (n, max(text_lens)), generator=g),
            "text_lens": torch.tensor(text_lens),
            "codes": torch.randint(0, cfg.start_mel_token, (n, max(code_lens)), generator=g),
            "code_lens": torch.tensor(code_lens)}


def write_config(path: Path, source: Path = OFFICIAL_CONFIG, **changes: Any) -> Path:
    """The config `source` with the gpt values in `changes` replaced."""
    data = _yaml(source)
    data["gpt"].update(changes)
    return _dump(path, data)


def write_tokenizer(path: Path, base: Path, pieces: int) -> Path:
    """`base` (a SentencePiece model) padded with user-defined pieces to `pieces` pieces."""
    model = proto.parse_model(base.read_bytes())
    extra = [proto.Piece(f"<acceptance_{i:05d}>", 0.0, proto.USER_DEFINED) for i in range(pieces - len(model.pieces))]
    padded = proto.ModelProto([*model.pieces, *extra], model.other_fields).with_trainer_vocab_size(pieces)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(proto.serialize_model(padded))
    return path


@dataclass(frozen=True)
class _Shape:
    """What a family's corpus writer is given: the config's sizes, the lengths, the random generator."""

    gpt: GPTConfig
    root: Path
    text_len: int
    code_len: int
    rng: np.random.Generator

    def text_ids(self) -> np.ndarray:
        return self.rng.integers(2, self.gpt.number_text_tokens, self.text_len, np.int32)

    def codes(self) -> np.ndarray:
        return self.rng.integers(0, self.gpt.start_mel_token, self.code_len, np.int32)

    def emo_vec(self) -> np.ndarray:
        return self.rng.standard_normal(self.gpt.model_dim, np.float32)


def _indextts2_corpus(shape: _Shape, counts: dict[str, int], base_tokenizer: Path) -> tuple[Path, dict[str, list]]:
    """The padded SentencePiece model; per speaker its [32, D] conditioning latents; single-utterance .npy lines."""
    tokenizer = write_tokenizer(shape.root / "bpe.model", base_tokenizer, shape.gpt.number_text_tokens)
    features = shape.root / "features"
    for s in range(SPEAKERS):
        np.save(features / f"spk{s}_condition.npy",
                shape.rng.standard_normal((CONDITION_LEN, shape.gpt.model_dim), np.float32))
    lines: dict[str, list] = {}
    for split, count in counts.items():
        lines[split] = []
        for i in range(count):
            name = f"{split}_{i:05d}"
            np.save(features / f"{name}_text_ids.npy", shape.text_ids())
            np.save(features / f"{name}_codes.npy", shape.codes())
            np.save(features / f"{name}_emo_vec.npy", shape.emo_vec())
            lines[split].append({"id": name, "speaker": f"spk{i % SPEAKERS}", "text": "", "language": "en",
                                 "text_ids_path": f"features/{name}_text_ids.npy", "text_len": shape.text_len,
                                 "codes_path": f"features/{name}_codes.npy", "code_len": shape.code_len,
                                 "condition_path": f"features/spk{i % SPEAKERS}_condition.npy",
                                 "condition_len": CONDITION_LEN, "emo_vec_path": f"features/{name}_emo_vec.npy"})
    return tokenizer, lines


def _indextts25_corpus(shape: _Shape, counts: dict[str, int], base_tokenizer: Path | None) -> tuple[Path, dict]:
    """A tiktoken file of the config's ids; one .npz per utterance (codes, text_ids, its speaker's 192-d vector,
    emo_vec); pair lines for training (the prompt: the next utterance of the same speaker), utterance lines for
    validation, in the released languages by turns, each text beginning with its language's <|xx|> token as
    upstream's front end writes it (the manifests' check refuses text ids of another language than the line's)."""
    tokenizer = shape.root / "tokenizer.tiktoken"
    tokenizer.write_bytes(tiktoken_file(shape.gpt.number_text_tokens))
    speakers = [shape.rng.standard_normal(SPEAKER_DIM, np.float32) for _ in range(SPEAKERS)]
    lines: dict[str, list] = {}
    for split, count in counts.items():
        rows = []
        for i in range(count):
            name, lang = f"{split}_{i:05d}", RELEASED[i % len(RELEASED)]
            text_ids = shape.text_ids()
            text_ids[0] = first_language_token(shape.gpt.number_text_tokens) + lang_id(lang)  # as the front end
            np.savez(shape.root / "features" / f"{name}.npz", codes=shape.codes(), text_ids=text_ids,
                     spk_emb=speakers[i % SPEAKERS], emo_vec=shape.emo_vec())
            rows.append({"id": name, "features": f"features/{name}.npz", "speaker": f"spk{i % SPEAKERS}",
                         "lang": lang, "lang_alias": None, "text_len": shape.text_len, "code_len": shape.code_len})
        if split == "train":  # each target with the utterance SPEAKERS later (wrapping): the same speaker
            rows = [{"id": f"{t['id']}__{p['id']}", "target_features": t["features"], "prompt_features": p["features"],
                     **{k: t[k] for k in ("speaker", "lang", "lang_alias", "text_len", "code_len")}}
                    for t, p in zip(rows, rows[SPEAKERS:] + rows[:SPEAKERS])]
        lines[split] = rows
    return tokenizer, lines


WRITERS: dict[str, Callable[[_Shape, dict[str, int], Path], tuple[Path, dict[str, list]]]] = {
    IDX2: _indextts2_corpus, IDX25: _indextts25_corpus}


def write_corpus(root: Path, base_tokenizer: Path, changes: dict[str, Any] | None = None, text_len: int = LONG_TEXT,
                 code_len: int = LONG_CODES, samples: int = 128, val_samples: int = 8, seed: int = 0,
                 source: Path = OFFICIAL_CONFIG) -> Corpus:
    """Config (`source` with `changes`), tokenizer and manifests under `root`, in the form of the config's family
    (`base_tokenizer`: the SentencePiece model 2.0's is padded from); random features of the right shapes and
    ranges: text ids of the tokenizer without its start/stop ids, codes below start_mel_token."""
    config = write_config(root / "config.yaml", source, **(changes or {}))
    gpt = read_gpt(source, **(changes or {}))
    family = family_of(gpt)
    (root / "features").mkdir(parents=True, exist_ok=True)
    shape = _Shape(gpt, root, text_len, code_len, np.random.default_rng(seed))
    tokenizer, lines = WRITERS[family.name](shape, {"train": samples, "val": val_samples}, base_tokenizer)
    manifests = {}
    for split, rows in lines.items():
        manifests[split] = root / f"{split}.jsonl"
        manifests[split].write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return Corpus(manifests["train"], manifests["val"], tokenizer, config, text_len, code_len, samples,
                  family.model.prefix_len)


def _yaml(config: Path) -> dict[str, Any]:
    return yaml.safe_load(config.read_text(encoding="utf-8"))


def _dump(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path
