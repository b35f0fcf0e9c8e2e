"""indextts-prepare's settings, each declared once: its flag, help, default, range or choices, and what it
changes (the flag parser, --help and the output's fingerprint are all made from these declarations).

What a setting changes decides what a later run over the same --out may do with it:
  features   the feature files (which lines are kept and what is computed): saved with the output; a later
             run with another value is refused (the features would mix two settings)
  manifests  only the manifests written at the end (validation share, pairs): a later run may change it, and
             the manifests are written again from the same features
  run        how this invocation runs (device, batch size, shard): free to change between runs
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from trainers.config.bounds import MAX_COUNT, MAX_SEED, Bound, bounded_number

FEATURES, MANIFESTS, RUN = "features", "manifests", "run"
FAMILY_NAMES = ("indextts2", "indextts25")
FORMATS = ("auto", "jsonl", "csv", "ljspeech", "folder")


def setting(default: Any, help: str, *, affects: str, flag: str | None = None, bound: Bound | None = None,
            choices: Sequence[str] | None = None, metavar: str | None = None, parse: type | None = None) -> Any:
    """A field of PrepareSettings with its declaration in the field's metadata (flag None: --NAME-WITH-DASHES)."""
    return field(default=default, metadata={"help": help, "affects": affects, "flag": flag, "bound": bound,
                                            "choices": tuple(choices) if choices else None, "metavar": metavar,
                                            "parse": parse})


@dataclass(frozen=True)
class PrepareSettings:
    # What to read and where to write.
    input: Path | None = setting(None, "the utterance list (JSONL or CSV with id, audio, text, speaker, language; an "
                                 "LJSpeech-style metadata.csv) or a folder of audio files with .txt/.lab transcripts",
                                 affects=RUN, metavar="LIST_OR_FOLDER", parse=Path)
    input_format: str = setting("auto", "how --input is written (auto: a folder, *.jsonl, metadata.csv without a "
                                "header, or a CSV/TSV with a header)", affects=RUN, flag="--format", choices=FORMATS)
    out: Path | None = setting(None, "the output folder: manifests, features/ and the state a rerun continues from",
                               affects=RUN, metavar="DIR", parse=Path)
    # The model: the family, its files, the backend computing the features.
    family: str | None = setting(None, "the model family (default: --config's; version 2.5 is indextts25)",
                                 affects=FEATURES, choices=FAMILY_NAMES)
    config: Path | None = setting(None, "the model's config.yaml (default: MODEL_DIR/config.yaml); its gpt section "
                                  "sets the text and code limits", affects=RUN, parse=Path)
    model_dir: Path | None = setting(None, "the official checkpoints folder (IndexTTS-2 or IndexTTS-2.5)",
                                     affects=RUN, metavar="DIR", parse=Path)
    indextts_dir: Path | None = setting(None, "a checkout of upstream IndexTTS (default: the installed indextts "
                                        "package)", affects=RUN, metavar="DIR", parse=Path)
    tokenizer: Path | None = setting(None, "a tokenizer file to use instead of the model folder's (an extended "
                                     "bpe.model)", affects=RUN, parse=Path)
    backend: str = setting("upstream", "what computes the features: upstream (IndexTTS's own feature code and "
                           "models) or demo (tiny stand-in models, for trying the pipeline)", affects=FEATURES,
                           choices=("upstream", "demo"))
    # Which lines are kept.
    speaker: str | None = setting(None, "the speaker of lines that name none (default: the input folder's name)",
                                  affects=FEATURES)
    language: str | None = setting(None, "the language of lines that name none (IndexTTS-2.5 needs one per line)",
                                   affects=FEATURES)
    min_seconds: float = setting(0.5, "skip clips shorter than this", affects=FEATURES,
                                 bound=Bound(float, 0.0, 3600.0))
    silence_db: float = setting(-60.0, "skip clips whose loudest sample is below this level (dB of full scale)",
                                affects=FEATURES, bound=Bound(float, -200.0, 0.0))
    # The manifests.
    val_fraction: float = setting(0.05, "share of the kept utterances held out for validation, chosen by --seed "
                                  "(0: none)", affects=MANIFESTS, bound=Bound(float, 0.0, 0.5))
    pairs_per_target: int = setting(1, "prompts drawn for each target utterance (each a pair line)",
                                    affects=MANIFESTS, bound=Bound(int, 1, 64))
    cross_lingual: bool = setting(False, "draw prompts from all of the speaker's utterances, in any language (default: "
                                  "the target's language only)", affects=MANIFESTS)
    seed: int = setting(1234, "seed of the validation choice and the prompts", affects=MANIFESTS,
                        bound=Bound(int, 0, MAX_SEED))
    # How this invocation runs.
    device: str = setting("auto", "torch device for the feature models: auto (a GPU if there is one), cpu, cuda, "
                          "cuda:N", affects=RUN)
    batch_size: int = setting(0, "clips of the longest length per batch (0: from the device's memory; 16 on a CPU)",
                              affects=RUN, bound=Bound(int, 0, 4096))
    shard: str | None = setting(None, "prepare only shard I of N (1-based; under torchrun RANK+1 of WORLD_SIZE); "
                                "the last shard to finish writes the manifests", affects=RUN, metavar="I/N")
    merge: bool = setting(False, "only write the manifests from the finished shards' features", affects=RUN)
    update: bool = setting(False, "accept a changed --input: keep the features of unchanged lines, make those of new "
                           "or changed ones, drop removed ones from the manifests", affects=RUN)
    demo: bool = setting(False, "synthesise a little audio, prepare it with stand-in models into --out (default "
                         "runs/prepare_demo) and train a few steps on it", affects=RUN)
    demo_steps: int = setting(20, "--demo: optimizer steps to train on the prepared data (0: only print the "
                              "training command)", affects=RUN, bound=Bound(int, 0, MAX_COUNT))

    def flag(self, name: str) -> str:
        return flag_of(name)

    def fingerprinted(self) -> dict[str, Any]:
        """The settings that shape the features, as saved with the output."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.metadata["affects"] == FEATURES}

    def manifest_settings(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.metadata["affects"] == MANIFESTS}


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def flag_of(name: str) -> str:
    declared = next(f for f in fields(PrepareSettings) if f.name == name).metadata["flag"]
    return declared or "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The command's flags, one per PrepareSettings field, from its declaration."""
    p = argparse.ArgumentParser(
        prog="indextts-prepare",
        description="From audio and transcripts to the manifests and feature files indextts-train reads "
                    "(docs/data_preparation.md). Exit status: 0 every line kept; 3 manifests written, some lines "
                    "skipped (OUT/skipped.txt); 2 bad flags, input or a refused --out; 5 out of memory with one clip.")
    for f in fields(PrepareSettings):
        meta = f.metadata
        name = flag_of(f.name)
        default = f.default if f.default is not MISSING else None
        if f.type in ("bool", bool):
            p.add_argument(name, dest=f.name, action="store_true", default=default, help=meta["help"])
            continue
        bound: Bound | None = meta["bound"]
        kind = bounded_number(bound) if bound else meta["parse"] or str
        text = meta["help"]
        if bound is not None:
            text += f" ({bound.range_text()})"
        if default is not None:
            text += f"; default {default}"
        p.add_argument(name, dest=f.name, type=kind, default=default, choices=meta["choices"],
                       metavar=meta["metavar"], help=text)
    return p


def parse_settings(argv: Sequence[str] | None) -> PrepareSettings:
    """The settings of a command line; argparse's usage error (exit 2) for a malformed one."""
    return PrepareSettings(**vars(build_parser().parse_args(argv)))


@dataclass(frozen=True)
class Shard:
    """Shard `index` (1-based) of `count`."""

    index: int = 1
    count: int = 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str | None, environ: dict[str, str]) -> "Shard":
        """--shard I/N, else torchrun's RANK/WORLD_SIZE, else the whole input. ValueError says what is wrong."""
        if text is None:
            if "RANK" in environ and "WORLD_SIZE" in environ:
                return cls(int(environ["RANK"]) + 1, int(environ["WORLD_SIZE"]))
            return cls()
        index, slash, count = text.partition("/")
        if not (slash and index.isdigit() and count.isdigit()):
            raise ValueError(f"--shard {text}: write it as I/N, e.g. --shard 1/4 for the first of 4 shards")
        shard = cls(int(index), int(count))
        if not 1 <= shard.index <= shard.count or shard.count > MAX_COUNT:
            raise ValueError(f"--shard {text}: shards are numbered 1 to N (e.g. 1/4 ... 4/4)")
        return shard
