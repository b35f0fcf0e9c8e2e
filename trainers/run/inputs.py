"""Reading the run's input files: model config, manifests, base checkpoint, fingerprints.

Every check that can fail on the user's files runs here, before any model is built, so a bad
flag or manifest costs seconds, never touches a run directory, and is reported all at once.
"""
from __future__ import annotations

import difflib

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from trainers.config.config_yaml import read_config_yaml
from trainers.config.settings import BASE_FINGERPRINT, TrainConfig
from trainers.data.demo_data import DemoCorpusSpec, ensure_demo_assets
from trainers.data.feature_fit import check_features_fit
from trainers.data.features import FeatureSpec
from trainers.data.held_out import refuse_same_file, warn_overlap
from trainers.data.manifest import DataLimits, ManifestError, parse_manifest_spec
from trainers.data.manifest_cache import CheckedManifests, cache_path, read_manifests
from trainers.data.sample_table import SampleTable
from trainers.data.tokenizer_fit import check_text_ids
from trainers.errors import UserError
from trainers.files import dict_sha256, file_sha256
from trainers.model.demo_base import ensure_demo_base
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.weights import StateDict, check_base_fits, read_state_dict, refuse_bad_values

log = logging.getLogger("train")

DEMO_DATA_DIR = "demo_data"


@dataclass(frozen=True)
class RunInputs:
    model_yaml: dict[str, Any]
    gpt: GPTConfig
    train_samples: SampleTable
    val_samples: SampleTable | None
    fingerprints: dict[str, str]
    base_state: StateDict | None  # --base-checkpoint's tensors, read once
    checked: tuple[CheckedManifests, ...] = ()  # their validated-manifest caches, written once the run is locked

    def save_manifest_caches(self) -> None:
        for manifests in self.checked:
            manifests.save()


def read_model_yaml(path: str) -> dict[str, Any]:
    data = read_config_yaml(path, f"--config {path}", _config_advice(Path(path)))
    # Checked as soon as it is read: --demo builds its corpus from these values before the model config is.
    # number_text_tokens may be absent: the tokenizer's size replaces it.
    _raise_config_problems(path, GPTConfig.section_problems(data["gpt"], supplied=("number_text_tokens",))
                           + _misspelt_keys(data["gpt"]))
    return data


def _config_advice(path: Path) -> str:
    """The default --config and --demo's config live in checkpoints/ of a clone, which `pip install .`
    does not copy beside the package: say so instead of naming a site-packages path that never existed."""
    clone_configs = Path(__file__).resolve().parents[2] / "checkpoints"
    if path.parent == clone_configs and not clone_configs.is_dir():
        return ("this installed copy of the trainer has no checkpoints/ folder (it comes with a clone of the "
                "repository): pass --config with the IndexTTS2 config.yaml, or for --demo install a clone with "
                "pip install -e .")
    return "pass the IndexTTS2 config.yaml"


# gpt keys of the official config that only inference uses (the conditioning encoders, the mel front end).
INFERENCE_GPT_KEYS = frozenset({"use_mel_codes_as_input", "mel_length_compression", "train_solo_embeddings",
                                "condition_type", "condition_module", "emo_condition_module"})


def _misspelt_keys(section: dict[str, Any]) -> list[str]:
    """A gpt key that is neither ours nor upstream's but close to one of ours is a typo that would
    silently train with the other value (or the default): refused. Other unknown keys are kept, with a warning."""
    ours = {f.name for f in fields(GPTConfig)}
    problems = []
    for key in sorted(set(map(str, section)) - ours - INFERENCE_GPT_KEYS):
        close = difflib.get_close_matches(key, sorted(ours), n=1, cutoff=0.8)
        if close:
            problems.append(f"gpt.{key} is not a setting; did you mean gpt.{close[0]}? (as written, it would be "
                            f"ignored and the model built with gpt.{close[0]} {section.get(close[0], 'at its default')})")
        else:
            log.warning("--config: gpt.%s is not a setting the trainer or IndexTTS2 inference reads; it is kept in "
                        "the run's config.yaml but has no effect on training. Remove it if it is a typo", key)
    return problems


def _raise_config_problems(path: str, problems: list[str]) -> None:
    if problems:
        raise UserError("\n".join([*(f"--config {path}: {p}" for p in problems),
                                    "fix the gpt section of that file; nothing was written"]))


def ensure_demo_inputs(cfg: TrainConfig, model_yaml: dict[str, Any]) -> None:
    """With --demo, generate the built-in corpus, tokenizer and base checkpoint where the settings expect them."""
    root = Path(cfg.output_dir) / DEMO_DATA_DIR
    paths = [*cfg.train_manifests, *cfg.val_manifests, cfg.tokenizer, cfg.base_checkpoint]
    if not cfg.demo or not any(p and Path(p).parent == root for p in paths):
        return
    gpt = model_config(model_yaml["gpt"], cfg.config)  # the demo's tokenizer is trained to its number_text_tokens
    ensure_demo_assets(root, DemoCorpusSpec(model_dim=gpt.model_dim, vocab_size=gpt.number_text_tokens,
                                            num_codes=gpt.start_mel_token))
    ensure_demo_base(root, gpt)


def read_inputs(cfg: TrainConfig, model_yaml: dict[str, Any], text_tokens: int, tokenizer_sha: str,
                read_base: bool = True) -> RunInputs:
    gpt = gpt_config(model_yaml, cfg, text_tokens)
    limits = DataLimits(gpt.max_text_tokens, gpt.max_mel_tokens)
    run_dir = Path(cfg.output_dir)
    try:
        train_specs = [parse_manifest_spec(s) for s in cfg.train_manifests]
        val_specs = [parse_manifest_spec(s) for s in cfg.val_manifests]
        said: set[str] = set()  # the flags' manifests often share feature folders: why they are stat'ed, said once
        train = read_manifests(train_specs, limits, "--train-manifest", cache_path(run_dir, "--train-manifest"), said)
        val = (read_manifests(val_specs, limits, "--val-manifest", cache_path(run_dir, "--val-manifest"), said)
               if val_specs else None)
    except ManifestError as exc:
        raise UserError(f"the manifests have problems; nothing was trained:\n{exc}") from None
    if val is None:
        log.warning("no --val-manifest given: validation is skipped; pass one to track over-fitting")
    log.info("data: %d training samples from %d manifest(s), %d validation samples", len(train.table),
             len(train_specs), len(val.table) if val else 0)
    spec = FeatureSpec(gpt.model_dim, gpt.number_text_tokens, gpt.start_mel_token)
    check_features_fit([train.table, *([val.table] if val else [])], spec, cfg.config)
    fingerprints = {
        "data": train.fingerprint,
        "tokenizer": tokenizer_sha,
        "model_config": model_config_fingerprint(gpt),
    }
    if cfg.lora_rank and cfg.base_checkpoint:
        # A LoRA checkpoint holds no base tensors: its base is this file, recognised on resume by its bytes.
        fingerprints[BASE_FINGERPRINT] = file_sha256(Path(cfg.base_checkpoint))
    base_state = read_state_dict(Path(cfg.base_checkpoint)) if cfg.base_checkpoint and read_base else None
    if base_state is not None:
        refuse_bad_values(base_state, Path(cfg.base_checkpoint))
        with torch.device("meta"):  # shapes only: the check costs no memory and writes nothing
            check_base_fits(Path(cfg.base_checkpoint), base_state, UnifiedVoiceGPT(gpt).state_dict(),
                            report_unknown=False)  # said once, when the weights are loaded
    return RunInputs(model_yaml, gpt, train.table, val.table if val else None, fingerprints, base_state,
                     (train, *([val] if val else [])))


def check_fresh_data(cfg: TrainConfig, inputs: RunInputs, tokenizer_check: bool = True) -> None:
    """The checks of a fresh start (a resume holds its data and tokenizer to the run's fingerprints instead):
    validation held out from training, and text ids that --tokenizer makes."""
    train_specs = [parse_manifest_spec(s) for s in cfg.train_manifests]
    val_specs = [parse_manifest_spec(s) for s in cfg.val_manifests]
    refuse_same_file(train_specs, val_specs)
    if inputs.val_samples is not None:
        warn_overlap(inputs.train_samples, inputs.val_samples)
    if tokenizer_check:
        check_text_ids([*train_specs, *val_specs], cfg.tokenizer)


def model_config_fingerprint(gpt: GPTConfig) -> str:
    """The model config as it defines the run: every gpt setting but dropout (a setting of its own)."""
    return dict_sha256({k: v for k, v in gpt.to_dict().items() if k != "dropout"})


def tokenizer_sha256(path: str) -> str:
    return file_sha256(Path(path))


def gpt_config(model_yaml: dict[str, Any], cfg: TrainConfig, text_tokens: int) -> GPTConfig:
    section = model_yaml["gpt"]
    gpt = model_config(section, cfg.config, number_text_tokens=text_tokens, dropout=cfg.dropout)
    configured = section.get("number_text_tokens")
    if configured is not None and configured != text_tokens:
        log.info("the tokenizer has %d pieces, --config says gpt.number_text_tokens %s: the model uses %d",
                 text_tokens, configured, text_tokens)
    return gpt


def model_config(section: dict[str, Any], path: str, **overrides: Any) -> GPTConfig:
    try:
        return GPTConfig.from_yaml_section(section, **overrides)
    except ValueError as exc:
        _raise_config_problems(path, str(exc).splitlines())
        raise
