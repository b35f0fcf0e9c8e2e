"""Command-line flags.

Only flags the user actually typed count as given (argparse.SUPPRESS keeps the others out),
so `--resume auto --output-dir DIR` alone continues a run with its saved settings. This module
imports no torch: `--help` and usage errors answer at once.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Sequence

from trainers.config.settings import TrainConfig


@dataclass(frozen=True)
class CommandLine:
    given: dict[str, Any]  # flags typed by the user, under TrainConfig field names
    resume: str | None
    allow_config_change: bool = False
    force_resume: bool = False
    reconfigure_scheduler: bool = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_gpt_v2.py",
        description="Fine-tune the IndexTTS2 GPT with exact, interruption-proof resume.",
        argument_default=argparse.SUPPRESS,
    )
    d = TrainConfig()
    _data_flags(p.add_argument_group("data"), d)
    _optimisation_flags(p.add_argument_group("optimisation"), d)
    _run_time_flags(p.add_argument_group("run time"), d)
    rs = p.add_argument_group("resume")
    rs.add_argument("--resume", metavar="auto|PATH",
                    help="auto: continue OUTPUT_DIR's newest checkpoint if there is one, else start fresh; "
                         "PATH: continue that checkpoint")
    rs.add_argument("--allow-config-change", action="store_true",
                    help="resume although settings that change the result differ from the saved run")
    rs.add_argument("--force-resume", action="store_true",
                    help="resume although the checkpoint fails a consistency check")
    rs.add_argument("--reconfigure-scheduler", action="store_true",
                    help="when resuming to a later end: a new cosine from the current learning rate to the new end "
                         "(no jump), down to the same floor; without it the saved schedule stands")
    p.add_argument("--demo", action="store_true", help="train the tiny demo config on a built-in synthetic corpus")
    return p


def _data_flags(data: argparse._ArgumentGroup, d: TrainConfig) -> None:
    data.add_argument("--train-manifest", dest="train_manifests", action="append", metavar="JSONL[::LANG]",
                      help="training manifest; repeat for several; optional ::lang suffix")
    data.add_argument("--val-manifest", dest="val_manifests", action="append", metavar="JSONL[::LANG]",
                      help="validation manifest; repeat for several")
    data.add_argument("--tokenizer", help="SentencePiece model the text ids were made with")
    data.add_argument("--config", help=f"IndexTTS2 config.yaml (gpt section) [{d.config}]")
    data.add_argument("--base-checkpoint", help="official gpt.pth (or a raw state dict) to start from")
    data.add_argument("--output-dir", help=f"run directory [{d.output_dir}]")


def _optimisation_flags(opt: argparse._ArgumentGroup, d: TrainConfig) -> None:
    _num(opt, "--effective-batch", int, d.effective_batch,
         "samples per optimizer step; defines the run and is kept on resume")
    _num(opt, "--batch-size", int, d.batch_size, "micro-batch size (samples per forward pass; 0: auto)")
    _num(opt, "--grad-accumulation", int, d.grad_accumulation,
         "micro-batches per optimizer step (0: auto; without --effective-batch, batch size x this sets it)")
    _num(opt, "--epochs", int, d.epochs, "epochs to train")
    _num(opt, "--max-steps", int, d.max_steps, "stop after this many optimizer steps (0: no limit)")
    _num(opt, "--learning-rate", float, d.learning_rate, "peak learning rate")
    _num(opt, "--warmup-steps", int, d.warmup_steps, "linear warmup steps")
    _num(opt, "--lr-decay-steps", int, d.lr_decay_steps, "cosine horizon (0: the planned length of the first run)")
    _num(opt, "--min-lr-ratio", float, d.min_lr_ratio, "final learning rate as a fraction of the peak")
    _num(opt, "--weight-decay", float, d.weight_decay, "AdamW weight decay on matrices")
    _num(opt, "--grad-clip", float, d.grad_clip, "max global gradient norm (0: off)")
    _num(opt, "--text-loss-weight", float, d.text_loss_weight, "weight of the text cross-entropy")
    _num(opt, "--mel-loss-weight", float, d.mel_loss_weight, "weight of the mel cross-entropy")
    _num(opt, "--dropout", float, d.dropout, "embedding and residual dropout")
    _num(opt, "--seed", int, d.seed, "seed of the data order and dropout masks")
    opt.add_argument("--data-order", choices=("grouped", "random"),
                     help=f"grouped: each step holds samples of similar length (little padding); random: plain "
                          f"shuffled steps [{d.data_order}]")
    opt.add_argument("--freeze-base-vocab", action=argparse.BooleanOptionalAction,
                     help="keep the base checkpoint's text embedding/head rows bit-identical "
                          "[on when the tokenizer extends the base vocabulary]")


def _run_time_flags(rt: argparse._ArgumentGroup, d: TrainConfig) -> None:
    rt.add_argument("--amp", action="store_true", help="mixed precision on CUDA (bf16 if supported, else fp16)")
    rt.add_argument("--tf32", action=argparse.BooleanOptionalAction,
                    help="TF32 tensor cores for fp32 matrix products on Ampere and newer GPUs [on]")
    rt.add_argument("--grad-checkpointing", action="store_true", help="recompute activations to save memory")
    rt.add_argument("--deterministic", action="store_true",
                    help="deterministic CUDA kernels, for bit-identical resume on GPU (slower; CPU runs are "
                         "deterministic anyway)")
    _num(rt, "--num-workers", int, d.num_workers, "data loading worker processes (0: auto)")
    rt.add_argument("--device", help=f"auto, cpu, cuda or cuda:N [{d.device}]")
    _num(rt, "--val-interval", int, d.val_interval, "validate every N optimizer steps (0: only at start and end)")
    _num(rt, "--max-val-batches", int, d.max_val_batches,
         "validate on at most this many x (--val-batch-size or the effective batch) samples (0: all)")
    _num(rt, "--val-batch-size", int, d.val_batch_size, "samples per validation forward pass (0: the micro-batch)")
    _num(rt, "--save-interval", int, d.save_interval, "save a checkpoint every N optimizer steps")
    _num(rt, "--keep-checkpoints", int, d.keep_checkpoints, "model_step files to keep (0: only latest.pth)")
    _num(rt, "--log-interval", int, d.log_interval, "log a line every N optimizer steps")
    rt.add_argument("--log-sample-ids", action="store_true",
                    help="append the sample ids of every optimizer step to OUTPUT_DIR/sample_ids.tsv")


def _num(group: argparse._ArgumentGroup, flag: str, kind: type, default: Any, text: str) -> None:
    group.add_argument(flag, type=kind, help=f"{text} [{default}]")


def parse_command_line(argv: Sequence[str] | None = None) -> CommandLine:
    """The typed flags, with paths made absolute (a run must not depend on the directory it was started in)."""
    ns = vars(build_parser().parse_args(argv))
    resume = ns.pop("resume", None)
    allow = ns.pop("allow_config_change", False)
    force = ns.pop("force_resume", False)
    reconfigure = ns.pop("reconfigure_scheduler", False)
    for key in ("train_manifests", "val_manifests"):
        if key in ns:
            ns[key] = tuple(_absolute_spec(s) for s in ns[key])
    for key in ("tokenizer", "config", "base_checkpoint", "output_dir"):
        if key in ns and ns[key] is not None:
            ns[key] = os.path.abspath(ns[key])
    return CommandLine(given=ns, resume=resume, allow_config_change=allow, force_resume=force,
                       reconfigure_scheduler=reconfigure)


def _absolute_spec(spec: str) -> str:
    path, sep, lang = spec.partition("::")
    return os.path.abspath(path) + (sep + lang if sep else "")
