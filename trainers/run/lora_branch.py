"""A LoRA branch of a full fine-tuning run: `--resume FULL.pth --output-dir NEW --lora-rank R`.

The branch's base is the full checkpoint's model, written once into the new run directory as
`lora_base.pth` (the upstream gpt.pth layout) and named by that path and its sha256 like any
--base-checkpoint. Not the checkpoint file itself: the full run rotates its step files away and
overwrites latest.pth and best.pth as it goes on, so a base named there would vanish or change and
the adapters could never be resumed or merged. Inside the run directory the base moves with it
(a moved run directory is found again) and the user's checkpoint is only read, never written.
"""
from __future__ import annotations

import io
import logging
from dataclasses import replace
from pathlib import Path

import torch

from trainers.config.flags import CommandLine
from trainers.config.settings import TrainConfig
from trainers.files import write_bytes_atomically
from trainers.model.vocabulary import TokenizerAdapter
from trainers.run.run_dir import SavedRun, newest_checkpoint

log = logging.getLogger("train")

BRANCH_BASE_NAME = "lora_base.pth"


def is_lora_branch(settings: TrainConfig, saved: SavedRun | None, run_dir: Path) -> bool:
    """A full checkpoint of another directory, continued with --lora-rank in a directory holding no checkpoint.

    In the full run's own directory (or one holding a run) this is not a branch: the rank change is
    refused there (trainers/run/resume.py), so a directory never mixes full and LoRA checkpoints."""
    if not (settings.lora_rank and saved and saved.checkpoint and saved.path) or saved.checkpoint.lora is not None:
        return False
    return saved.path.resolve().parent != run_dir.resolve() and newest_checkpoint(run_dir) is None


def start_lora_branch(cmd: CommandLine, settings: TrainConfig, saved: SavedRun, run_dir: Path,
                      text_tokens: int, tokenizer: TokenizerAdapter) -> tuple[TrainConfig, str]:
    """Write the full checkpoint's model as the branch's base; the LoRA run starts at step 0 from it.

    Returns the branch's settings (its base: the written file) and the line its history records.
    The full run's optimizer moments, schedule and data position belong to other trained tensors,
    so they are not reused: the branch has a fresh optimizer and schedule and reads its data from
    the start."""
    ckpt, source = saved.checkpoint, saved.path
    assert ckpt is not None and source is not None
    if text_tokens != ckpt.text_tokens:  # a longer tokenizer: new rows train beside the adapters
        tokenizer.check_extends(saved.settings.get("tokenizer"), settings.tokenizer, source)
    base = run_dir / BRANCH_BASE_NAME
    buffer = io.BytesIO()
    torch.save({"model": ckpt.section("model")}, buffer)  # the model section is already the upstream layout
    data = buffer.getvalue()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (base.is_file() and base.read_bytes() == data):  # under torchrun rank 0 wrote it; the others read it
        write_bytes_atomically(base, data)
    origin = f"run {saved.run_id or '(no identity)'} at step {ckpt.step} ({source})"
    log.info("starting a LoRA branch of %s in %s", origin, run_dir)
    log.info("its model, written to %s, is the base of the adapters; that run is left as it is", base)
    log.info("the LoRA branch starts at step 0 with a fresh optimizer and learning-rate schedule, and reads")
    log.info("the data from its start: the full run's optimizer state belongs to the tensors it trained")
    rederived = {k: getattr(TrainConfig, k) for k in ("lr_decay_steps", "freeze_base_vocab") if k not in cmd.given}
    return replace(settings, base_checkpoint=str(base), **rederived), f"LoRA branch from {origin}"
