"""The run's settings (`TrainConfig`), the demo's defaults, and which settings may change on resume.

Kept free of heavy imports: the flag parser and `--help` use it before torch loads.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


# The projections of a GPT block that can carry adapters (--lora-targets), by name and module path inside a
# block (gpt.h.N.<path>); here, free of torch, for the flag parser. All four are the default: see lora.py.
LORA_TARGET_PATHS = {
    "c_attn": "attn.c_attn",  # query, key and value in one matrix
    "attn_c_proj": "attn.c_proj",
    "c_fc": "mlp.c_fc",
    "mlp_c_proj": "mlp.c_proj",
}


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
    lr_decay_steps: int = 0  # 0 until resolved: the planned length of the run's first invocation
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    text_loss_weight: float = 0.2
    mel_loss_weight: float = 0.8
    dropout: float = 0.1
    # The mask generator of trainers/model/sample_dropout.py; runs saved before v2 have "v1" (LEGACY_VALUES).
    dropout_masks: str = "v2"
    seed: int = 1234
    # grouped: steps of similar-length samples (little padding); random: plain shuffled steps.
    data_order: str = "grouped"
    train_samples: int = 0  # a seed-keyed subset of this many training samples (0: all of them)
    # None until resolved: on when the tokenizer extends the base checkpoint's vocabulary.
    freeze_base_vocab: bool | None = None
    # A model family with language rows (IndexTTS-2.5): these languages' rows train (their lang_embedding row and
    # <|xx|> token row), every other row of those tables is held bit-identical. The learning rate of the tables
    # whose rows are partly held (these, or an extended vocabulary's text tables) times new_rows_lr_scale.
    new_languages: tuple[str, ...] = ()
    new_rows_lr_scale: float = 1.0
    # LoRA (trainers/model/lora.py): rank 0 is full fine-tuning. alpha None until resolved: 2 x rank, so the
    # adapters' scale alpha/rank is 2 whatever the rank (a rank change then needs no new learning rate; the
    # ratio 2 is the common choice of LoRA fine-tuning recipes). Adapter dropout 0: the model's own --dropout
    # already acts on the activations every adapter sees; a second one mostly slows learning on small data.
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] = tuple(LORA_TARGET_PATHS)
    lora_dropout: float = 0.0
    # Run-time choices that do not change the result beyond float rounding.
    # Mixed precision (AMP_MODES): auto is bf16 on GPUs that have it, fp16 with a loss scaler on
    # older GPUs, fp32 on the CPU (trainers/hardware/precision.py).
    amp: str = "auto"
    tf32: bool = True
    grad_checkpointing: bool = False
    deterministic: bool = False
    num_workers: int = 0
    device: str = "auto"
    val_interval: int = 500
    max_val_batches: int = 10
    val_batch_size: int = 0
    save_interval: int = 1000
    keep_checkpoints: int = 3
    # None: in the background on CUDA (the loop waits on the GPU anyway), synchronous on CPU (the
    # writer would compete with training for the cores).
    background_saves: bool | None = None
    log_interval: int = 10
    log_sample_ids: bool = False
    best_metric: str = "mel_loss"  # the validation metric best.pth is kept for: mel_loss, text_loss or mel_top1
    early_stop_patience: int = 0  # end training after this many validations without a new best (0: off)
    # The forgetting guard (trainers/training/forgetting.py): a validation whose forgetting_metric in a base
    # language is worse than at the base by more than this fraction is never best.pth (0: off); with
    # forgetting_stop the run ends there. Base languages: these, else the replay manifests' languages.
    forgetting_limit: float = 0.0
    forgetting_metric: str = "mel_loss"
    forgetting_stop: bool = False
    base_languages: tuple[str, ...] = ()
    # Generate the chosen validation samples at validations of steps divisible by this (0: off). Off by default:
    # on the CPU the official model takes minutes per 4 samples (docs/architecture.md, "Generation").
    sample_interval: int = 0
    # Greedy generation unless the temperature is > 0: then codes are drawn, with top-k (0: off) and top-p
    # (1.0: off), from a generator per sample keyed by the seed (trainers/run/validation_generation.py).
    sample_temperature: float = 0.0
    sample_top_k: int = 0
    sample_top_p: float = 1.0
    demo: bool = False

    def validated_samples(self, available: int) -> int:
        """How many of the `available` validation samples a validation evaluates: a count fixed by the settings,
        never by the hardware's batch size (the first ones, in manifest order)."""
        if not self.max_val_batches:
            return available
        return min(available, self.max_val_batches * (self.val_batch_size or self.effective_batch))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["train_manifests"] = list(self.train_manifests)
        d["val_manifests"] = list(self.val_manifests)
        d["lora_targets"] = list(self.lora_targets)
        d["base_languages"] = list(self.base_languages)
        d["new_languages"] = list(self.new_languages)
        if not self.lora_rank:
            # A full fine-tuning run saves exactly the settings it saved before LoRA existed (byte-identical files).
            for key in LORA_KEYS:
                del d[key]
        for key in NEW_ROW_KEYS:  # likewise a run without new-language rows (every run before they existed)
            if getattr(self, key) == LEGACY_VALUES[key]:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        values = {k: v for k, v in d.items() if k in FIELD_NAMES}
        for key in ("train_manifests", "val_manifests", "lora_targets", "base_languages", "new_languages"):
            if key in values:
                values[key] = tuple(values[key])
        return cls(**values)


FIELD_NAMES = frozenset(f.name for f in fields(TrainConfig))
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")
NEW_ROW_KEYS = ("new_languages", "new_rows_lr_scale")
# The run fingerprint naming a LoRA run's base: the sha256 of its --base-checkpoint file (trainers/run/inputs.py).
BASE_FINGERPRINT = "base_checkpoint_sha256"

AMP_MODES = ("auto", "bf16", "fp16", "off")
# What --best-metric may name: the validation losses and accuracy, and the gen/* metrics with a direction
# (trainers/training/generation_metrics.py owns which way each is better; tests/test_generation_at_validation.py
# checks this list against it, here free of its numpy import).
BEST_METRICS = ("mel_loss", "text_loss", "mel_top1", "gen/stop_rate", "gen/length_error_median",
                "gen/longest_run_median", "gen/repeated_ngram_share")

# Settings a saved run lacks because it was written before they existed, with the value
# that run actually trained with (never today's default, which may differ).
LEGACY_VALUES: dict[str, Any] = {
    "freeze_base_vocab": False,  # before the option, every row was trained
    "data_order": "random",  # before length grouping
    "train_samples": 0,  # before subsets: every sample
    "dropout_masks": "v1",  # before the faster masks: the first generator, kept bit for bit
    "lora_rank": 0,  # before LoRA (and every full fine-tuning run, which does not save the LoRA settings)
    "lora_alpha": None,
    "lora_targets": tuple(LORA_TARGET_PATHS),
    "lora_dropout": 0.0,
    "new_languages": (),  # before language rows: none held, none singled out
    "new_rows_lr_scale": 1.0,
    "early_stop_patience": 0,  # before early stopping: never
    "forgetting_limit": 0.0,  # before the forgetting guard: no guard
    "forgetting_metric": "mel_loss",
    "forgetting_stop": False,
    "base_languages": (),
    "sample_interval": 0,  # before generation at validation: none
    "sample_temperature": 0.0,  # before sampled generation: greedy
    "sample_top_k": 0,
    "sample_top_p": 1.0,
}


def saved_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run's settings, completed for runs written by older versions of the trainer."""
    values = {k: v for k, v in saved.items() if k in FIELD_NAMES}
    for key, legacy in LEGACY_VALUES.items():
        values.setdefault(key, legacy)
    if isinstance(values.get("amp"), bool):
        # Before the modes, --amp was a switch: on meant bf16 where the GPU has it, else fp16, and
        # fp32 on the CPU (what auto does); off was fp32 everywhere.
        values["amp"] = "auto" if values["amp"] else "off"
    if "effective_batch" not in values and values.get("batch_size") and values.get("grad_accumulation"):
        # Before --effective-batch existed, the product of the split was the effective batch.
        values["effective_batch"] = values["batch_size"] * values["grad_accumulation"]
    return values


# Demo defaults: the tiny config on the built-in corpus, finishing in well under a minute on 2 cores.
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
    # 384 samples: grouping would keep the same step-mates every epoch (see docs/speed.md, "Length-grouped steps").
    "data_order": "random",
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
    "mel_loss_weight", "dropout", "dropout_masks", "freeze_base_vocab", "data_order", "train_samples",
    *LORA_KEYS, *NEW_ROW_KEYS,
)
# How this machine runs a step: never carried to another machine (see resolve.py).
HARDWARE_KEYS = ("batch_size", "grad_accumulation", "num_workers", "device", "val_batch_size")
# Settings that may change freely: bookkeeping, how long to train, where files are.
FREE_KEYS = (
    *HARDWARE_KEYS, "epochs", "max_steps", "amp", "tf32", "grad_checkpointing", "deterministic", "val_interval",
    "max_val_batches", "save_interval", "keep_checkpoints", "background_saves", "log_interval", "log_sample_ids",
    "best_metric", "early_stop_patience", "forgetting_limit", "forgetting_metric", "forgetting_stop", "base_languages",
    "sample_interval", "sample_temperature", "sample_top_k", "sample_top_p",
    "val_manifests",
    "output_dir", "base_checkpoint", "config",
    "train_manifests", "tokenizer",  # compared through fingerprints instead of paths
)


@dataclass(frozen=True)
class ConfigChange:
    key: str
    saved: Any
    now: Any
    breaks_exactness: bool

    def describe(self) -> str:
        tag = "changes the result" if self.breaks_exactness else "ok"
        if _is_digest(self.saved) or _is_digest(self.now):  # sha256 digests: 12 digits tell them apart
            name = FINGERPRINT_NAMES.get(self.key, f"{self.key} (sha256)")
            return f"{name}: saved {_short(self.saved)}, now {_short(self.now)} ({tag})"
        return f"{self.key}: saved {self.saved!r}, now {self.now!r} ({tag})"


FINGERPRINT_NAMES = {"data": "data (the training manifests' sha256)", "model_config": "model_config (its sha256)"}


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _short(value: Any) -> str:
    return f"{value[:12]}..." if _is_digest(value) else repr(value)


def compare(saved: TrainConfig, now: TrainConfig, fingerprints_saved: dict[str, str],
            fingerprints_now: dict[str, str]) -> list[ConfigChange]:
    """Every difference between the saved run and this one, marking those that break exactness."""
    changes = [ConfigChange(k, getattr(saved, k), getattr(now, k), True) for k in EXACTNESS_KEYS
               if getattr(saved, k) != getattr(now, k)]
    changes += [ConfigChange(k, getattr(saved, k), getattr(now, k), False) for k in FREE_KEYS
                if getattr(saved, k) != getattr(now, k)]
    changes += [ConfigChange(k, fingerprints_saved.get(k), fingerprints_now.get(k), True)
                for k in sorted(set(fingerprints_saved) | set(fingerprints_now))
                if fingerprints_saved.get(k) != fingerprints_now.get(k)]
    return changes
