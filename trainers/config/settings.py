"""The run's settings (`TrainConfig`), each declared once (trainers/config/declare.py): its flag and help, range,
what a resume does with it, the value runs older than it trained with and the demo's value.

Kept free of heavy imports: the flag parser and `--help` use it before torch loads.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

from trainers.config.bounds import LEARNING_RATE, MAX_SEED, Bound, count, finite
from trainers.config.declare import (
    UNSET, Resume, Setting, declared, differs_from_legacy, names, saved_values, setting,
)
from trainers.config.manifest_flags import absolute_manifest

RESULT, CONTENT, FREE, MACHINE = Resume.RESULT, Resume.CONTENT, Resume.FREE, Resume.MACHINE

# The projections of a GPT block that can carry adapters (--lora-targets), by name and module path inside a
# block (gpt.h.N.<path>); here, free of torch, for the flag parser. All four are the default: see lora.py.
LORA_TARGET_PATHS = {
    "c_attn": "attn.c_attn",  # query, key and value in one matrix
    "attn_c_proj": "attn.c_proj",
    "c_fc": "mlp.c_fc",
    "mlp_c_proj": "mlp.c_proj",
}
AMP_MODES = ("auto", "bf16", "fp16", "off")
# What --best-metric may name: the validation losses and accuracy, and the gen/* metrics with a direction
# (trainers/training/generation_metrics.py owns which way each is better; tests/test_generation_at_validation.py
# checks this list against it, here free of its numpy import).
BEST_METRICS = ("mel_loss", "text_loss", "mel_top1", "gen/stop_rate", "gen/length_error_median",
                "gen/longest_run_median", "gen/repeated_ngram_share", "ema/mel_loss", "ema/text_loss", "ema/mel_top1")
# The metrics a validation listener adds, by prefix: the setting that turns it on, and what a metric of it needs.
METRIC_SOURCES = {"gen/": ("sample_interval", "a generation metric: pass --sample-interval N too (generation at "
                                              "validation is off)"),
                  "ema/": ("ema_decay", "a metric of the EMA of the weights: pass --ema-decay D too (it is off)")}


def language_codes(text: str) -> tuple[str, ...]:
    """'tr,az' -> ('tr', 'az'): lower-cased, each once (which codes exist is the model family's to check)."""
    codes = tuple(dict.fromkeys(code.strip().lower() for code in text.split(",") if code.strip()))
    if not codes:
        raise argparse.ArgumentTypeError(f"expected language codes separated by commas, got {text!r}")
    return codes


def lora_targets(text: str) -> tuple[str, ...]:
    """'c_attn,c_fc' -> ('c_attn', 'c_fc'): known names, each once."""
    targets = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in targets if n not in LORA_TARGET_PATHS]
    if unknown or not targets or len(set(targets)) != len(targets):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of distinct names from "
                                         f"{', '.join(LORA_TARGET_PATHS)}, got {text!r}")
    return targets


def _split_product(saved: dict[str, Any]) -> Any:
    """Before --effective-batch existed, the product of the split was the effective batch (UNSET: no split saved)."""
    return (saved.get("batch_size") or 0) * (saved.get("grad_accumulation") or 0) or UNSET


def _amp_mode(saved: Any) -> Any:
    """Before the modes, --amp was a switch: on meant bf16 where the GPU has it, else fp16, and fp32 on the CPU (what
    auto does); off was fp32 everywhere."""
    return ("auto" if saved else "off") if isinstance(saved, bool) else saved


def _lora_run(settings: "TrainConfig", _: Setting) -> bool:
    """A full fine-tuning run saves exactly the settings it saved before LoRA existed (byte-identical files)."""
    return bool(settings.lora_rank)


@dataclass(frozen=True)
class TrainConfig:
    # Field order is --help's order.
    train_manifests: tuple[str, ...] = setting(
        (), "training manifest; repeat for several; optional ::lang suffix; ::LANG@SHARE replays it: that fraction of "
        "every step's samples is drawn from it (the manifests without a share fill the rest and set the epoch)",
        resume=CONTENT, section="data", flag="--train-manifest", repeat="each", metavar="JSONL[::LANG[@SHARE]]",
        absolute=absolute_manifest)
    val_manifests: tuple[str, ...] = setting(
        (), "validation manifest; repeat for several", resume=FREE, flag="--val-manifest", repeat="each",
        metavar="JSONL[::LANG]", absolute=absolute_manifest)
    tokenizer: str | None = setting(None, "SentencePiece model the text ids were made with", resume=CONTENT,
                                    absolute=os.path.abspath)
    config: str = setting("checkpoints/config.yaml", "IndexTTS2 config.yaml (gpt section)", resume=CONTENT,
                          absolute=os.path.abspath, demo="checkpoints/demo.yaml")
    # Its content is part of a LoRA run (its checkpoints hold the adapters only); a full checkpoint carries every
    # tensor of it, so a full fine-tuning run reads it only to start.
    base_checkpoint: str | None = setting(None, "official gpt.pth (or a raw state dict) to start from",
                                          resume=CONTENT, absolute=os.path.abspath)
    output_dir: str = setting("runs/gpt_finetune", "run directory", resume=FREE, absolute=os.path.abspath,
                              demo="runs/demo")
    # Optimisation. The effective batch (samples per optimizer step) defines the run;
    # the micro-batch only decides how a step's samples are split for memory (0: auto).
    effective_batch: int = setting(
        32, "samples per optimizer step; defines the run and is kept on resume", resume=RESULT, section="optimisation",
        bound=count(1), legacy=_split_product, demo=16)
    batch_size: int = setting(0, "micro-batch size (samples per forward pass; 0: auto)", resume=MACHINE,
                              bound=count())
    grad_accumulation: int = setting(
        0, "micro-batches per optimizer step (0: auto; without --effective-batch, batch size x this sets it)",
        resume=MACHINE, bound=count())
    epochs: int = setting(10, "epochs to train", resume=FREE, bound=count(1), demo=100)
    max_steps: int = setting(0, "stop after this many optimizer steps (0: no limit)", resume=FREE, bound=count(),
                             demo=240)
    learning_rate: float = setting(2e-5, "peak learning rate", resume=RESULT, bound=LEARNING_RATE, aliases=("--lr",),
                                   demo=3e-3)
    warmup_steps: int = setting(500, "linear warmup steps", resume=RESULT, bound=count(), demo=20)
    lr_decay_steps: int = setting(0, "cosine horizon (0: the planned length of the first run)", resume=RESULT,
                                  bound=count())
    min_lr_ratio: float = setting(0.0, "final learning rate as a fraction of the peak", resume=RESULT,
                                  bound=finite(0.0, 1.0), demo=0.1)
    # AdamW multiplies each matrix by (1 - lr x decay) per step, which with both <= 1 never changes sign;
    # typical values are 0.01..0.1.
    weight_decay: float = setting(0.01, "AdamW weight decay on matrices", resume=RESULT, bound=finite(0.0, 1.0),
                                  demo=0.01)
    adam_beta1: float = setting(0.9, "", resume=RESULT, flag=None, bound=finite(0.0, 1.0, high_open=True))
    adam_beta2: float = setting(0.999, "", resume=RESULT, flag=None, bound=finite(0.0, 1.0, high_open=True))
    adam_eps: float = setting(1e-8, "", resume=RESULT, flag=None, bound=finite(0.0, 1.0, low_open=True))
    grad_clip: float = setting(1.0, "max global gradient norm (0: off)", resume=RESULT, bound=finite())
    text_loss_weight: float = setting(0.2, "weight of the text cross-entropy (not both weights 0)", resume=RESULT,
                                      bound=finite(), demo=0.2)
    mel_loss_weight: float = setting(0.8, "weight of the mel cross-entropy (not both weights 0)", resume=RESULT,
                                     bound=finite(), demo=0.8)
    dropout: float = setting(0.1, "embedding and residual dropout", resume=RESULT,
                             bound=finite(0.0, 1.0, high_open=True), demo=0.0)
    # numpy's PCG64 takes any integer >= 0, torch.Generator.manual_seed at most 2**64 - 1, the dropout-mask hash
    # its low 32 bits: seeds that differ only above bit 32 share dropout masks but not the data order.
    seed: int = setting(1234, "seed of the data order and dropout masks", resume=RESULT, bound=Bound(int, 0, MAX_SEED))
    # The mask generator of trainers/model/sample_dropout.py; before v2, the first generator, kept bit for bit.
    # v3 (fused, for GPUs) only when chosen, until a GPU measures its gain.
    dropout_masks: str = setting("v2", "dropout mask generator: v2 is faster than v1; v3 makes each mask in the "
                                 "kernel that applies it (for GPUs; slower than v2 on a CPU); runs saved before v2 "
                                 "existed keep v1", resume=RESULT, choices=("v1", "v2", "v3"), legacy="v1")
    train_samples: int = setting(
        0, "train on this many of the manifests' samples, a fixed seed-keyed subset (0: all); a change takes effect "
        "at the next epoch", resume=RESULT, bound=count(), legacy=0)
    # The demo's 384 samples: grouping would keep the same step-mates every epoch (see docs/speed.md, "Length-grouped
    # steps"). Random before length grouping.
    data_order: str = setting("grouped", "grouped: each step holds samples of similar length (little padding); "
                              "random: plain shuffled steps", resume=RESULT, choices=("grouped", "random"),
                              legacy="random", demo="random")
    freeze_base_vocab: bool | None = setting(
        None, "keep the base checkpoint's text embedding/head rows bit-identical", resume=RESULT, negatable=True,
        shown="on when the tokenizer extends the base vocabulary", legacy=False)
    # A family's language rows (IndexTTS-2.5). A run without new rows saves neither (as every run before).
    new_languages: tuple[str, ...] = setting(
        (), "IndexTTS-2.5: train these languages' rows (lang_embedding, and the <|xx|> token's text rows where it has "
        "one) and hold every other row of those tables bit-identical", resume=RESULT, flag="--new-language",
        parse=language_codes, metavar="CODE[,CODE...]", legacy=(), saved_if=differs_from_legacy)
    new_rows_lr_scale: float = setting(
        1.0, "learning rate of the tables whose rows train while the others are held (--new-language, an extended "
        "vocabulary), as a multiple of the run's", resume=RESULT, bound=finite(0.0, 1000.0, low_open=True), legacy=1.0,
        saved_if=differs_from_legacy)
    # LoRA (trainers/model/lora.py): rank 0 is full fine-tuning; a larger rank than 4096 (wider than any GPT's
    # model_dim here) is no low-rank adapter but a typo. alpha None until resolved: 2 x rank, so the adapters' scale
    # alpha/rank is 2 whatever the rank (a rank change then needs no new learning rate; the ratio 2 is the common
    # choice of LoRA fine-tuning recipes). Adapter dropout 0: the model's own --dropout already acts on the
    # activations every adapter sees; a second one mostly slows learning on small data.
    lora_rank: int = setting(0, "rank of the LoRA adapters on the GPT blocks (0: full fine-tuning)", resume=RESULT,
                             bound=Bound(int, 0, 4096), legacy=0, saved_if=_lora_run)
    lora_alpha: float | None = setting(
        None, "LoRA scale numerator: adapters are scaled by alpha / rank", resume=RESULT,
        bound=finite(0.0, low_open=True), shown="2 x rank", legacy=None, saved_if=_lora_run)
    lora_targets: tuple[str, ...] = setting(
        tuple(LORA_TARGET_PATHS), f"projections of each GPT block that carry adapters, from "
        f"{', '.join(LORA_TARGET_PATHS)}", resume=RESULT, parse=lora_targets, metavar="NAME[,NAME...]",
        shown="all four", legacy=tuple(LORA_TARGET_PATHS), saved_if=_lora_run)
    lora_dropout: float = setting(0.0, "dropout on each adapter's input, keyed by sample", resume=RESULT,
                                  bound=finite(0.0, 1.0, high_open=True), legacy=0.0, saved_if=_lora_run)
    # The moving average of the trained weights (trainers/training/ema.py): it changes no weight, but what best.pth and
    # an --ema export hold. A decay of 1 would never move from the first weights. Left out of runs without it.
    ema_decay: float = setting(
        0.0, "keep an exponential moving average of the trained weights with this decay per step, validated as ema/* "
        "metrics and exported with indextts-export --ema (0: off; e.g. 0.999)", resume=RESULT,
        bound=finite(0.0, 1.0, high_open=True), legacy=0.0, saved_if=differs_from_legacy)
    ema_start: int = setting(0, "the moving average equals the weights up to this step, then averages them",
                             resume=RESULT, bound=count(), legacy=0, saved_if=differs_from_legacy)
    # Run-time choices that change the result by float rounding at most (--amp: hardware/precision.py).
    amp: str = setting(
        "auto", "mixed precision. auto: bf16 on GPUs that have it, fp16 with a loss scaler on older GPUs (T4, V100), "
        "fp32 on the CPU; bf16 / fp16: that autocast dtype (also on the CPU); off: fp32. A bare --amp is auto. A "
        "resume keeps the run's choice unless this flag is given", resume=FREE, section="run time", choices=AMP_MODES,
        bare="auto", upgrade=_amp_mode)
    tf32: bool = setting(True, "TF32 tensor cores for fp32 matrix products on Ampere and newer GPUs", resume=FREE,
                         negatable=True)
    grad_checkpointing: bool = setting(False, "recompute activations to save memory", resume=FREE)
    deterministic: bool = setting(
        False, "deterministic kernels only, for bit-identical resume on a GPU: an op without one stops the run (exit "
        "2) instead of running; slower. CPU runs are deterministic anyway", resume=FREE, negatable=True)
    # Each worker is a process: more than 256 never speed up loading, and a typo would start thousands.
    num_workers: int = setting(0, "data loading worker processes (0: auto)", resume=MACHINE, bound=Bound(int, 0, 256))
    device: str = setting("auto", "auto, cpu, cuda or cuda:N", resume=MACHINE)
    val_interval: int = setting(500, "validate every N optimizer steps (0: only at start and end)", resume=FREE,
                                bound=count(), demo=80)
    max_val_batches: int = setting(
        10, "validate on at most this many x (--val-batch-size or the effective batch) samples (0: all)", resume=FREE,
        bound=count(), demo=8)
    val_batch_size: int = setting(0, "samples per validation forward pass (0: the micro-batch)", resume=MACHINE,
                                  bound=count())
    save_interval: int = setting(1000, "save a checkpoint every N optimizer steps", resume=FREE, bound=count(1),
                                 demo=80)
    keep_checkpoints: int = setting(3, "model_step files to keep (0: only latest.pth)", resume=FREE, bound=count(),
                                    demo=2)
    log_interval: int = setting(10, "log a line every N optimizer steps", resume=FREE, bound=count(1), demo=20)
    # None: in the background on CUDA (the loop waits on the GPU anyway), synchronous on CPU (the
    # writer would compete with training for the cores).
    background_saves: bool | None = setting(
        None, "write checkpoints in a background thread: the loop waits only for a copy of the state in host memory "
        "(which costs as much host memory as the state)", resume=FREE, negatable=True, shown="on with CUDA, off on CPU")
    best_metric: str = setting(
        "mel_loss", "validation metric whose best value is kept as OUTPUT_DIR/best.pth; a gen/* metric needs "
        "--sample-interval", resume=FREE, choices=BEST_METRICS)
    # Off by default: on the CPU the official model takes minutes per 4 samples (docs/architecture.md,
    # "Generation").
    sample_interval: int = setting(
        0, "generate mel codes for a few validation samples per language at the validations of steps divisible by N, "
        "with gen/* metrics and OUTPUT_DIR/samples/ (0: off)", resume=FREE, bound=count(), legacy=0)
    # Drawn in trainers/run/validation_generation.py. Far above a temperature of ~2 every code is about as
    # likely, so more than 100 is a typo.
    sample_temperature: float = setting(
        0.0, "generation at validation draws codes at this temperature, from a generator per sample keyed by --seed "
        "(0: greedy; IndexTTS2 inference uses 0.8)", resume=FREE, bound=finite(0.0, 100.0), legacy=0.0)
    sample_top_k: int = setting(0, "with --sample-temperature: draw from the K most likely codes (0: all; inference "
                                "uses 30)", resume=FREE, bound=count(), legacy=0)
    sample_top_p: float = setting(
        1.0, "with --sample-temperature: draw from the most likely codes whose probabilities sum to P (1: all; "
        "inference uses 0.8)", resume=FREE, bound=finite(0.0, 1.0, low_open=True), legacy=1.0)
    early_stop_patience: int = setting(
        0, "end training (status 0, final checkpoint saved) after N validations in a row without a new best "
        "--best-metric (0: off); a resume may raise it to continue", resume=FREE, bound=count(), legacy=0)
    # The forgetting guard (trainers/training/forgetting.py); none before it existed. A limit above 1 (a 100%
    # rise) is a percentage typed for the fraction, which no forgetting reaches: refused, naming the fraction.
    forgetting_limit: float = setting(
        0.0, "a validation whose --forgetting-metric in a base language is worse than at the base model by more than "
        "this fraction of it (0.1: 10%%) is a warning and never best.pth (0: off)", resume=FREE,
        bound=finite(0.0, 1.0, hint=lambda value: (
            f"--forgetting-limit {value:g} is a {value * 100:g}% rise, which no forgetting reaches: it is a fraction "
            f"(0.1 is 10%); for {value:g}% pass {value / 100:g}")), legacy=0.0)
    forgetting_metric: str = setting(
        "mel_loss", "the metric --forgetting-limit watches; a gen/* metric needs --sample-interval", resume=FREE,
        choices=BEST_METRICS, legacy="mel_loss")
    forgetting_stop: bool = setting(
        False, "end training (status 0, final checkpoint saved) at a validation past --forgetting-limit", resume=FREE,
        negatable=True, legacy=False)
    base_languages: tuple[str, ...] = setting(
        (), "a language the base model speaks, watched by --forgetting-limit; repeatable", resume=FREE,
        flag="--base-language", repeat="once", parse=str.strip, metavar="LANG",
        shown="the languages of the replay manifests, --train-manifest F::LANG@SHARE", legacy=())
    log_sample_ids: bool = setting(False, "append the sample ids of every optimizer step to "
                                   "OUTPUT_DIR/sample_ids.tsv", resume=FREE)
    demo: bool = setting(False, "train the tiny demo config on a built-in synthetic corpus", resume=FREE, section="")

    def validated_samples(self, available: int) -> int:
        """How many of the `available` validation samples a validation evaluates: a count fixed by the settings,
        never by the hardware's batch size (the first ones, in manifest order)."""
        if not self.max_val_batches:
            return available
        return min(available, self.max_val_batches * (self.val_batch_size or self.effective_batch))

    def to_dict(self) -> dict[str, Any]:
        """The settings a run saves (tuples as lists), each unless its saved_if leaves it out."""
        saved = {s.name: getattr(self, s.name) for s in declared(TrainConfig) if not s.saved_if or s.saved_if(self, s)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in saved.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in FIELD_NAMES})


FIELD_NAMES = frozenset(f.name for f in fields(TrainConfig))
LORA_KEYS = tuple(s.name for s in declared(TrainConfig) if s.saved_if is _lora_run)
EXACTNESS_KEYS = names(TrainConfig, RESULT)  # a change makes a resumed run differ from the uninterrupted one
HARDWARE_KEYS = names(TrainConfig, MACHINE)  # how this machine runs a step: never carried to another (resolve.py)
DEMO_DEFAULTS = {s.name: s.demo for s in declared(TrainConfig) if s.demo is not UNSET}
# The run fingerprint naming a LoRA run's base: the sha256 of its --base-checkpoint file (trainers/run/inputs.py).
BASE_FINGERPRINT = "base_checkpoint_sha256"


def saved_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run's settings, completed for runs written by older versions of the trainer (trainers/config/declare.py
    saved_values)."""
    return saved_values(TrainConfig, saved)


@dataclass(frozen=True)
class ConfigChange:
    key: str
    saved: Any
    now: Any
    breaks_exactness: bool

    def describe(self) -> str:
        name, saved, now, tag = self.parts()
        return f"{name}: saved {saved}, now {now} ({tag})"

    def parts(self) -> tuple[str, str, str, str]:
        """(name, saved value, value now, whether it changes the result) as described."""
        tag = "changes the result" if self.breaks_exactness else "ok"
        if _is_digest(self.saved) or _is_digest(self.now):  # sha256 digests: 12 digits tell them apart
            return FINGERPRINT_NAMES.get(self.key, f"{self.key} (sha256)"), _short(self.saved), _short(self.now), tag
        return self.key, repr(self.saved), repr(self.now), tag


FINGERPRINT_NAMES = {"data": "data (the training manifests' sha256)", "model_config": "model_config (its sha256)"}


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _short(value: Any) -> str:
    return f"{value[:12]}..." if _is_digest(value) else repr(value)


def compare(saved: TrainConfig, now: TrainConfig, fingerprints_saved: dict[str, str],
            fingerprints_now: dict[str, str]) -> list[ConfigChange]:
    """Every difference between the saved run and this one, those that break exactness first."""
    changes = [ConfigChange(s.name, getattr(saved, s.name), getattr(now, s.name), s.resume is RESULT)
               for s in declared(TrainConfig) if getattr(saved, s.name) != getattr(now, s.name)]
    changes.sort(key=lambda c: not c.breaks_exactness)
    changes += [ConfigChange(k, fingerprints_saved.get(k), fingerprints_now.get(k), True)
                for k in sorted(set(fingerprints_saved) | set(fingerprints_now))
                if fingerprints_saved.get(k) != fingerprints_now.get(k)]
    return changes
