"""indextts-prepare's settings, each declared once (trainers/config/declare.py, as the trainer's): its flag, help,
default, range or choices, and what a later run over the same --out may do with it, as its resume class says:

  RESULT (features)  it shapes the feature files (which lines are kept, what computes them): saved with the output
                     (plan.json); a later run with another value is refused, since the features would be mixed
  FREE (manifests)   it shapes only the manifests written at the end (validation share, pairs): a later run may
                     change it, and the manifests are written again from the same features
  None (run)         how this invocation runs (device, batch size, shard): never saved, free to change

The flag parser, --help and the output's fingerprint are made from these declarations.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from trainers.config.bounds import MAX_COUNT, MAX_SEED, Bound
from trainers.config.declare import Resume, SettingsParser, given_values, names, setting, value_problems
from trainers.errors import UserError

FEATURES, MANIFESTS = Resume.RESULT, Resume.FREE
FAMILY_NAMES = ("indextts2", "indextts25")
FORMATS = ("auto", "jsonl", "csv", "ljspeech", "folder")
DESCRIPTION = ("From audio and transcripts to the manifests and feature files indextts-train reads "
               "(docs/data_preparation.md). Exit status: 0 every line kept; 3 manifests written, some lines skipped "
               "(OUT/skipped.txt); 2 bad flags, input or a refused --out; 5 out of memory with one clip.")


@dataclass(frozen=True)
class PrepareSettings:
    # What to read and where to write.
    input: Path | None = setting(None, "the utterance list (JSONL or CSV with id, audio, text, speaker, language; an "
                                 "LJSpeech-style metadata.csv) or a folder of audio files with .txt/.lab transcripts",
                                 metavar="LIST_OR_FOLDER", parse=Path)
    input_format: str = setting("auto", "how --input is written (auto: a folder, *.jsonl, metadata.csv without a "
                                "header, or a CSV/TSV with a header)", flag="--format", choices=FORMATS)
    out: Path | None = setting(None, "the output folder: manifests, features/ and the state a rerun continues from",
                               metavar="DIR", parse=Path)
    # The model: the family, its files, the backend computing the features.
    family: str | None = setting(None, "the model family (default: --config's; version 2.5 is indextts25)",
                                 resume=FEATURES, choices=FAMILY_NAMES)
    config: Path | None = setting(None, "the model's config.yaml (default: MODEL_DIR/config.yaml); its gpt section "
                                  "sets the text and code limits", parse=Path)
    model_dir: Path | None = setting(None, "the official checkpoints folder (IndexTTS-2 or IndexTTS-2.5)",
                                     metavar="DIR", parse=Path)
    indextts_dir: Path | None = setting(None, "a checkout of upstream IndexTTS (default: the installed indextts "
                                        "package)", metavar="DIR", parse=Path)
    tokenizer: Path | None = setting(None, "a tokenizer file to use instead of the model folder's (an extended "
                                     "bpe.model)", parse=Path)
    backend: str = setting("upstream", "what computes the features: upstream (IndexTTS's own feature code and "
                           "models) or demo (tiny stand-in models, for trying the pipeline)", resume=FEATURES,
                           choices=("upstream", "demo"))
    # Which lines are kept.
    speaker: str | None = setting(None, "the speaker of lines that name none (default: the input folder's name)",
                                  resume=FEATURES)
    language: str | None = setting(None, "the language of lines that name none (IndexTTS-2.5 needs one per line)",
                                   resume=FEATURES)
    min_seconds: float = setting(0.5, "skip clips shorter than this", resume=FEATURES, bound=Bound(float, 0.0, 3600.0))
    silence_db: float = setting(-60.0, "skip clips whose loudest sample is below this level (dB of full scale)",
                                resume=FEATURES, bound=Bound(float, -200.0, 0.0))
    # The manifests.
    val_fraction: float = setting(0.05, "share of the kept utterances held out for validation, chosen by --seed "
                                  "(0: none)", resume=MANIFESTS, bound=Bound(float, 0.0, 0.5))
    pairs_per_target: int = setting(1, "prompts drawn for each target utterance (each a pair line)",
                                    resume=MANIFESTS, bound=Bound(int, 1, 64))
    cross_lingual: bool = setting(False, "draw prompts from all of the speaker's utterances, in any language "
                                  "(default: the target's language only)", resume=MANIFESTS)
    seed: int = setting(1234, "seed of the validation choice and the prompts", resume=MANIFESTS,
                        bound=Bound(int, 0, MAX_SEED))
    # How this invocation runs.
    device: str = setting("auto", "torch device for the feature models: auto (a GPU if there is one), cpu, cuda, "
                          "cuda:N")
    batch_size: int = setting(0, "clips of the longest length per batch (0: from the device's memory; 16 on a CPU)",
                              bound=Bound(int, 0, 4096))
    shard: str | None = setting(None, "prepare only shard I of N (1-based; under torchrun RANK+1 of WORLD_SIZE); "
                                "the last shard to finish writes the manifests", metavar="I/N")
    merge: bool = setting(False, "only write the manifests from the finished shards' features")
    update: bool = setting(False, "accept a changed --input: keep the features of unchanged lines, make those of new "
                           "or changed ones, drop removed ones from the manifests")
    demo: bool = setting(False, "synthesise a little audio, prepare it with stand-in models into --out (default "
                         "runs/prepare_demo) and train a few steps on it")
    demo_steps: int = setting(20, "--demo: optimizer steps to train on the prepared data (0: only print the "
                              "training command)", bound=Bound(int, 0, MAX_COUNT))

    def fingerprinted(self) -> dict[str, Any]:
        """The settings that shape the features, as saved with the output."""
        return _plain({name: getattr(self, name) for name in names(PrepareSettings, FEATURES)})

    def manifest_settings(self) -> dict[str, Any]:
        return _plain({name: getattr(self, name) for name in names(PrepareSettings, MANIFESTS)})


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


def build_parser() -> SettingsParser:
    """The command's flags, one per PrepareSettings field, from its declaration."""
    return SettingsParser("indextts-prepare", DESCRIPTION, PrepareSettings)


def parse_settings(argv: Sequence[str] | None) -> PrepareSettings:
    """The settings of a command line: argparse's usage error (exit 2) for a malformed one, UserError for a value out
    of its range (the saved classes' ranges are checked after parsing, as the trainer's)."""
    values = given_values(PrepareSettings, vars(build_parser().parse_args(argv)))
    problems = value_problems(PrepareSettings, values)
    if problems:
        raise UserError("; ".join(problems))
    return PrepareSettings(**{**asdict(PrepareSettings()), **values})


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
