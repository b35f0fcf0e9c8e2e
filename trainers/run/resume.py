"""Continuing a saved run: refusing changes that would alter the result, then restoring the components."""
from __future__ import annotations

import logging
from pathlib import Path

from trainers.checkpoint import schema
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.config.flags import CommandLine
from trainers.config.settings import TrainConfig, compare, saved_settings
from trainers.data.manifest_cache import cache_path
from trainers.data.manifest_changes import consequence, describe_changes, saved_samples
from trainers.data.sample_table import SampleTable
from trainers.errors import UserError
from trainers.hardware.detect import library_versions
from trainers.log_lines import log_fitting
from trainers.run.run_dir import RunConfig

log = logging.getLogger("train")


def refuse_breaking_changes(cfg: RunConfig, ckpt: schema.Checkpoint, path: Path, cmd: CommandLine,
                            train_samples: SampleTable | None = None) -> list[str]:
    """Log every difference from the saved run; stop on those that would change the result.

    Runs before the model is built, so a wrong flag costs seconds and touches nothing. Returns
    the differences, described, for the run's history. `train_samples`: today's, to say how the
    training manifests changed when their fingerprint did.
    """
    saved = TrainConfig.from_dict(saved_settings(ckpt.settings))
    changes = compare(saved, cfg.settings, ckpt.fingerprints, cfg.fingerprints)
    for change in changes:
        name, before, now, tag = change.parts()
        log_fitting(log, f"setting differs from the saved run: {change.describe()}",
                    f"setting differs from the saved run: {name} ({tag})", f"  saved {before}", f"  now {now}")
    breaking = [c for c in changes if c.breaks_exactness]
    # Another --lora-rank changes what the checkpoint must hold: no flag makes its model section fit this model.
    rank_change = any(c.key == "lora_rank" for c in breaking)
    data = _data_change(cfg, ckpt, train_samples) if any(c.key == "data" for c in breaking) else []
    if not breaking or (cmd.allow_config_change and not rank_change):
        for line in data:
            log.warning("%s", line.strip())
        return [c.describe() for c in changes]
    lines = [f"resuming {path} with these changes would not reproduce the uninterrupted run:",
             *[f"  {c.describe()}" for c in breaking], *(f"  {line}" for line in data)]
    if any(c.key == "tokenizer" for c in breaking):
        lines.append(
            f"  the tokenizer file differs from the one this run was trained with: the manifests' text ids and the "
            f"rows of text_embedding mean the pieces of that tokenizer, so training on with another one would "
            f"teach the model wrong text. Pass --tokenizer with the original file (the run used {saved.tokenizer})")
    if any(c.key == schema.BASE_FINGERPRINT and c.saved and c.now for c in breaking):  # not a LoRA start or end
        lines.append(
            f"  --base-checkpoint {cfg.settings.base_checkpoint} is not the file this LoRA run was trained on (its "
            f"sha256 differs): the checkpoint holds only adapters, which belong to that base. Pass the original base "
            f"(the run used {saved.base_checkpoint})")
    if rank_change and saved.lora_rank:
        lines.append(
            f"  --lora-rank decides what trains and what the checkpoint holds: this LoRA run continues with its own "
            f"rank {saved.lora_rank} (adapters of another rank do not fit, and its checkpoint holds the adapters alone, "
            "not a whole model to fine-tune); for another rank or a full fine-tuning, merge it (tools/export_checkpoint.py "
            "or tools/merge_lora.py) and start a new run (a new --output-dir) with --base-checkpoint on the merged file")
    elif rank_change:
        lines.append(
            "  --lora-rank decides what trains and what the checkpoint holds: a full fine-tuning checkpoint does not "
            "continue as LoRA in its own directory; to adapt this checkpoint's model branch it into a new directory: "
            f"--resume {path} --output-dir NEW_DIR --lora-rank R")
    if any(c.key == "data_shares" for c in breaking):
        lines.append(
            "  the replay shares (--train-manifest F::LANG@SHARE) decide which samples make each step: changing them "
            "changes the training data like another manifest would. Give the original shares again (or leave "
            "--train-manifest out to keep them), or pass --allow-config-change: the rest of the current epoch is "
            "then cut into steps of the new target count, no target sample repeated or skipped")
    if any(c.key == "effective_batch" for c in breaking):
        lines.append(
            f"  the effective batch is a hyperparameter of the run ({saved.effective_batch} samples per step); "
            "change only --batch-size or --grad-accumulation to fit other hardware, the other one is derived")
    lines.append(f"pass --lora-rank {saved.lora_rank} (the run's own; --allow-config-change cannot make a checkpoint "
                 "hold other tensors)" if rank_change else
                 "restore the original flags/files, or pass --allow-config-change to continue anyway")
    raise UserError("\n".join(lines))


def _data_change(cfg: RunConfig, ckpt: schema.Checkpoint, now: SampleTable | None) -> list[str]:
    """How the training samples changed (when the run's manifest cache still holds the saved ones), and what
    continuing means for exactness."""
    before = saved_samples(cache_path(cfg.run_dir, "--train-manifest"), ckpt.fingerprints.get("data", ""))
    described = describe_changes(before, now) if before is not None and now is not None else [
        "the training manifests' bytes changed since the checkpoint (their samples then are not at hand to compare)"]
    return [*described, *consequence(ckpt.step, ckpt.epoch)]


def restore(checkpoints: Checkpointer, ckpt: schema.Checkpoint, path: Path, force_resume: bool) -> None:
    """Continue the saved run: every refusal first (nothing is loaded from a checkpoint this refuses),
    then one call loads each section into its owner (Checkpointer.restore)."""
    components = checkpoints.components
    refusal = components["model"].fit_problems(ckpt.section("model"), path)
    if refusal is not None:
        raise refusal
    problems = components["optim"].resume_problems(ckpt.section("optim"))
    if problems and not force_resume:
        raise UserError("\n".join([f"{path} fails the resume checks:", *[f"  {p}" for p in problems],
                                   "pass --force-resume to continue anyway (the result will differ)"]))
    for p in problems:
        log.warning("continuing despite a failed resume check (--force-resume):")
        log.warning("  %s", p)
    checkpoints.restore(ckpt)
    if ckpt.versions != library_versions():
        log.warning("library versions differ from the saved run (%s now %s): results stay correct but may not be "
                    "bit-identical to an uninterrupted run", ckpt.versions, library_versions())
