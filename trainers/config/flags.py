"""Command-line flags.

Only flags the user actually typed count as given (argparse.SUPPRESS keeps the others out),
so `--resume auto --output-dir DIR` alone continues a run with its saved settings. This module
imports no torch: `--help` and usage errors answer at once.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn, Sequence

from trainers.config.bounds import (
    BOUNDS, PLAN_BOUNDS, bounded_number, flag_of, parses_as_number, real_number, whole_number,
)
from trainers.config.manifest_flags import absolute_manifest
from trainers.config.settings import AMP_MODES, BEST_METRICS, LORA_TARGET_PATHS, TrainConfig


@dataclass(frozen=True)
class CommandLine:
    given: dict[str, Any]  # flags typed by the user, under TrainConfig field names
    resume: str | None
    allow_config_change: bool = False
    force_resume: bool = False
    reconfigure_scheduler: bool = False
    rewarm: bool = False  # --rewarm, --rewarm-lr or --rewarm-steps: a re-warm continuation (trainers/run/schedule.py)
    rewarm_lr: float | None = None
    rewarm_steps: int | None = None
    data_roots: tuple[tuple[str, str], ...] = ()  # --data-root OLD=NEW, absolute (trainers/run/portable.py)
    additional_epochs: int = 0  # --additional-epochs N: N more epochs of data from where the run stands
    scale_lr: str | None = None  # --scale-lr linear|sqrt: the learning rate follows an effective-batch change
    dist_timeout: float | None = None  # --dist-timeout SECONDS: under torchrun, the wait for the other processes
    tokenizer_check: bool = True  # --no-tokenizer-check turns off the start's check of text ids (trainers/data/tokenizer_fit.py)


class _Parser(argparse.ArgumentParser):
    """Usage errors in two lines (what is wrong, where --help is) instead of 44 lines of usage, with the flag
    an unknown one most likely meant (`--learning_rate` -> `--learning-rate`)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self.suggestions(extras)}")
        return ns

    def suggestions(self, extras: Sequence[str]) -> str:
        known = sorted(o for o in self._option_string_actions if o.startswith("--"))
        meant = []
        for word in extras:
            name = word.split("=", 1)[0]
            if name.startswith("--"):
                close = _closest_flag(name, known)
                meant += [(name, close)] if close else []
        if len(meant) == 1:
            return f"; did you mean {meant[0][1]}?"
        return f"; did you mean {', '.join(f'{c} for {n}' for n, c in meant)}?" if meant else ""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"usage: {self.prog} [FLAGS] (--help lists them all)\n{self.prog}: error: {message}\n")


def _closest_flag(name: str, known: Sequence[str]) -> str | None:
    """The flag a mistyped one most likely meant: underscores for dashes, a flag it begins (abbreviations are
    not accepted: allow_abbrev=False), else the most similar name."""
    dashed = name.replace("_", "-")
    if dashed in known:
        return dashed
    begun = [k for k in known if k.startswith(dashed)]
    if begun:
        return min(begun, key=len)
    close = difflib.get_close_matches(dashed, known, n=1, cutoff=0.8)
    return close[0] if close else None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="train_gpt_v2.py",
        description="Fine-tune the IndexTTS2 GPT with exact, interruption-proof resume.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # `--lr 1000` must not quietly set --lr-decay-steps: only whole flag names count
    )
    d = TrainConfig()
    _data_flags(p.add_argument_group("data"), d)
    _optimisation_flags(p.add_argument_group("optimisation"), d)
    _run_time_flags(p.add_argument_group("run time"), d)
    rs = p.add_argument_group("resume")
    rs.add_argument("--resume", metavar="auto|best|PATH",
                    help="auto: continue OUTPUT_DIR's newest intact checkpoint if there is one, else start fresh; "
                         "best: continue OUTPUT_DIR/best.pth (if nothing newer was trained after it); PATH: continue "
                         "that checkpoint (from another directory: a branch of that run, started in OUTPUT_DIR)")
    rs.add_argument("--allow-config-change", action="store_true",
                    help="resume although settings that change the result differ from the saved run")
    rs.add_argument("--force-resume", action="store_true",
                    help="resume although the checkpoint fails a consistency check")
    rs.add_argument("--additional-epochs", type=whole_number, metavar="N",
                    help="continue the run for N more epochs of data from where it stands (N x steps per epoch "
                         "optimizer steps), whatever --epochs / --max-steps it was started with")
    rs.add_argument("--scale-lr", choices=("linear", "sqrt"),
                    help="with a changed --effective-batch (and --allow-config-change): scale the saved learning "
                         "rate by new/old batch (linear) or its square root (sqrt)")
    rs.add_argument("--rewarm", action="store_true",
                    help="when resuming to a later end: the learning rate rises again from its current value to a "
                         "peak, then a cosine takes it down to the same floor at the new end (the usual way to train "
                         "a finished run further); without it the saved schedule stands")
    _plan_num(rs, "--rewarm-lr", "LR", "peak of the re-warm (implies --rewarm)", "the run's --learning-rate")
    _plan_num(rs, "--rewarm-steps", "N", "steps of the re-warm's linear rise (implies --rewarm)",
              "the run's --warmup-steps, at most a quarter of the extension")
    rs.add_argument("--reconfigure-scheduler", action="store_true",
                    help="when resuming to a later end: no warmup, a cosine from the current learning rate down to "
                         "the same floor at the new end (after a finished cosine the current rate is about the "
                         "floor, so the extension trains little: see --rewarm)")
    p.add_argument("--demo", action="store_true", help="train the tiny demo config on a built-in synthetic corpus")
    return p


def _data_flags(data: argparse._ArgumentGroup, d: TrainConfig) -> None:
    data.add_argument("--train-manifest", dest="train_manifests", action="append", metavar="JSONL[::LANG[@SHARE]]",
                      help="training manifest; repeat for several; optional ::lang suffix; ::LANG@SHARE replays it: "
                           "that fraction of every step's samples is drawn from it (the manifests without a share "
                           "fill the rest and set the epoch)")
    data.add_argument("--val-manifest", dest="val_manifests", action="append", metavar="JSONL[::LANG]",
                      help="validation manifest; repeat for several")
    data.add_argument("--tokenizer", help="SentencePiece model the text ids were made with")
    data.add_argument("--no-tokenizer-check", dest="no_tokenizer_check", action="store_true",
                      help="skip the fresh start's check that --tokenizer turns the first manifest lines' text into "
                           "their stored ids (for a preprocessing with its own text front end)")
    data.add_argument("--config", help=f"IndexTTS2 config.yaml (gpt section) [{d.config}]")
    data.add_argument("--base-checkpoint", help="official gpt.pth (or a raw state dict) to start from")
    data.add_argument("--output-dir", help=f"run directory [{d.output_dir}]")
    data.add_argument("--data-root", dest="data_roots", action="append", type=_data_root, metavar="OLD=NEW",
                      help="resuming a run whose inputs moved: saved input paths that start with the folder OLD are "
                           "looked for under NEW instead (checked against the run's fingerprints); repeatable")


def _optimisation_flags(opt: argparse._ArgumentGroup, d: TrainConfig) -> None:
    _num(opt, "--effective-batch", d.effective_batch,
         "samples per optimizer step; defines the run and is kept on resume")
    _num(opt, "--batch-size", d.batch_size, "micro-batch size (samples per forward pass; 0: auto)")
    _num(opt, "--grad-accumulation", d.grad_accumulation,
         "micro-batches per optimizer step (0: auto; without --effective-batch, batch size x this sets it)")
    _num(opt, "--epochs", d.epochs, "epochs to train")
    _num(opt, "--max-steps", d.max_steps, "stop after this many optimizer steps (0: no limit)")
    _num(opt, "--learning-rate", d.learning_rate, "peak learning rate", alias="--lr")
    _num(opt, "--warmup-steps", d.warmup_steps, "linear warmup steps")
    _num(opt, "--lr-decay-steps", d.lr_decay_steps, "cosine horizon (0: the planned length of the first run)")
    _num(opt, "--min-lr-ratio", d.min_lr_ratio, "final learning rate as a fraction of the peak")
    _num(opt, "--weight-decay", d.weight_decay, "AdamW weight decay on matrices")
    _num(opt, "--grad-clip", d.grad_clip, "max global gradient norm (0: off)")
    _num(opt, "--text-loss-weight", d.text_loss_weight, "weight of the text cross-entropy (not both weights 0)")
    _num(opt, "--mel-loss-weight", d.mel_loss_weight, "weight of the mel cross-entropy (not both weights 0)")
    _num(opt, "--dropout", d.dropout, "embedding and residual dropout")
    _num(opt, "--seed", d.seed, "seed of the data order and dropout masks")
    opt.add_argument("--dropout-masks", choices=("v1", "v2"),
                     help=f"dropout mask generator: v2 is faster; runs saved before v2 existed keep v1 "
                          f"[{d.dropout_masks}]")
    _num(opt, "--train-samples", d.train_samples,
         "train on this many of the manifests' samples, a fixed seed-keyed subset (0: all); a change takes effect "
         "at the next epoch")
    opt.add_argument("--data-order", choices=("grouped", "random"),
                     help=f"grouped: each step holds samples of similar length (little padding); random: plain "
                          f"shuffled steps [{d.data_order}]")
    opt.add_argument("--freeze-base-vocab", action=argparse.BooleanOptionalAction,
                     help="keep the base checkpoint's text embedding/head rows bit-identical "
                          "[on when the tokenizer extends the base vocabulary]")
    opt.add_argument("--new-language", dest="new_languages", type=language_codes, metavar="CODE[,CODE...]",
                     help="IndexTTS-2.5: train these languages' rows (lang_embedding, and the <|xx|> token's text "
                          "rows where it has one) and hold every other row of those tables bit-identical")
    _num(opt, "--new-rows-lr-scale", d.new_rows_lr_scale,
         "learning rate of the tables whose rows train while the others are held (--new-language, an extended "
         "vocabulary), as a multiple of the run's")
    _lora_flags(opt, d)


def _lora_flags(opt: argparse._ArgumentGroup, d: TrainConfig) -> None:
    _num(opt, "--lora-rank", d.lora_rank, "rank of the LoRA adapters on the GPT blocks (0: full fine-tuning)")
    _num(opt, "--lora-alpha", "2 x rank", "LoRA scale numerator: adapters are scaled by alpha / rank")
    opt.add_argument("--lora-targets", type=lora_targets, metavar="NAME[,NAME...]",
                     help=f"projections of each GPT block that carry adapters, from {', '.join(LORA_TARGET_PATHS)} "
                          f"[all four]")
    _num(opt, "--lora-dropout", d.lora_dropout, "dropout on each adapter's input, keyed by sample")


def language_codes(text: str) -> tuple[str, ...]:
    """'tr,az' -> ('tr', 'az'): lower-cased, each once (which codes exist is the model family's to check)."""
    codes = tuple(dict.fromkeys(code.strip().lower() for code in text.split(",") if code.strip()))
    if not codes:
        raise argparse.ArgumentTypeError(f"expected language codes separated by commas, got {text!r}")
    return codes


def lora_targets(text: str) -> tuple[str, ...]:
    """'c_attn,c_fc' -> ('c_attn', 'c_fc'): known names, each once."""
    names = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in names if n not in LORA_TARGET_PATHS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of distinct names from "
                                         f"{', '.join(LORA_TARGET_PATHS)}, got {text!r}")
    return names


def _run_time_flags(rt: argparse._ArgumentGroup, d: TrainConfig) -> None:
    rt.add_argument("--amp", nargs="?", const="auto", choices=AMP_MODES,
                    help="mixed precision. auto: bf16 on GPUs that have it, fp16 with a loss scaler on older GPUs "
                         "(T4, V100), fp32 on the CPU; bf16 / fp16: that autocast dtype (also on the CPU); off: "
                         "fp32. A bare --amp is auto. A resume keeps the run's choice unless this flag is given "
                         f"[{d.amp}]")
    rt.add_argument("--tf32", action=argparse.BooleanOptionalAction,
                    help="TF32 tensor cores for fp32 matrix products on Ampere and newer GPUs [on]")
    rt.add_argument("--grad-checkpointing", action="store_true", help="recompute activations to save memory")
    rt.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                    help="deterministic kernels only, for bit-identical resume on a GPU: an op without one stops "
                         "the run (exit 2) instead of running; slower. CPU runs are deterministic anyway "
                         f"[{'on' if d.deterministic else 'off'}]")
    _num(rt, "--num-workers", d.num_workers, "data loading worker processes (0: auto)")
    rt.add_argument("--device", help=f"auto, cpu, cuda or cuda:N [{d.device}]")
    _num(rt, "--val-interval", d.val_interval, "validate every N optimizer steps (0: only at start and end)")
    _num(rt, "--max-val-batches", d.max_val_batches,
         "validate on at most this many x (--val-batch-size or the effective batch) samples (0: all)")
    _num(rt, "--val-batch-size", d.val_batch_size, "samples per validation forward pass (0: the micro-batch)")
    _num(rt, "--save-interval", d.save_interval, "save a checkpoint every N optimizer steps")
    _num(rt, "--keep-checkpoints", d.keep_checkpoints, "model_step files to keep (0: only latest.pth)")
    _num(rt, "--log-interval", d.log_interval, "log a line every N optimizer steps")
    rt.add_argument("--background-saves", action=argparse.BooleanOptionalAction,
                    help="write checkpoints in a background thread: the loop waits only for a copy of the state in "
                         "host memory (which costs as much host memory as the state) [on with CUDA, off on CPU]")
    _plan_num(rt, "--dist-timeout", "SECONDS", "under torchrun: how long a process waits for the others in a "
              "collective before it stops with exit 6 (this launch only; the variable INDEXTTS_DDP_TIMEOUT_S "
              "sets it when the flag is not given)", "1800")
    rt.add_argument("--best-metric", choices=BEST_METRICS,
                    help=f"validation metric whose best value is kept as OUTPUT_DIR/best.pth; a gen/* metric needs "
                         f"--sample-interval [{d.best_metric}]")
    _num(rt, "--sample-interval", d.sample_interval,
         "generate mel codes for a few validation samples per language at the validations of steps divisible by N, "
         "with gen/* metrics and OUTPUT_DIR/samples/ (0: off)")
    _num(rt, "--sample-temperature", d.sample_temperature,
         "generation at validation draws codes at this temperature, from a generator per sample keyed by --seed "
         "(0: greedy; IndexTTS2 inference uses 0.8)")
    _num(rt, "--sample-top-k", d.sample_top_k, "with --sample-temperature: draw from the K most likely codes (0: all; "
         "inference uses 30)")
    _num(rt, "--sample-top-p", d.sample_top_p, "with --sample-temperature: draw from the most likely codes whose "
         "probabilities sum to P (1: all; inference uses 0.8)")
    _num(rt, "--early-stop-patience", d.early_stop_patience,
         "end training (status 0, final checkpoint saved) after N validations in a row without a new best "
         "--best-metric (0: off); a resume may raise it to continue")
    _forgetting_flags(rt, d)
    rt.add_argument("--log-sample-ids", action="store_true",
                    help="append the sample ids of every optimizer step to OUTPUT_DIR/sample_ids.tsv")


def _forgetting_flags(rt: argparse._ArgumentGroup, d: TrainConfig) -> None:
    _num(rt, "--forgetting-limit", d.forgetting_limit,
         "a validation whose --forgetting-metric in a base language is worse than at the base model by more than this "
         "fraction of it (0.1: 10%%) is a warning and never best.pth (0: off)")
    rt.add_argument("--forgetting-metric", choices=BEST_METRICS,
                    help=f"the metric --forgetting-limit watches; a gen/* metric needs --sample-interval "
                         f"[{d.forgetting_metric}]")
    rt.add_argument("--forgetting-stop", action=argparse.BooleanOptionalAction,
                    help="end training (status 0, final checkpoint saved) at a validation past --forgetting-limit "
                         "[off]")
    rt.add_argument("--base-language", dest="base_languages", action="append", metavar="LANG",
                    help="a language the base model speaks, watched by --forgetting-limit; repeatable "
                         "[the languages of the replay manifests, --train-manifest F::LANG@SHARE]")


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


def _num(group: argparse._ArgumentGroup, flag: str, default: Any, text: str, alias: str | None = None) -> None:
    """A numeric flag: its form (whole number or not) is checked here, its range with the other settings
    (trainers/config/bounds.py), so a value from a saved run is held to the same range."""
    bound = BOUNDS[flag[2:].replace("-", "_")]
    kind = whole_number if bound.kind is int else real_number
    group.add_argument(flag, *([alias] if alias else []), type=kind, help=f"{text} ({bound.range_text()}) [{default}]")


def _plan_num(group: argparse._ArgumentGroup, flag: str, metavar: str, text: str, default: str) -> None:
    """A numeric flag of this invocation's plan (never saved as a setting): form and range are checked here."""
    bound = PLAN_BOUNDS[flag[2:].replace("-", "_")]
    group.add_argument(flag, type=bounded_number(bound), metavar=metavar,
                       help=f"{text} ({bound.range_text()}) [{default}]")


NUMERIC_FLAGS = frozenset([*(flag_of(name) for name, bound in BOUNDS.items() if bound.flag),
                           *(flag_of(name) for name in PLAN_BOUNDS), "--lr"])


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """`--learning-rate -1e-3` -> `--learning-rate=-1e-3`.

    argparse takes a word that starts with '-' for an option unless it looks like '-1' or '-0.5',
    so '-1e-3', '-inf' or '-1.' after a numeric flag end in "expected one argument". Joined with
    '=', the value reaches the range check, which says what is wrong with it. Only whole flag
    names are joined: the parser refuses abbreviations (`--learn -1e-3` is an unknown flag).
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        value = argv[i + 1] if i + 1 < len(argv) else None
        if (value is not None and value.startswith("-") and parses_as_number(value) and arg.startswith("--")
                and arg in NUMERIC_FLAGS):
            out.append(f"{arg}={value}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def parse_command_line(argv: Sequence[str] | None = None) -> CommandLine:
    """The typed flags, with paths made absolute (a run must not depend on the directory it was started in)."""
    args = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    ns = vars(parser.parse_args(join_negative_values(args)))
    resume = ns.pop("resume", None)
    allow = ns.pop("allow_config_change", False)
    force = ns.pop("force_resume", False)
    reconfigure = ns.pop("reconfigure_scheduler", False)
    rewarm_lr, rewarm_steps = ns.pop("rewarm_lr", None), ns.pop("rewarm_steps", None)
    rewarm = ns.pop("rewarm", False) or rewarm_lr is not None or rewarm_steps is not None
    if rewarm and reconfigure:
        parser.error("--rewarm (or --rewarm-lr / --rewarm-steps) and --reconfigure-scheduler are two different "
                     "continuations of the learning rate: pass one of them")
    data_roots = tuple(ns.pop("data_roots", ()))
    additional, scale_lr = ns.pop("additional_epochs", 0), ns.pop("scale_lr", None)
    dist_timeout = ns.pop("dist_timeout", None)
    tokenizer_check = not ns.pop("no_tokenizer_check", False)
    for key in ("train_manifests", "val_manifests"):
        if key in ns:
            ns[key] = tuple(absolute_manifest(s) for s in ns[key])
    if "base_languages" in ns:
        ns["base_languages"] = tuple(dict.fromkeys(lang.strip() for lang in ns["base_languages"]))
    for key in ("tokenizer", "config", "base_checkpoint", "output_dir"):
        if key in ns and ns[key] is not None:
            ns[key] = os.path.abspath(ns[key])
    return CommandLine(given=ns, resume=resume, allow_config_change=allow, force_resume=force,
                       reconfigure_scheduler=reconfigure, rewarm=rewarm, rewarm_lr=rewarm_lr,
                       rewarm_steps=rewarm_steps, data_roots=data_roots, additional_epochs=additional,
                       scale_lr=scale_lr, dist_timeout=dist_timeout, tokenizer_check=tokenizer_check)

