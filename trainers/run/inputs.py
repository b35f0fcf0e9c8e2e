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
from trainers.data.feature_fit import check_features_fit
from trainers.data.held_out import refuse_same_file, warn_overlap
from trainers.data.manifest import ManifestError, parse_manifest_spec
from trainers.data.manifest_cache import CheckedManifests, cache_path, read_manifests
from trainers.data.mixing import Mixing, build_mixing
from trainers.data.sample_table import SampleTable
from trainers.data.tokenizer_fit import check_text_ids
from trainers.errors import UserError
from trainers.families import FAMILIES, ModelFamily, family_for_config
from trainers.families.checks import refuse_other_base, refuse_other_features, refuse_other_manifests
from trainers.files import dict_sha256, file_sha256, os_error_in_chain
from trainers.training.forgetting import Guard, language_problems
from trainers.model.gpt_model import GPTConfig
from trainers.model.weights import StateDict, check_base_fits, read_state_dict, refuse_bad_values

log = logging.getLogger("train")

DEMO_DATA_DIR = "demo_data"
DATA_SHARES = "data_shares"  # the run fingerprint of the replay shares (trainers/data/mixing.py)


@dataclass(frozen=True)
class RunInputs:
    model_yaml: dict[str, Any]
    gpt: GPTConfig
    train_samples: SampleTable
    val_samples: SampleTable | None
    fingerprints: dict[str, str]
    base_state: StateDict | None  # --base-checkpoint's tensors, read once
    checked: tuple[CheckedManifests, ...] = ()  # their validated-manifest caches, written once the run is locked
    family: ModelFamily = FAMILIES["indextts2"]
    mixing: Mixing | None = None  # replay manifests (--train-manifest F::LANG@SHARE) and the target samples

    @property
    def epoch_samples(self) -> int:
        """The samples an epoch is made of: all training samples, or with replay mixing the target manifests'."""
        return len(self.mixing.target) if self.mixing else len(self.train_samples)

    @property
    def epoch_batch(self) -> int | None:
        """Target samples per step with replay mixing (None: the effective batch)."""
        return self.mixing.target_per_step if self.mixing else None


def read_model_yaml(path: str, family: ModelFamily | None = None) -> dict[str, Any]:
    """The config.yaml, its gpt section checked for `family` (by default the family the config belongs to)."""
    data = read_config_yaml(path, f"--config {path}", _config_advice(Path(path)))
    family = family or family_for_config(data)
    # Checked as soon as it is read: --demo builds its corpus from these values before the model config is.
    # number_text_tokens may be absent: the tokenizer's size replaces it.
    _raise_config_problems(path, family.config.section_problems(data["gpt"], supplied=("number_text_tokens",))
                           + _misspelt_keys(data["gpt"], family))
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


def _misspelt_keys(section: dict[str, Any], family: ModelFamily) -> list[str]:
    """A gpt key that is neither ours nor upstream's but close to one of ours is a typo that would
    silently train with the other value (or the default): refused. Other unknown keys are kept, with a warning."""
    ours = {f.name for f in fields(family.config)}
    problems = []
    for key in sorted(set(map(str, section)) - ours - family.inference_gpt_keys):
        close = difflib.get_close_matches(key, sorted(ours), n=1, cutoff=0.8)
        if close:
            problems.append(f"gpt.{key} is not a setting; did you mean gpt.{close[0]}? (as written, it would be "
                            f"ignored and the model built with gpt.{close[0]} {section.get(close[0], 'at its default')})")
        else:
            log.warning("--config: gpt.%s: neither the trainer nor IndexTTS2 inference reads it;", key)
            log.warning("it is kept in the run's config.yaml but has no effect on training. Remove it if it is a typo")
    return problems


def _raise_config_problems(path: str, problems: list[str]) -> None:
    if problems:
        raise UserError("\n".join([*(f"--config {path}: {p}" for p in problems),
                                    "fix the gpt section of that file; nothing was written"]))


def ensure_demo_inputs(cfg: TrainConfig, model_yaml: dict[str, Any], family: ModelFamily) -> None:
    """With --demo, generate the built-in corpus, tokenizer and base checkpoint where the settings expect them."""
    root = Path(cfg.output_dir) / DEMO_DATA_DIR
    paths = [*cfg.train_manifests, *cfg.val_manifests, cfg.tokenizer, cfg.base_checkpoint]
    if not cfg.demo or not any(p and Path(p).parent == root for p in paths):
        return
    # The demo's tokenizer is trained to the config's number_text_tokens.
    gpt = model_config(model_yaml["gpt"], cfg.config, family)
    try:
        family.make_demo(root, gpt)
    except FileExistsError as exc:  # a folder of someone else's files where the corpus goes
        raise UserError(f"{exc} (nothing was trained)") from None
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        cause = os_error_in_chain(exc)
        if cause is None:
            raise
        raise UserError(f"cannot write the demo corpus in {root}: {cause.strerror or cause}; free disk space or "
                        "pass an --output-dir on another disk (nothing was trained)") from None


def read_inputs(cfg: TrainConfig, model_yaml: dict[str, Any], text_tokens: int, family: ModelFamily,
                read_base: bool = True) -> RunInputs:
    gpt = gpt_config(model_yaml, cfg, text_tokens, family)
    limits = family.data_limits(gpt)
    run_dir = Path(cfg.output_dir)
    try:
        train_specs = [parse_manifest_spec(s) for s in cfg.train_manifests]
        val_specs = [parse_manifest_spec(s) for s in cfg.val_manifests]
        refuse_other_manifests(family, train_specs, "--train-manifest", cfg.config)
        refuse_other_manifests(family, val_specs, "--val-manifest", cfg.config)
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
    check_features_fit([train.table, *([val.table] if val else [])], family.feature_spec(gpt), cfg.config)
    refuse_other_features(family, gpt, [train.table, *([val.table] if val else [])], cfg.config)
    fingerprints = {
        "data": train.fingerprint,
        "tokenizer": file_sha256(Path(cfg.tokenizer)),
        "model_config": model_config_fingerprint(gpt),
    }
    validated = cfg.validated_samples(len(val.table)) if val else 0
    mixing = build_mixing(cfg.train_manifests, train.table, cfg.effective_batch,
                          list(val.table.languages(validated)) if val else [], validated)
    if mixing:  # which samples make a step: a change of the shares is a change of the training data
        fingerprints[DATA_SHARES] = mixing.describe()
        log.info("%s", mixing.summary())
    guard_problems = language_problems(Guard.of(cfg, mixing.languages if mixing else ()),
                                       list(val.table.languages(validated)) if val else [], validated)
    if guard_problems:
        raise UserError("\n".join([*guard_problems, "nothing was written"]))
    if cfg.lora_rank and cfg.base_checkpoint:
        # A LoRA checkpoint holds no base tensors: its base is this file, recognised on resume by its bytes.
        fingerprints[BASE_FINGERPRINT] = file_sha256(Path(cfg.base_checkpoint))
    base_state = read_state_dict(Path(cfg.base_checkpoint)) if cfg.base_checkpoint and read_base else None
    if base_state is not None:
        refuse_other_base(family, base_state, Path(cfg.base_checkpoint), cfg.config)
        refuse_bad_values(base_state, Path(cfg.base_checkpoint))
        with torch.device("meta"):  # shapes only: the check costs no memory and writes nothing
            check_base_fits(Path(cfg.base_checkpoint), base_state, family.build_model(gpt).state_dict(),
                            report_unknown=False, layout=family.layout)  # said once, when the weights are loaded
    return RunInputs(model_yaml, gpt, train.table, val.table if val else None, fingerprints, base_state,
                     (train, *([val] if val else [])), family, mixing)


def check_fresh_data(cfg: TrainConfig, inputs: RunInputs, tokenizer_check: bool = True) -> None:
    """The checks of a fresh start (a resume holds its data and tokenizer to the run's fingerprints instead):
    validation held out from training, and text ids that --tokenizer makes."""
    train_specs = [parse_manifest_spec(s) for s in cfg.train_manifests]
    val_specs = [parse_manifest_spec(s) for s in cfg.val_manifests]
    refuse_same_file(train_specs, val_specs)
    if inputs.val_samples is not None:
        warn_overlap(inputs.train_samples, inputs.val_samples)
    if tokenizer_check and inputs.family.tokenizer.checks_manifest_text:
        check_text_ids([*train_specs, *val_specs], cfg.tokenizer)
    elif tokenizer_check:
        log.info("--tokenizer: the manifests' text ids are not re-encoded at start for %s", inputs.family.title)
        log.info("(its front end's language normalisation does not run here); make them with indextts-retokenize")


def model_config_fingerprint(gpt: GPTConfig) -> str:
    """The model config as it defines the run: every gpt setting but dropout (a setting of its own)."""
    return dict_sha256({k: v for k, v in gpt.to_dict().items() if k != "dropout"})


def gpt_config(model_yaml: dict[str, Any], cfg: TrainConfig, text_tokens: int, family: ModelFamily) -> GPTConfig:
    section = model_yaml["gpt"]
    gpt = model_config(section, cfg.config, family, number_text_tokens=text_tokens, dropout=cfg.dropout)
    configured = section.get("number_text_tokens")
    problem = family.tokenizer.config_size_problem(text_tokens, configured)
    if problem:
        raise UserError(f"--config {cfg.config}: {problem}; --tokenizer {cfg.tokenizer} and the config belong to "
                        "different models or releases (nothing was written)")
    if configured is not None and configured != text_tokens:
        log.info("the tokenizer has %d pieces, --config says gpt.number_text_tokens %s: the model uses %d",
                 text_tokens, configured, text_tokens)
    return gpt


def model_config(section: dict[str, Any], path: str, family: ModelFamily, **overrides: Any) -> GPTConfig:
    try:
        return family.read_config(section, **overrides)
    except ValueError as exc:
        _raise_config_problems(path, str(exc).splitlines())
        raise
