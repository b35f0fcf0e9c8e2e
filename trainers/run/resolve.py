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

from trainers.config.bounds import MAX_COUNT
from trainers.config.declare import declared, value_problems
from trainers.config.flags import CommandLine
from trainers.config.manifest_flags import validation_share_problems
from trainers.config.settings import (
    DEMO_DEFAULTS, FIELD_NAMES, HARDWARE_KEYS, LORA_KEYS, LORA_TARGET_PATHS, METRIC_SOURCES, TrainConfig,
)
from trainers.data.mixing import share_problems
from trainers.data.demo_data import TOKENIZER_NAME, TRAIN_MANIFEST_NAME, VAL_MANIFEST_NAME
from trainers.errors import UserError
from trainers.families import ModelFamily, family_for_config, family_named
from trainers.families.checks import refuse_other_tokenizer
from trainers.log_lines import log_fitting
from trainers.model.demo_base import BASE_NAME
from trainers.model.vocabulary import Vocabulary
from trainers.model.weights import text_tokens_of
from trainers.run.inputs import (
    DEMO_DATA_DIR, RunInputs, check_fresh_data, ensure_demo_inputs, read_inputs, read_model_yaml,
)
from trainers.run.lora_branch import is_lora_branch, start_lora_branch
from trainers.run.portable import REPO_ROOT, locate_inputs
from trainers.run import run_plan
from trainers.run.run_dir import RunConfig, SavedRun, newest_checkpoint, run_identity

log = logging.getLogger("train")


@dataclass(frozen=True)
class Resolution:
    cfg: RunConfig
    inputs: RunInputs
    resume: SavedRun | None  # the run whose training state continues (None: step 0)
    branch: dict[str, Any] | None = None  # another directory's checkpoint continued: run_plan.branch_record


def resolve_run(cmd: CommandLine, run_dir: Path, saved: SavedRun | None, machine: str,
                world_size: int = 1) -> Resolution:
    settings = merge_settings(cmd, saved, run_dir, machine, world_size)
    located = locate_inputs(cmd.data_roots, cmd.given, settings, saved, run_dir)  # the run or its data moved
    settings = located.settings
    model_yaml = read_model_yaml(settings.config)
    family = run_family(model_yaml, saved, settings.config)
    settings = _demo_tokenizer(settings, family, cmd, run_dir)
    ensure_demo_inputs(settings, model_yaml, family)
    refuse_other_tokenizer(family, settings.tokenizer, settings.config)
    text_tokens = family.tokenizer.size(settings.tokenizer)
    lora_branch, origin = None, saved  # the checkpoint a LoRA branch starts from, which it no longer continues
    if is_lora_branch(settings, saved, run_dir):
        assert saved is not None
        settings, lora_branch = start_lora_branch(cmd, settings, saved, run_dir, text_tokens,
                                                  family.tokenizer)
        saved = None
    elif saved and saved.checkpoint and saved.checkpoint.text_tokens != text_tokens:
        settings = _weights_only_start(cmd, settings, saved, text_tokens, family)
        saved = None
    resumed = saved.checkpoint if saved else None  # whose training state continues (None: step 0)
    # A resumed full checkpoint carries the base checkpoint's tensors: the base file is read only to start at step 0.
    # A LoRA checkpoint holds only what the run trains: its base is read on resume too.
    inputs = read_inputs(settings, model_yaml, text_tokens, family,
                         read_base=resumed is None or settings.lora_rank > 0)
    if saved:
        located.refuse_changed(inputs.fingerprints, cmd.allow_config_change)
    if resumed:
        base_tokens = resumed.base_text_tokens
    else:
        check_fresh_data(settings, inputs, cmd.tokenizer_check)
        base_tokens = (text_tokens_of(inputs.base_state, Path(settings.base_checkpoint))
                       if inputs.base_state is not None else text_tokens)
    vocab = Vocabulary(text_tokens, base_tokens)
    freeze = settings.freeze_base_vocab if settings.freeze_base_vocab is not None else vocab.extended
    n_train = _samples_per_epoch(settings, inputs.epoch_samples, inputs.mixing is not None)
    if inputs.mixing is None:  # with replay shares the mixing's own checks say what a step can hold
        settings = _batch_within_data(settings, n_train)
    per_step = inputs.epoch_batch or settings.effective_batch  # with replay mixing: the target samples of a step
    steps_per_epoch = math.ceil(n_train / per_step)
    settings = _additional_epochs(cmd, settings, saved, steps_per_epoch)
    by_epochs = settings.epochs * steps_per_epoch  # the learning-rate horizon, unless --max-steps comes first
    horizon = min(settings.max_steps, by_epochs) if settings.max_steps > 0 else by_epochs
    train = replace(settings, freeze_base_vocab=freeze, lr_decay_steps=settings.lr_decay_steps or horizon)
    check_new_rows(train, family, inputs.gpt.number_text_tokens, vocab, inputs.train_samples.language_counts())
    check_horizon(train, n_train, warn=saved is None, warmup_given="warmup_steps" in cmd.given)
    branch = _branch_record(origin, lora_branch or _branch_of(saved, run_dir))
    if origin and origin.branch_id:  # this directory's branch, stopped before its first save, goes on
        run_id = origin.branch_id
    else:
        run_id = uuid.uuid4().hex[:16] if branch or not (saved and saved.run_id) else saved.run_id
    return Resolution(RunConfig(train, inputs.gpt, run_dir, run_id, vocab, inputs.fingerprints, model_yaml, family),
                      inputs, saved, branch)


def _branch_record(origin: SavedRun | None, history: str | None) -> dict[str, Any] | None:
    """What run_config.json records of the checkpoint a branch continues: a branch started now (`history` says
    from where) or a LoRA branch continued at step 0 by --resume auto (its record read back)."""
    if origin is None:
        return None
    if history and origin.path and origin.plan_key:
        return run_plan.branch_record(origin.path, origin.plan_key, history)
    return origin.branch if origin.checkpoint is None else None


def check_new_rows(settings: TrainConfig, family: ModelFamily, text_tokens: int, vocab: Vocabulary,
                   trained: dict[str, int]) -> None:
    """--new-language needs a family with language rows, codes it knows and training samples in each language
    (`trained`: the training samples per language): a row no sample reaches gets no gradient, so the run would
    train everything but the language it was started for; --new-rows-lr-scale needs rows that are held (a new
    language's tables, or an extended vocabulary's with --freeze-base-vocab)."""
    if settings.new_languages:
        if family.language_rows is None:
            raise UserError(f"--new-language: {family.title} has no language rows; a new language there is a "
                            "tokenizer extension (docs/new_language.md); nothing was written")
        try:
            family.language_rows(text_tokens, settings.new_languages)
        except ValueError as exc:
            raise UserError(f"{exc}; nothing was written") from None
        counts: dict[str, int] = {}
        for lang, n in trained.items():
            counts[lang.lower()] = counts.get(lang.lower(), 0) + n
        absent = [code for code in settings.new_languages if code not in counts]
        if absent:
            codes, have = ",".join(absent), ", ".join(f"{lang or 'none'} {n}" for lang, n in counts.items())
            raise UserError("\n".join([
                f"--new-language {codes}: none of the {sum(counts.values())} training samples is in {codes} (by "
                f"language: {have})", f"no sample reaches the rows of {codes}, so they would never train: pass "
                "--new-language with the language of the data,",
                f"or give the {codes} data its language (--train-manifest F::{absent[0]}, or the lines' language); "
                "nothing was written"]))
    elif settings.new_rows_lr_scale != 1.0 and not (vocab.extended and settings.freeze_base_vocab):
        raise UserError(f"--new-rows-lr-scale {settings.new_rows_lr_scale:g} scales the rows that train beside held "
                        "ones: pass --new-language (IndexTTS-2.5) or train an extended tokenizer with "
                        "--freeze-base-vocab; nothing was written")


def run_family(model_yaml: dict[str, Any], saved: SavedRun | None, config: str) -> ModelFamily:
    """The model family of the run: its config's, which must be the family of the checkpoint it continues."""
    family = family_for_config(model_yaml)
    if saved and saved.checkpoint:
        trained = family_named(saved.checkpoint.model_family, str(saved.path))
        if trained is not family:
            raise UserError(f"--config {config} is a config of {family.title}, but {saved.path} is a checkpoint of "
                            f"{trained.title}: resume with the config of the model it trains (nothing was written)")
    return family


def _demo_tokenizer(settings: TrainConfig, family: ModelFamily, cmd: CommandLine, run_dir: Path) -> TrainConfig:
    """--demo's tokenizer is its family's file of the demo folder (merge_settings names IndexTTS2's before the
    config is read)."""
    default = run_dir / DEMO_DATA_DIR / TOKENIZER_NAME
    if not settings.demo or "tokenizer" in cmd.given or Path(settings.tokenizer or "") != default:
        return settings
    return replace(settings, tokenizer=str(default.with_name(family.demo_tokenizer_name)))


def _branch_of(saved: SavedRun | None, run_dir: Path) -> str | None:
    """A checkpoint from another directory continued in an empty one starts a branch: a run of its own (or goes on
    with the branch of it that the directory holds, stopped before its first save)."""
    if not (saved and saved.checkpoint and saved.path) or saved.path.resolve().parent == run_dir.resolve():
        return None
    if not saved.branch_id and run_identity(run_dir) is not None:
        return None  # the same run (checked before): it simply continues here
    origin = f"run {saved.run_id or '(no identity)'} at step {saved.checkpoint.step} ({saved.path})"
    if saved.branch_id:
        log_fitting(log, f"continuing the branch {saved.branch_id} of {origin} in {run_dir}",
                    f"continuing the branch {saved.branch_id} in {run_dir}", f"(a branch of {origin})")
        log.info("(stopped before its first save); that run is left as it is")
    else:
        log.info("starting a branch of %s in %s", origin, run_dir)
        log.info("that run is left as it is")
    return f"branched from {origin}"


def _samples_per_epoch(cfg: TrainConfig, available: int, mixed: bool = False) -> int:
    if cfg.train_samples > available:
        which = "target manifests (those without a replay share)" if mixed else "training manifests"
        raise UserError(f"--train-samples {cfg.train_samples}: the {which} hold {available} samples; pass "
                        f"at most {available} (0 uses all of them)")
    return cfg.train_samples or available


def _batch_within_data(cfg: TrainConfig, n_train: int) -> TrainConfig:
    """An effective batch larger than the training samples: every step holds all of them (one step per epoch),
    which is exactly what an effective batch of that many trains: the same samples and micro-batches at every
    step, the same schedule (tests/test_data_mistakes.py). The run takes that number, so the batch it logs and
    saves is the one a step holds, and a resume given the larger number again agrees with it."""
    if cfg.effective_batch <= n_train:
        return cfg
    of = f"--train-samples {cfg.train_samples}" if cfg.train_samples else "the training manifests"
    log.warning("--effective-batch %d is more than the %d training samples (%s)", cfg.effective_batch, n_train, of)
    log.warning("training with effective batch %d: every step holds all %d, one step per epoch", n_train, n_train)
    log.warning("pass --effective-batch %d (or add data) to silence this", n_train)
    return replace(cfg, effective_batch=n_train)


def _additional_epochs(cmd: CommandLine, cfg: TrainConfig, saved: SavedRun | None,
                       per_epoch: int) -> TrainConfig:
    """--additional-epochs N: the run ends N x (steps per epoch) optimizer steps after where it stands."""
    if not cmd.additional_epochs:
        return cfg
    if not (saved and saved.checkpoint):
        raise UserError("--additional-epochs continues a run: pass it with --resume auto (or best, or PATH) on a run "
                        "that has a checkpoint; for a new run use --epochs")
    if {"max_steps", "epochs"} & cmd.given.keys():
        raise UserError("--additional-epochs sets where the run ends: pass it without --max-steps and --epochs")
    end = saved.checkpoint.step + cmd.additional_epochs * per_epoch
    log.info("--additional-epochs %d: training to step %d (%d more steps from step %d, epoch %d)",
             cmd.additional_epochs, end, end - saved.checkpoint.step, saved.checkpoint.step, saved.checkpoint.epoch)
    return replace(cfg, max_steps=end, epochs=max(cfg.epochs, saved.checkpoint.epoch + cmd.additional_epochs + 1))


def _scaled_learning_rate(cmd: CommandLine, values: dict[str, Any], saved: SavedRun | None) -> dict[str, Any]:
    """--scale-lr: the saved learning rate times new/old effective batch (linear) or its square root (sqrt)."""
    if not cmd.scale_lr:
        return values
    old_batch = saved.settings.get("effective_batch") if saved else None
    if not old_batch or old_batch == values["effective_batch"]:
        raise UserError("--scale-lr follows a change of the effective batch: pass it with a new --effective-batch "
                        "(and --allow-config-change) when resuming")
    if "learning_rate" in cmd.given:
        raise UserError("--scale-lr computes the learning rate: pass it without --learning-rate")
    ratio = values["effective_batch"] / old_batch
    factor = ratio if cmd.scale_lr == "linear" else math.sqrt(ratio)
    lr = saved.settings["learning_rate"] * factor
    log.info("--scale-lr %s: learning rate %.4g -> %.4g (effective batch %d -> %d, x%.4g)", cmd.scale_lr,
             saved.settings["learning_rate"], lr, old_batch, values["effective_batch"], factor)
    return {**values, "learning_rate": lr}


def check_horizon(cfg: TrainConfig, num_samples: int, warn: bool = True, warmup_given: bool = True) -> None:
    """The derived learning-rate horizon is saved with the run: keep it inside the range a resume accepts.
    warn: say (on a fresh start; a resume keeps the saved schedule) when the warmup never ends."""
    if cfg.lr_decay_steps > MAX_COUNT:
        raise UserError(f"--epochs {cfg.epochs} over {num_samples} samples is {cfg.lr_decay_steps} optimizer steps, "
                        f"more than {MAX_COUNT}; lower --epochs or pass --max-steps (nothing was written)")
    if not warn or cfg.warmup_steps < cfg.lr_decay_steps:
        return
    if cfg.demo and not warmup_given:  # a short try of the demo: nothing the user chose, nothing to warn about
        log.info("learning rate: the demo's %d warmup steps outlast the %d-step horizon: it stays below %g",
                 cfg.warmup_steps, cfg.lr_decay_steps, cfg.learning_rate)
        return
    steps = "step" if cfg.lr_decay_steps == 1 else "steps"
    log.warning("--warmup-steps %d%s is not shorter than the learning-rate horizon of %d %s:", cfg.warmup_steps,
                "" if warmup_given else " (the default)", cfg.lr_decay_steps, steps)
    log.warning("the learning rate never reaches --learning-rate %g; pass a smaller --warmup-steps", cfg.learning_rate)


def merge_settings(cmd: CommandLine, saved: SavedRun | None, run_dir: Path, machine: str,
                   world_size: int = 1) -> TrainConfig:
    values: dict[str, Any] = {}
    demo = cmd.given.get("demo", bool(saved and saved.settings.get("demo")))
    if demo:
        root = run_dir / DEMO_DATA_DIR
        values.update(DEMO_DEFAULTS, train_manifests=[str(root / TRAIN_MANIFEST_NAME)],
                      val_manifests=[str(root / VAL_MANIFEST_NAME)], tokenizer=str(root / TOKENIZER_NAME),
                      base_checkpoint=str(root / BASE_NAME))
    values["config"] = str(REPO_ROOT / (DEMO_DEFAULTS["config"] if demo else TrainConfig.config))
    if saved:
        values.update({k: v for k, v in saved.settings.items() if k not in HARDWARE_KEYS})
        values.update(_saved_hardware_settings(saved, machine, cmd.given))
    values.update(_given_batch_split(cmd.given, world_size))
    values = _scaled_learning_rate(cmd, values, saved)
    values["output_dir"] = str(run_dir)
    values = _lora_values(cmd.given, values, bool(saved and saved.checkpoint))
    cfg = TrainConfig.from_dict({k: v for k, v in values.items() if k in FIELD_NAMES})
    check_values(cfg)
    return cfg


def _lora_values(given: dict[str, Any], values: dict[str, Any], from_checkpoint: bool = False) -> dict[str, Any]:
    """--lora-alpha defaults to 2 x --lora-rank; the other LoRA flags mean nothing without a rank.
    A run continued from a checkpoint adapts that checkpoint's model (a LoRA branch: trainers/run/lora_branch.py)."""
    rank = values.get("lora_rank", 0)
    stray = [s.flag for s in declared(TrainConfig) if s.name in LORA_KEYS[1:] and s.name in given]
    if isinstance(rank, int) and rank > 0 and not values.get("base_checkpoint") and not from_checkpoint:
        raise UserError(f"--lora-rank {rank} adapts a trained model: pass --base-checkpoint gpt.pth (adapters on random "
                        "weights learn nothing a full fine-tuning would not); nothing was written")
    if rank == 0 and stray:
        raise UserError(f"{', '.join(stray)} configure LoRA adapters: pass --lora-rank R (R > 0) "
                        "with them, or leave them out for full fine-tuning (nothing was written)")
    if isinstance(rank, int) and rank > 0 and values.get("lora_alpha") is None:
        return {**values, "lora_alpha": 2.0 * rank}
    return values


def _saved_hardware_settings(saved: SavedRun, machine: str, given: dict[str, Any]) -> dict[str, Any]:
    """How the saved run split its steps, loaded its data and chose its device: reused only on the
    same kind of machine, and never over a flag typed now."""
    split = {"batch_size", "grad_accumulation"}  # a new split replaces the whole saved one
    typed = given.keys() | (split if split & given.keys() else set())
    chosen = {k: v for k, v in saved.settings.items()
              if k in HARDWARE_KEYS and v != getattr(TrainConfig, k) and k not in typed}
    if not chosen:
        return {}
    flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(chosen.items()))
    if saved.machine == machine:
        log.info("reusing %s saved with this run", flags)
        log.info("(same machine: %s)", machine)
        log.info("to change it, pass the flag again (0 or auto: the automatic choice)")
        return chosen
    log.info("not reusing %s: the run saved it on another machine", flags)
    log.info("(%s; this is %s)", saved.machine or "an unknown machine", machine)
    log.info("choosing automatically; pass the flags to set them")
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
    """Every setting inside its declared range or choices (trainers/config/settings.py) and the rules between
    settings, all problems at once."""
    problems = value_problems(TrainConfig, cfg.to_dict()) + share_problems(cfg.train_manifests)
    problems += validation_share_problems(cfg.val_manifests)
    if cfg.text_loss_weight == 0 and cfg.mel_loss_weight == 0:
        problems.append("--text-loss-weight and --mel-loss-weight are both 0, so no loss is trained; give at least "
                        "one a weight > 0 (the defaults are 0.2 and 0.8)")
    unknown = [t for t in cfg.lora_targets if t not in LORA_TARGET_PATHS]
    if unknown or not cfg.lora_targets:
        problems.append(f"--lora-targets must name projections from {', '.join(LORA_TARGET_PATHS)}, got "
                        f"{','.join(cfg.lora_targets)!r}")
    problems += metric_source_problems("--best-metric", cfg.best_metric, cfg)
    # The forgetting guard's settings on their own (whether its languages are validated: with the data).
    if cfg.forgetting_limit:
        problems += metric_source_problems("--forgetting-metric", str(cfg.forgetting_metric), cfg)
    if cfg.forgetting_stop and not cfg.forgetting_limit:
        problems.append("--forgetting-stop ends the run at a validation past --forgetting-limit, which is 0 "
                        "(off): pass --forgetting-limit X (e.g. 0.1 for a 10% rise), or --no-forgetting-stop")
    if any(not lang for lang in cfg.base_languages):
        problems.append("--base-language: an empty language; name a language of the validation "
                        "(--val-manifest V::LANG)")
    if not cfg.sample_temperature and (cfg.sample_top_k or cfg.sample_top_p != 1.0):
        problems.append(f"--sample-top-k {cfg.sample_top_k} / --sample-top-p {cfg.sample_top_p} filter sampled codes, "
                        "and generation is greedy: pass --sample-temperature T (> 0, e.g. 0.8) too, or --sample-top-k 0 "
                        "--sample-top-p 1")
    if problems:
        raise UserError("\n".join([*problems, "nothing was written; fix these flags (a value saved with the run is "
                                               "replaced by passing its flag)"]))
    if not cfg.demo:
        if not cfg.train_manifests:
            raise UserError("no training data: pass --train-manifest FILE (or --demo for the built-in corpus)")
        if not cfg.tokenizer:
            raise UserError("no tokenizer: pass --tokenizer bpe.model (the SentencePiece model your text ids came from)")


def metric_source_problems(flag: str, metric: str, cfg: TrainConfig) -> list[str]:
    """A metric of a validation listener that is off (METRIC_SOURCES) is never measured."""
    return [f"{flag} {metric} is {needs}" for prefix, (key, needs) in METRIC_SOURCES.items()
            if metric.startswith(prefix) and not getattr(cfg, key)]


def _weights_only_start(cmd: CommandLine, cfg: TrainConfig, saved: SavedRun, text_tokens: int,
                        family: ModelFamily) -> TrainConfig:
    """A checkpoint of another vocabulary size starts a new run from its weights, at step 0.

    Its optimizer moments, schedule and data position belong to a different set of trained
    rows and a different run, so they are dropped rather than half-reused.
    """
    assert saved.checkpoint is not None and saved.path is not None
    old = saved.checkpoint.text_tokens
    run_dir = Path(cfg.output_dir)
    # First whether the tokenizer may start from these weights at all: a new --output-dir would not help if not.
    family.tokenizer.check_extends(saved.settings.get("tokenizer"), cfg.tokenizer, saved.path)
    found = newest_checkpoint(run_dir)
    if found is not None:
        raise UserError(
            f"the tokenizer has {text_tokens} pieces but {saved.path} was trained with {old} text tokens, so training "
            f"starts over at step 0 from its weights; {run_dir} already holds a run ({found.name}) that this would "
            "overwrite. Pass a new --output-dir (nothing was changed)")
    log.warning("the tokenizer has %d pieces but %s was trained with %d text tokens:", text_tokens, saved.path, old)
    log.warning("starting a NEW run at step 0 from its model weights only (fresh optimizer, learning-rate")
    log.warning("schedule and loss scaler; data order from the start). If you meant to continue that run,")
    log.warning("pass the tokenizer it was trained with")
    rederived = {k: getattr(TrainConfig, k) for k in ("lr_decay_steps", "freeze_base_vocab") if k not in cmd.given}
    return replace(cfg, base_checkpoint=str(saved.path), **rederived)
