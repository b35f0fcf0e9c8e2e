"""Command-line flags.

Only flags the user actually typed count as given (argparse.SUPPRESS keeps the others out),
so `--resume auto --output-dir DIR` alone continues a run with its saved settings. This module
imports no torch: `--help` and usage errors answer at once.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

from trainers.config.bounds import LEARNING_RATE, count, finite, whole_number
from trainers.config.declare import SettingsParser, given_values, setting
from trainers.config.settings import TrainConfig


def parse_data_root(text: str) -> tuple[str, str]:
    """'OLD=NEW' -> (absolute OLD, absolute NEW); raises ValueError with what is wrong."""
    old, sep, new = text.partition("=")
    if not sep or not old.strip() or not new.strip():
        raise ValueError(f"expected OLD=NEW (a folder the run's saved paths start with, and where it is now), "
                         f"got {text!r}")
    return os.path.abspath(old), os.path.abspath(new)


def _data_root(text: str) -> tuple[str, str]:
    try:
        return parse_data_root(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class CommandLine:
    """The typed flags: the run's settings given (under TrainConfig field names), and the flags of this launch,
    never saved, declared here. Field order is --help's."""

    given: dict[str, Any]
    resume: str | None = setting(
        None, "auto: continue OUTPUT_DIR's newest intact checkpoint if there is one, else start fresh; best: continue "
        "OUTPUT_DIR/best.pth (if nothing newer was trained after it); PATH: continue that checkpoint (from another "
        "directory: a branch of that run, started in OUTPUT_DIR)", section="resume", metavar="auto|best|PATH")
    allow_config_change: bool = setting(False, "resume although settings that change the result differ from the "
                                        "saved run")
    force_resume: bool = setting(False, "resume although the checkpoint fails a consistency check")
    additional_epochs: int = setting(
        0, "continue the run for N more epochs of data from where it stands (N x steps per epoch optimizer steps), "
        "whatever --epochs / --max-steps it was started with", parse=whole_number, metavar="N", shown=None)
    scale_lr: str | None = setting(
        None, "with a changed --effective-batch (and --allow-config-change): scale the saved learning rate by new/old "
        "batch (linear) or its square root (sqrt)", choices=("linear", "sqrt"))
    # --rewarm, --rewarm-lr or --rewarm-steps: a re-warm continuation (trainers/run/schedule.py)
    rewarm: bool = setting(
        False, "when resuming to a later end: the learning rate rises again from its current value to a peak, then a "
        "cosine takes it down to the same floor at the new end (the usual way to train a finished run further); "
        "without it the saved schedule stands")
    rewarm_lr: float | None = setting(None, "peak of the re-warm (implies --rewarm)", bound=LEARNING_RATE,
                                      metavar="LR", shown="the run's --learning-rate")
    rewarm_steps: int | None = setting(
        None, "steps of the re-warm's linear rise (implies --rewarm)", bound=count(), metavar="N",
        shown="the run's --warmup-steps, at most a quarter of the extension")
    reconfigure_scheduler: bool = setting(
        False, "when resuming to a later end: no warmup, a cosine from the current learning rate down to the same "
        "floor at the new end (after a finished cosine the current rate is about the floor, so the extension trains "
        "little: see --rewarm)")
    # Absolute (trainers/run/portable.py)
    data_roots: tuple[tuple[str, str], ...] = setting(
        (), "resuming a run whose inputs moved: saved input paths that start with the folder OLD are looked for under "
        "NEW instead (checked against the run's fingerprints); repeatable", section="data", flag="--data-root",
        repeat="each", parse=_data_root, metavar="OLD=NEW")
    # Under torchrun, the wait for the other processes; more than a week is a typo.
    dist_timeout: float | None = setting(
        None, "under torchrun: how long a process waits for the others in a collective before it stops with exit 6 "
        "(this launch only; the variable INDEXTTS_DDP_TIMEOUT_S sets it when the flag is not given)",
        after="background_saves", bound=finite(0.0, 7 * 86400.0, low_open=True), metavar="SECONDS", shown="1800")
    # Off: no check of text ids at a fresh start (trainers/data/tokenizer_fit.py)
    tokenizer_check: bool = setting(
        True, "skip the fresh start's check that --tokenizer turns the first manifest lines' text into their stored "
        "ids (for a preprocessing with its own text front end)", after="tokenizer", flag="--no-tokenizer-check")


def build_parser() -> SettingsParser:
    return SettingsParser("train_gpt_v2.py", "Fine-tune the IndexTTS2 GPT with exact, interruption-proof resume.",
                          TrainConfig, CommandLine)


def parse_command_line(argv: Sequence[str] | None = None) -> CommandLine:
    """The typed flags, with paths made absolute (a run must not depend on the directory it was started in)."""
    parser = build_parser()
    typed = vars(parser.parse_args(argv))
    cmd = CommandLine(given_values(TrainConfig, typed), **given_values(CommandLine, typed))
    rewarm = cmd.rewarm or cmd.rewarm_lr is not None or cmd.rewarm_steps is not None
    if rewarm and cmd.reconfigure_scheduler:
        parser.error("--rewarm (or --rewarm-lr / --rewarm-steps) and --reconfigure-scheduler are two different "
                     "continuations of the learning rate: pass one of them")
    return replace(cmd, rewarm=rewarm)
