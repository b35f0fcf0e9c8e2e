"""Flags + the saved run + defaults -> the run's configuration, resolved once, before any model is built.

Order: built-in defaults < demo defaults (with --demo) < the settings saved with the run being
resumed < flags typed on this command line. Hardware-only settings are reused from the saved run
only on the same kind of machine. Values derived from the data and the checkpoints (freezing
the base vocabulary, the LR decay horizon, a weights-only start) are decided here too; nothing
downstream changes the result.
"""
from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainers.config.bounds import MAX_COUNT, value_problems
from trainers.config.flags import CommandLine
from trainers.config.settings import DEMO_DEFAULTS, FIELD_NAMES, HARDWARE_KEYS, TrainConfig
from trainers.data.demo_data import TOKENIZER_NAME, TRAIN_MANIFEST_NAME, VAL_MANIFEST_NAME
from trainers.errors import UserError
from trainers.hardware.detect import library_versions
from trainers.model.demo_base import BASE_NAME
from trainers.model.gpt_model import GPTConfig
from trainers.model.vocabulary import Vocabulary, check_extends, tokenizer_size
from trainers.model.weights import text_tokens_of
from trainers.run.inputs import (
    DEMO_DATA_DIR, RunInputs, ensure_demo_inputs, read_inputs, read_model_yaml, tokenizer_sha256,
)
from trainers.run.portable import locate_inputs
from trainers.run.run_dir import SavedRun, newest_checkpoint

log = logging.getLogger("train")

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines the run; the "run" section of a checkpoint."""

    train: TrainConfig
    gpt: GPTConfig
    run_dir: Path
    run_id: str
    vocab: Vocabulary
    fingerprints: dict[str, str]
    model_yaml: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "config": self.train.to_dict(), "model_config": self.gpt.to_dict(),
                "fingerprints": dict(self.fingerprints), "vocab": self.vocab.to_dict(), "versions": library_versions()}


@dataclass(frozen=True)
class Resolution:
    cfg: RunConfig
    inputs: RunInputs
    resume: SavedRun | None  # the run whose training state continues (None: step 0)


def resolve_run(cmd: CommandLine, run_dir: Path, saved: SavedRun | None, machine: str,
                world_size: int = 1) -> Resolution:
    settings = merge_settings(cmd, saved, run_dir, machine, world_size)
    located = locate_inputs(cmd.data_roots, cmd.given, settings, saved, run_dir)  # the run or its data moved
    settings = located.settings
    model_yaml = read_model_yaml(settings.config)
    ensure_demo_inputs(settings, model_yaml)
    text_tokens = tokenizer_size(settings.tokenizer)
    if saved and saved.checkpoint and saved.checkpoint.text_tokens != text_tokens:
        settings = _weights_only_start(cmd, settings, saved, text_tokens)
        saved = None
    # A resumed checkpoint carries the base checkpoint's tensors: the base file is read only to start at step 0.
    inputs = read_inputs(settings, model_yaml, text_tokens, tokenizer_sha256(settings.tokenizer),
                         read_base=not (saved and saved.checkpoint))
    if saved:
        located.refuse_changed(inputs.fingerprints, cmd.allow_config_change)
    if saved and saved.checkpoint:
        base_tokens = saved.checkpoint.base_text_tokens
    elif inputs.base_state is not None:
        base_tokens = text_tokens_of(inputs.base_state, Path(settings.base_checkpoint))
    else:
        base_tokens = text_tokens
    vocab = Vocabulary(text_tokens, base_tokens)
    freeze = settings.freeze_base_vocab if settings.freeze_base_vocab is not None else vocab.extended
    train = replace(settings, freeze_base_vocab=freeze,
                    lr_decay_steps=settings.lr_decay_steps or planned_steps(settings, len(inputs.train_samples)))
    check_horizon(train, len(inputs.train_samples))
    run_id = (saved.run_id if saved else "") or new_run_id()
    return Resolution(RunConfig(train, inputs.gpt, run_dir, run_id, vocab, inputs.fingerprints, model_yaml),
                      inputs, saved)


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def planned_steps(cfg: TrainConfig, num_samples: int) -> int:
    """Steps of --epochs over the data, or --max-steps if that comes first."""
    by_epochs = cfg.epochs * math.ceil(num_samples / cfg.effective_batch)
    return min(cfg.max_steps, by_epochs) if cfg.max_steps > 0 else by_epochs


def check_horizon(cfg: TrainConfig, num_samples: int) -> None:
    """The derived learning-rate horizon is saved with the run: keep it inside the range a resume accepts."""
    if cfg.lr_decay_steps > MAX_COUNT:
        raise UserError(f"--epochs {cfg.epochs} over {num_samples} samples is {cfg.lr_decay_steps} optimizer steps, "
                        f"more than {MAX_COUNT}; lower --epochs or pass --max-steps (nothing was written)")
    if cfg.warmup_steps >= cfg.lr_decay_steps:
        log.warning("--warmup-steps %d is not shorter than the learning-rate horizon of %d steps: the learning rate "
                    "never reaches its peak --learning-rate %g; lower --warmup-steps", cfg.warmup_steps,
                    cfg.lr_decay_steps, cfg.learning_rate)


def merge_settings(cmd: CommandLine, saved: SavedRun | None, run_dir: Path, machine: str,
                   world_size: int = 1) -> TrainConfig:
    values: dict[str, Any] = {}
    demo = cmd.given.get("demo", bool(saved and saved.settings.get("demo")))
    if demo:
        values.update(DEMO_DEFAULTS)
        values["config"] = str(REPO_ROOT / DEMO_DEFAULTS["config"])
        root = run_dir / DEMO_DATA_DIR
        values.update(train_manifests=[str(root / TRAIN_MANIFEST_NAME)], val_manifests=[str(root / VAL_MANIFEST_NAME)],
                      tokenizer=str(root / TOKENIZER_NAME), base_checkpoint=str(root / BASE_NAME))
    else:
        values["config"] = str(REPO_ROOT / TrainConfig.config)
    if saved:
        values.update({k: v for k, v in saved.settings.items() if k not in HARDWARE_KEYS})
        values.update(_saved_hardware_settings(saved, machine, cmd.given))
    values.update(_given_batch_split(cmd.given, world_size))
    values["output_dir"] = str(run_dir)
    cfg = TrainConfig.from_dict({k: v for k, v in values.items() if k in FIELD_NAMES})
    check_values(cfg)
    return cfg


def _saved_hardware_settings(saved: SavedRun, machine: str, given: dict[str, Any]) -> dict[str, Any]:
    """How the saved run split its steps, loaded its data and chose its device: reused only on the
    same kind of machine, and never over a flag typed now."""
    chosen = {k: v for k, v in saved.settings.items() if k in HARDWARE_KEYS and v != getattr(TrainConfig, k)}
    if {"batch_size", "grad_accumulation"} & given.keys():  # a new split replaces the whole saved one
        chosen = {k: v for k, v in chosen.items() if k not in ("batch_size", "grad_accumulation")}
    chosen = {k: v for k, v in chosen.items() if k not in given}
    if not chosen:
        return {}
    flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(chosen.items()))
    if saved.machine == machine:
        log.info("reusing %s saved with this run (same machine: %s); pass the flag again to change it, 0 or auto "
                 "for the automatic choice", flags, machine)
        return chosen
    log.info("not reusing %s: the run saved it on %s, this is %s; choosing automatically (pass the flags to set them)",
             flags, saved.machine or "an unknown machine", machine)
    return {}


def _given_batch_split(given: dict[str, Any], world_size: int = 1) -> dict[str, Any]:
    """The typed flags, with the batch split completed so it never contradicts the effective batch.

    Giving one of --batch-size / --grad-accumulation makes the other one derived (auto), so a
    resumed run may change its split freely. Giving both without --effective-batch sets the
    effective batch to their product, as in the community trainer (times the number of processes
    under torchrun, where the split is each process's).
    """
    given = dict(given)
    micro, accum = given.get("batch_size"), given.get("grad_accumulation")
    if micro is not None and accum is None:
        given["grad_accumulation"] = 0
    if accum is not None and micro is None:
        given["batch_size"] = 0
    if micro and accum:
        per_step = micro * accum * world_size
        processes = f" x {world_size} processes" if world_size > 1 else ""
        if "effective_batch" not in given:
            given["effective_batch"] = per_step
        elif per_step != given["effective_batch"]:
            raise UserError(f"--batch-size {micro} x --grad-accumulation {accum}{processes} = {per_step} samples "
                            f"per step, but --effective-batch is {given['effective_batch']}; give two of the three, "
                            "not all")
    return given


def check_values(cfg: TrainConfig) -> None:
    """Every setting inside its accepted range (trainers/config/bounds.py), all problems at once."""
    problems = value_problems(cfg.to_dict())
    if cfg.data_order not in ("grouped", "random"):
        problems.append(f"--data-order must be grouped or random, got {cfg.data_order!r}")
    if problems:
        raise UserError("\n".join([*problems, "nothing was written; fix these flags (a value saved with the run is "
                                               "replaced by passing its flag)"]))
    if not cfg.demo:
        if not cfg.train_manifests:
            raise UserError("no training data: pass --train-manifest FILE (or --demo for the built-in corpus)")
        if not cfg.tokenizer:
            raise UserError("no tokenizer: pass --tokenizer bpe.model (the SentencePiece model your text ids came from)")


def _weights_only_start(cmd: CommandLine, cfg: TrainConfig, saved: SavedRun, text_tokens: int) -> TrainConfig:
    """A checkpoint of another vocabulary size starts a new run from its weights, at step 0.

    Its optimizer moments, schedule and data position belong to a different set of trained
    rows and a different run, so they are dropped rather than half-reused.
    """
    assert saved.checkpoint is not None and saved.path is not None
    old = saved.checkpoint.text_tokens
    run_dir = Path(cfg.output_dir)
    found = newest_checkpoint(run_dir)
    if found is not None:
        raise UserError(
            f"the tokenizer has {text_tokens} pieces but {saved.path} was trained with {old} text tokens, so training "
            f"starts over at step 0 from its weights; {run_dir} already holds a run ({found.name}) that this would "
            "overwrite. Pass a new --output-dir (nothing was changed)")
    check_extends(saved.settings.get("tokenizer"), cfg.tokenizer, saved.path)
    log.warning("the tokenizer has %d pieces but %s was trained with %d text tokens: starting a NEW run at step 0 "
                "from its model weights only (fresh optimizer, learning-rate schedule and loss scaler; data order from "
                "the start). If you meant to continue that run, pass the tokenizer it was trained with", text_tokens,
                saved.path, old)
    rederived = {k: getattr(TrainConfig, k) for k in ("lr_decay_steps", "freeze_base_vocab") if k not in cmd.given}
    return replace(cfg, base_checkpoint=str(saved.path), **rederived)
