"""Command-line flags, the resolved run configuration, and what may change on resume.

Resolution order: built-in defaults < demo defaults (with --demo) < the configuration saved
with the run being resumed < flags given on this command line. Only flags the user actually
typed count as given, so `--resume auto --output-dir DIR` alone continues a run unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence


class UserError(Exception):
    """A problem with the user's flags, files or run directory; printed without a traceback."""


@dataclass(frozen=True)
class TrainConfig:
    train_manifests: tuple[str, ...] = ()
    val_manifests: tuple[str, ...] = ()
    tokenizer: str | None = None
    config: str = "checkpoints/config.yaml"
    base_checkpoint: str | None = None
    output_dir: str = "runs/gpt_finetune"
    # Optimisation. The effective batch (samples per optimizer step) defines the run;
    # the micro-batch only decides how a step's samples are split for memory (0: auto).
    effective_batch: int = 32
    batch_size: int = 0
    grad_accumulation: int = 0
    epochs: int = 10
    max_steps: int = 0
    learning_rate: float = 2e-5
    warmup_steps: int = 500
    lr_decay_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    text_loss_weight: float = 0.2
    mel_loss_weight: float = 0.8
    dropout: float = 0.1
    seed: int = 1234
    # None until setup: on when the tokenizer extends the base checkpoint's vocabulary.
    freeze_base_vocab: bool | None = None
    # Run-time choices that do not change the result beyond float rounding.
    amp: bool = False
    grad_checkpointing: bool = False
    deterministic: bool = False
    num_workers: int = 0
    device: str = "auto"
    val_interval: int = 500
    max_val_batches: int = 10
    val_batch_size: int = 0
    save_interval: int = 1000
    keep_checkpoints: int = 3
    log_interval: int = 10
    log_sample_ids: bool = False
    demo: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["train_manifests"] = list(self.train_manifests)
        d["val_manifests"] = list(self.val_manifests)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        for key in ("train_manifests", "val_manifests"):
            if key in values:
                values[key] = tuple(values[key])
        if "effective_batch" not in values and values.get("batch_size") and values.get("grad_accumulation"):
            # Files written before --effective-batch existed: the product was the effective batch.
            values["effective_batch"] = values["batch_size"] * values["grad_accumulation"]
        return cls(**values)


# Demo defaults: the tiny config on the built-in corpus, finishing in about two minutes on 2 cores.
DEMO_DEFAULTS: dict[str, Any] = {
    "config": "checkpoints/demo.yaml",
    "output_dir": "runs/demo",
    "effective_batch": 16,
    "epochs": 100,
    "max_steps": 240,
    "learning_rate": 3e-3,
    "warmup_steps": 20,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.01,
    "text_loss_weight": 0.2,
    "mel_loss_weight": 0.8,
    "dropout": 0.0,
    "val_interval": 80,
    "max_val_batches": 8,
    "save_interval": 80,
    "keep_checkpoints": 2,
    "log_interval": 20,
}

# Settings whose change makes a resumed run differ from the uninterrupted one.
EXACTNESS_KEYS = (
    "seed", "effective_batch", "learning_rate", "warmup_steps", "lr_decay_steps", "min_lr_ratio",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "grad_clip", "text_loss_weight",
    "mel_loss_weight", "dropout", "freeze_base_vocab",
)
# Settings that may change freely: hardware split, bookkeeping, how long to train.
FREE_KEYS = (
    "batch_size", "grad_accumulation", "epochs", "max_steps", "amp", "grad_checkpointing", "deterministic", "num_workers",
    "device", "val_interval", "max_val_batches", "val_batch_size", "save_interval", "keep_checkpoints",
    "log_interval", "log_sample_ids", "val_manifests", "output_dir", "base_checkpoint", "config",
    "train_manifests", "tokenizer",  # compared through fingerprints instead of paths
)


def build_parser() -> argparse.ArgumentParser:
    # SUPPRESS as the default keeps untyped flags out of the namespace, so we know what was given.
    p = argparse.ArgumentParser(
        prog="train_gpt_v2.py",
        description="Fine-tune the IndexTTS2 GPT with exact, interruption-proof resume.",
        argument_default=argparse.SUPPRESS,
    )
    d = TrainConfig()
    data = p.add_argument_group("data")
    data.add_argument("--train-manifest", dest="train_manifests", action="append", metavar="JSONL[::LANG]",
                      help="training manifest; repeat for several; optional ::lang suffix")
    data.add_argument("--val-manifest", dest="val_manifests", action="append", metavar="JSONL[::LANG]",
                      help="validation manifest; repeat for several")
    data.add_argument("--tokenizer", help="SentencePiece model the text ids were made with")
    data.add_argument("--config", help=f"IndexTTS2 config.yaml (gpt section) [{d.config}]")
    data.add_argument("--base-checkpoint", help="official gpt.pth (or a raw state dict) to start from")
    data.add_argument("--output-dir", help=f"run directory [{d.output_dir}]")

    opt = p.add_argument_group("optimisation")
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
    opt.add_argument("--freeze-base-vocab", action=argparse.BooleanOptionalAction,
                     help="keep the base checkpoint's text embedding/head rows bit-identical "
                          "[on when the tokenizer extends the base vocabulary]")

    rt = p.add_argument_group("run time")
    rt.add_argument("--amp", action="store_true", help="mixed precision on CUDA (bf16 if supported, else fp16)")
    rt.add_argument("--grad-checkpointing", action="store_true", help="recompute activations to save memory")
    rt.add_argument("--deterministic", action="store_true",
                    help="deterministic CUDA kernels, for bit-identical resume on GPU (slower; CPU runs are deterministic anyway)")
    _num(rt, "--num-workers", int, d.num_workers, "data loading worker processes (0: auto)")
    rt.add_argument("--device", help=f"auto, cpu, cuda or cuda:N [{d.device}]")
    _num(rt, "--val-interval", int, d.val_interval, "validate every N optimizer steps (0: only at start and end)")
    _num(rt, "--max-val-batches", int, d.max_val_batches, "validation batches per evaluation (0: all)")
    _num(rt, "--val-batch-size", int, d.val_batch_size, "validation batch size (0: the effective batch)")
    _num(rt, "--save-interval", int, d.save_interval, "save a checkpoint every N optimizer steps")
    _num(rt, "--keep-checkpoints", int, d.keep_checkpoints, "model_step files to keep (0: only latest.pth)")
    _num(rt, "--log-interval", int, d.log_interval, "log a line every N optimizer steps")
    rt.add_argument("--log-sample-ids", action="store_true",
                    help="append the sample ids of every optimizer step to OUTPUT_DIR/sample_ids.tsv")

    rs = p.add_argument_group("resume")
    rs.add_argument("--resume", metavar="auto|PATH",
                    help="auto: continue OUTPUT_DIR/latest.pth if present, else start fresh; PATH: continue that checkpoint")
    rs.add_argument("--allow-config-change", action="store_true",
                    help="resume although settings that change the result differ from the saved run")
    rs.add_argument("--force-resume", action="store_true",
                    help="resume although the checkpoint fails a consistency check")
    p.add_argument("--demo", action="store_true", help="train the tiny demo config on a built-in synthetic corpus")
    return p


def _num(group: argparse._ArgumentGroup, flag: str, kind: type, default: Any, text: str) -> None:
    group.add_argument(flag, type=kind, help=f"{text} [{default}]")


@dataclass(frozen=True)
class CommandLine:
    given: dict[str, Any]  # flags typed by the user, in TrainConfig field names
    resume: str | None
    allow_config_change: bool = False
    force_resume: bool = False


def parse_command_line(argv: Sequence[str] | None = None) -> CommandLine:
    ns = vars(build_parser().parse_args(argv))
    resume = ns.pop("resume", None)
    allow = ns.pop("allow_config_change", False)
    force = ns.pop("force_resume", False)
    for key in ("train_manifests", "val_manifests"):
        if key in ns:
            ns[key] = tuple(_absolute_spec(s) for s in ns[key])
    for key in ("tokenizer", "config", "base_checkpoint", "output_dir"):
        if key in ns and ns[key] is not None:
            ns[key] = os.path.abspath(ns[key])
    return CommandLine(given=ns, resume=resume, allow_config_change=allow, force_resume=force)


def _absolute_spec(spec: str) -> str:
    path, sep, lang = spec.partition("::")
    return os.path.abspath(path) + (sep + lang if sep else "")


def resolve(cmd: CommandLine, saved: dict[str, Any] | None, repo_root: Path) -> TrainConfig:
    """Combine defaults, demo defaults, the saved run configuration and the given flags."""
    values: dict[str, Any] = {}
    demo = cmd.given.get("demo", bool(saved and saved.get("demo")))
    if demo:
        values.update(DEMO_DEFAULTS)
        values["config"] = str(repo_root / DEMO_DEFAULTS["config"])
        values["output_dir"] = os.path.abspath(DEMO_DEFAULTS["output_dir"])
    else:
        values["config"] = str(repo_root / TrainConfig.config)
    if saved:
        values.update({k: v for k, v in saved.items() if k in {f.name for f in fields(TrainConfig)}})
    if saved and "effective_batch" not in saved and saved.get("batch_size") and saved.get("grad_accumulation"):
        values["effective_batch"] = saved["batch_size"] * saved["grad_accumulation"]
    if saved and "freeze_base_vocab" not in saved:
        values["freeze_base_vocab"] = False  # runs saved before the option existed trained every row
    given = _given_batch_split(cmd.given)
    values.update(given)
    cfg = TrainConfig.from_dict(values)
    _check_values(cfg)
    return cfg


def _given_batch_split(given: dict[str, Any]) -> dict[str, Any]:
    """The batch flags as typed, completed so the split never contradicts the effective batch.

    Giving one of --batch-size / --grad-accumulation makes the other one derived (auto), so a
    resumed run may change its split freely. Giving both without --effective-batch sets the
    effective batch to their product, as in the community trainer.
    """
    given = dict(given)
    micro, accum = given.get("batch_size"), given.get("grad_accumulation")
    if micro is not None and accum is None:
        given["grad_accumulation"] = 0
    if accum is not None and micro is None:
        given["batch_size"] = 0
    if micro and accum:
        if "effective_batch" not in given:
            given["effective_batch"] = micro * accum
        elif micro * accum != given["effective_batch"]:
            raise UserError(f"--batch-size {micro} x --grad-accumulation {accum} = {micro * accum} samples per step, "
                            f"but --effective-batch is {given['effective_batch']}; give two of the three, not all")
    return given


def _check_values(cfg: TrainConfig) -> None:
    for name in ("effective_batch", "epochs"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    for name in ("batch_size", "grad_accumulation", "max_steps", "warmup_steps", "lr_decay_steps", "num_workers",
                 "val_interval", "max_val_batches", "save_interval", "keep_checkpoints", "val_batch_size"):
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {getattr(cfg, name)}")
    if cfg.log_interval < 1:
        raise UserError(f"--log-interval must be at least 1, got {cfg.log_interval}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise UserError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.learning_rate <= 0:
        raise UserError(f"--learning-rate must be positive, got {cfg.learning_rate}")
    if not cfg.demo:
        if not cfg.train_manifests:
            raise UserError("no training data: pass --train-manifest FILE (or --demo for the built-in corpus)")
        if not cfg.tokenizer:
            raise UserError("no tokenizer: pass --tokenizer bpe.model (the SentencePiece model your text ids came from)")


@dataclass(frozen=True)
class ConfigChange:
    key: str
    saved: Any
    now: Any
    breaks_exactness: bool

    def describe(self) -> str:
        tag = "changes the result" if self.breaks_exactness else "ok"
        return f"{self.key}: saved {self.saved!r}, now {self.now!r} ({tag})"


def compare(saved: TrainConfig, now: TrainConfig, fingerprints_saved: dict[str, str], fingerprints_now: dict[str, str]) -> list[ConfigChange]:
    """Every difference between the saved run and this one, marking those that break exactness."""
    changes = []
    for key in EXACTNESS_KEYS:
        a, b = getattr(saved, key), getattr(now, key)
        if a != b:
            changes.append(ConfigChange(key, a, b, True))
    for key in FREE_KEYS:
        a, b = getattr(saved, key), getattr(now, key)
        if a != b:
            changes.append(ConfigChange(key, a, b, False))
    for key in sorted(set(fingerprints_saved) | set(fingerprints_now)):
        a, b = fingerprints_saved.get(key), fingerprints_now.get(key)
        if a != b:
            changes.append(ConfigChange(key, a, b, True))
    return changes


def save_run_config(cfg: TrainConfig, path: Path, extra: dict[str, Any]) -> None:
    """Write the resolved configuration as JSON (temp file + rename, so it is never half written)."""
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps({"config": cfg.to_dict(), **extra}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


__all__ = [
    "CommandLine", "ConfigChange", "DEMO_DEFAULTS", "EXACTNESS_KEYS", "TrainConfig", "UserError",
    "build_parser", "compare", "parse_command_line", "resolve", "save_run_config",
]
