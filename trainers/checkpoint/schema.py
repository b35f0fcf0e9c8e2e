"""The one definition of what a trainer checkpoint holds.

A checkpoint is a dict that `torch.load(weights_only=True)` reads (tensors, containers and
primitives only), made of sections, each the `state_dict()` of the component that owns it:

    format    "indextts2-gpt-trainer/3"
    model     the IndexTTS2 state dict, trained and carried tensors: upstream inference loads
              the file as it is (it takes the "model" key as the state dict)
    optim     AdamW state, the parameter names/shapes it covers, LR schedule, loss scaler, frozen rows
    data      where the data order stands: epoch, step and samples into it, the order's batch
    progress  optimizer steps done, samples seen, the metrics history, the open log interval's sums
    rng       process RNG states
    run       what defines the run: identity, settings, model config, fingerprints, vocabulary, versions,
              and its model family (trainers/families) unless it is the first, IndexTTS2 2.0
    hardware  how the last steps ran: machine, micro-batch, AMP dtype (informational)
    integrity checksums of everything above, written by `assemble` and checked by `parse`
              (trainers/checkpoint/integrity.py): a flipped byte or an edited field is refused

This module assembles and validates the sections and migrates older formats when reading;
no other code indexes a checkpoint's keys. Readers that are not a section's owner (resume
checks, tools, tests) use the typed accessors of `Checkpoint`.

Formats: 1 kept every field at the top level; 2 introduced the sections; 3 is 2 plus the
required integrity section. Files of formats 1 and 2 still load, marked as not verified.
4 is a LoRA run's checkpoint (run.config.lora_rank > 0): format 3 whose model section holds only
the tensors the run trains (adapters, an extended vocabulary's text rows), the base being named
by run.config.base_checkpoint and its sha256 in run.fingerprints.base_checkpoint_sha256. Full fine-tuning
still writes format 3, byte for byte as before; a trainer that reads only 1..3 refuses a format-4
file as newer instead of taking its partial model section for a whole model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from trainers.checkpoint import integrity
from trainers.config.settings import BASE_FINGERPRINT, TrainConfig, saved_settings
from trainers.torch_files import CheckpointError, load_checkpoint

FORMAT_PREFIX = "indextts2-gpt-trainer/"
VERSION = 3  # what a full fine-tuning run writes
LORA_VERSION = 4  # what a LoRA run writes: its model section holds only the trained tensors
LATEST_VERSION = LORA_VERSION
FIRST_VERIFIED_VERSION = 3  # formats before it carry no checksums
CHECKSUMS_VERIFIED = "checksums verified"
# The model family of a checkpoint whose run section names none: every checkpoint of an IndexTTS2 (2.0) run,
# those written before families existed included, so a 2.0 run's files are as they were (trainers/families).
FIRST_FAMILY = "indextts2"
FORMAT = f"{FORMAT_PREFIX}{VERSION}"
LORA_FORMAT = f"{FORMAT_PREFIX}{LORA_VERSION}"

_INT, _STR, _DICT, _LIST = (int,), (str,), (dict,), (list, tuple)
# Required fields of each section and their types; a section may hold more (newer minor fields).
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "optim": {"optimizer": _DICT, "param_shapes": _LIST, "lr_schedule": _DICT, "scaler": _DICT,
              "frozen_rows": (dict, type(None))},
    "data": {"epoch": _INT, "step_in_epoch": _INT, "samples_in_epoch": _INT, "order_batch": _INT, "order": _STR},
    "progress": {"step": _INT, "samples_seen": _INT, "history": _LIST},
    "rng": {"torch": (torch.Tensor,), "cuda": _LIST, "numpy": _DICT, "python": _LIST},
    "run": {"run_id": _STR, "config": _DICT, "model_config": _DICT, "fingerprints": _DICT, "vocab": _DICT,
            "versions": _DICT},
    "hardware": {"machine": _STR, "micro_batch": _INT, "amp_dtype": _STR, "tf32": (bool,)},
}
# Fields added to a section after its format was introduced: files written before lack them (their owner's
# load_state_dict says what it does instead); checked like the required ones where present.
_NUMBER = (float, int)
OPTIONAL_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "progress": {"interval": _DICT,  # the open log interval (trainers/training/train_log.py LogInterval)
                 "stale_validations": _INT,  # validations since the best (early stopping)
                 "forgetting": _DICT},  # base figures and the last validation's (trainers/training/forgetting.py)
    "data": {"replayed": _DICT},  # replay mixing: samples drawn from each replay manifest (trainers/data/mixing.py)
    "run": {"model_family": _STR},  # absent: FIRST_FAMILY
}
# Nested fields checked where their field is present.
NESTED_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "progress.interval": {"sums": _LIST, "steps": _INT, "seconds": _NUMBER, "lr": _NUMBER, "grad_norm": _NUMBER},
}
SECTIONS = ("model", *FIELDS)
# The order in which a resume loads the sections back into their owners (Checkpointer.restore): the model
# before the optimizer, whose frozen rows are the restored model's; the RNG after everything built before
# it. "run" is read, not loaded: the run's settings are decided from it before anything is built
# (trainers/run/resolve.py), and its owner (RunConfig) is immutable.
RESTORE_ORDER = ("model", "optim", "data", "progress", "rng", "hardware")


class SchemaError(CheckpointError):
    """A file that loads but is not a complete checkpoint of this trainer."""


class UnknownFormat(SchemaError):
    """A checkpoint of a format newer than this trainer reads: not damaged, so never replaced by an older one."""


class IntegrityError(SchemaError):
    """A checkpoint whose content differs from the checksums written with it: the file is corrupt."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(path, f"corrupt: its content does not match the checksums written with it "
                               f"({integrity.summary(self.problems)})")


def is_trainer_checkpoint(obj: object) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("format"), str) and obj["format"].startswith(FORMAT_PREFIX)


def assemble(sections: Mapping[str, Any]) -> dict[str, Any]:
    """The file contents for the components' state dicts, with their checksums; ValueError if one is malformed."""
    problems = _problems(sections)
    if problems:
        raise ValueError("checkpoint sections are malformed: " + "; ".join(problems))
    content = {"format": LORA_FORMAT if _is_lora(sections) else FORMAT, **{name: sections[name] for name in SECTIONS}}
    content[integrity.RECORD_KEY] = integrity.compute(content)
    return content


def parse(obj: Any, path: Path, verify: bool = True) -> "Checkpoint":
    """Validate a loaded file (migrating older formats) into a `Checkpoint`.

    With `verify`, a file of format 3 or later must match the checksums written with it
    (IntegrityError names each tensor or field that does not); formats 1 and 2 have none and load
    marked "not verified". Without it the checksums are not computed (metadata readers).
    """
    if not is_trainer_checkpoint(obj):
        found = obj.get("format") if isinstance(obj, dict) else None
        raise SchemaError(path, f"not a checkpoint written by this trainer (format {found!r}); to start from an "
                                "official gpt.pth use --base-checkpoint instead of --resume")
    version = obj["format"][len(FORMAT_PREFIX):]
    if version not in {str(v) for v in range(1, LATEST_VERSION + 1)}:
        raise UnknownFormat(path, f"written in checkpoint format {obj['format']!r}, which this version of the trainer "
                                  f"does not know (it reads formats 1..{LATEST_VERSION}); update the trainer")
    if int(version) < FIRST_VERIFIED_VERSION:
        checked = f"checksums not verified: written before checksums existed (format {version})"
    elif verify:
        found = integrity.problems(obj, obj.get(integrity.RECORD_KEY))
        if found:
            raise IntegrityError(path, found)
        checked = CHECKSUMS_VERIFIED
    else:
        checked = "checksums not checked"
    sections = _from_format_1(obj, path) if version == "1" else {name: obj.get(name) for name in SECTIONS}
    problems = _problems(sections)
    if not problems and (int(version) == LORA_VERSION) != _is_lora(sections):
        problems.append(f"format {version} with run.config.lora_rank {sections['run']['config'].get('lora_rank', 0)}")
    if not problems and _is_lora(sections) and not isinstance(sections["run"]["fingerprints"].get(BASE_FINGERPRINT),
                                                               str):
        problems.append(f"a LoRA checkpoint without run.fingerprints.{BASE_FINGERPRINT} (the sha256 of its base)")
    if problems:
        raise SchemaError(path, "incomplete or malformed checkpoint: " + "; ".join(problems))
    return Checkpoint(sections, path, int(version), checked)


def read(path: Path, mmap: bool = False, verify: bool | None = None) -> "Checkpoint":
    """Read and validate a checkpoint file, checking its checksums (see `parse`).

    `mmap` maps tensors instead of reading them, for readers that need only the metadata; they
    skip the checksums by default, since computing them reads every tensor.
    """
    return parse(load_checkpoint(path, mmap=mmap), Path(path), verify=not mmap if verify is None else verify)


def _problems(sections: Mapping[str, Any]) -> list[str]:
    problems = []
    model = sections.get("model")
    if not isinstance(model, dict) or not model or not all(isinstance(v, torch.Tensor) for v in model.values()):
        problems.append("'model' must be a non-empty dict of tensors")
    for name, spec in FIELDS.items():
        section = sections.get(name)
        if not isinstance(section, dict):
            problems.append(f"section {name!r} is missing")
            continue
        problems += _field_problems(name, section, spec, required=True)
        problems += _field_problems(name, section, OPTIONAL_FIELDS.get(name, {}), required=False)
    optimizer = (sections.get("optim") or {}).get("optimizer")
    if isinstance(optimizer, dict) and not {"state", "param_groups"} <= optimizer.keys():
        problems.append("optim.optimizer is not a torch optimizer state dict")
    return problems


def _is_lora(sections: Mapping[str, Any]) -> bool:
    run = sections.get("run")
    config = run.get("config") if isinstance(run, dict) else None
    return isinstance(config, dict) and bool(config.get("lora_rank"))


def _field_problems(where: str, values: dict[str, Any], spec: dict[str, tuple[type, ...]], required: bool) -> list[str]:
    problems = []
    for key, types in spec.items():
        if key not in values:
            if required:
                problems.append(f"{where}.{key} is missing")
        elif not isinstance(values[key], types) or (types in (_INT, _NUMBER) and isinstance(values[key], bool)):
            problems.append(f"{where}.{key} has type {type(values[key]).__name__}")
        elif f"{where}.{key}" in NESTED_FIELDS:
            problems += _field_problems(f"{where}.{key}", values[key], NESTED_FIELDS[f"{where}.{key}"], required=True)
    return problems


def _from_format_1(old: dict[str, Any], path: Path) -> dict[str, Any]:
    """Format 1 kept every field at the top level (trainer versions up to commit f6fecff)."""
    missing = [k for k in ("model", "optimizer", "step", "epoch", "step_in_epoch", "rng", "config") if k not in old]
    if missing:
        raise SchemaError(path, f"incomplete format-1 checkpoint: {', '.join(missing)} missing")
    config = dict(old["config"])  # as saved: readers complete it with saved_settings()
    completed = saved_settings(config)
    batch = TrainConfig.from_dict(completed).effective_batch
    text_rows = old["model"]["text_embedding.weight"].shape[0] if "text_embedding.weight" in old["model"] else 1
    vocab = dict(old.get("vocab") or {})
    vocab.setdefault("text_tokens", int(text_rows) - 1)
    vocab.setdefault("base_text_tokens", vocab["text_tokens"])
    schedule = old.get("scheduler") or {
        "kind": "warmup_cosine", "base_lr": config.get("learning_rate"), "warmup_steps": config.get("warmup_steps"),
        "decay_steps": config.get("lr_decay_steps"), "min_lr_ratio": config.get("min_lr_ratio", 0.0)}
    return {
        "model": old["model"],
        "optim": {"optimizer": old["optimizer"], "param_shapes": old.get("optimizer_params", []),
                  "lr_schedule": schedule, "scaler": old.get("scaler") or {},
                  "frozen_rows": {"base_tokens": vocab["base_text_tokens"]} if completed["freeze_base_vocab"] else None},
        "data": {"epoch": old["epoch"], "step_in_epoch": old["step_in_epoch"],
                 "samples_in_epoch": old.get("samples_in_epoch", old["step_in_epoch"] * batch),
                 "order_batch": batch, "order": "random"},
        "progress": {"step": old["step"], "samples_seen": old.get("samples_seen", 0),
                     "history": old.get("metrics", [])},
        "rng": old["rng"],
        # Format 1 had no run identity: "" matches no other run (see trainers/run/run_dir.py).
        "run": {"run_id": "", "config": config, "model_config": old.get("model_config", {}),
                "fingerprints": old.get("fingerprints", {}), "vocab": vocab, "versions": old.get("versions", {})},
        "hardware": {"machine": str(old.get("hardware") or "unknown"), "micro_batch": int(old.get("micro_batch") or 0),
                     "amp_dtype": str(old.get("amp_dtype")), "tf32": False},
    }


def _field(section: str, key: str, convert: Callable[[Any], Any] = lambda value: value) -> Any:
    """A read-only accessor of `Checkpoint`: `convert(sections[section][key])`."""
    return property(lambda self: convert(self.sections[section][key]))


def _optional_field(section: str, key: str) -> Any:
    """An accessor of a field that not every file holds: None where it is absent."""
    return property(lambda self: self.sections[section].get(key))


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint in the current format, with typed access for readers."""

    sections: Mapping[str, Any]
    path: Path | None = None
    format_version: int = VERSION
    # CHECKSUMS_VERIFIED, "checksums not checked" (read without verifying), or "checksums not verified: written
    # before checksums existed (format N)"
    integrity: str = "checksums not checked"

    @property
    def verified(self) -> bool:
        return self.integrity == CHECKSUMS_VERIFIED

    def section(self, name: str) -> Any:
        """A component's own state dict, for its load_state_dict()."""
        return self.sections[name]

    def to_file(self) -> dict[str, Any]:
        return assemble(self.sections)

    def edited(self, section: str, **values: Any) -> "Checkpoint":
        """A copy with fields of one section replaced (tests and benchmarks that craft checkpoints)."""
        changed = {**self.sections, section: {**self.sections[section], **values}}
        return parse(assemble(changed), self.path or Path("<edited>"), verify=False)

    # -- typed accessors: a section's field as a number (int) or a copy (dict, list) --
    @property
    def model(self) -> dict[str, torch.Tensor]:
        return self.sections["model"]

    optimizer = _field("optim", "optimizer")
    param_shapes = _field("optim", "param_shapes", lambda shapes: [list(x) for x in shapes])
    lr_schedule = _field("optim", "lr_schedule")
    step = _field("progress", "step", int)
    samples_seen = _field("progress", "samples_seen", int)
    history = _field("progress", "history", list)
    epoch = _field("data", "epoch", int)
    step_in_epoch = _field("data", "step_in_epoch", int)
    samples_in_epoch = _field("data", "samples_in_epoch", int)
    run_id = _field("run", "run_id")
    settings = _field("run", "config", dict)  # the run's saved TrainConfig fields (settings.saved_settings)
    model_config = _field("run", "model_config", dict)
    fingerprints = _field("run", "fingerprints", dict)
    text_tokens = _field("run", "vocab", lambda vocab: int(vocab["text_tokens"]))
    base_text_tokens = _field("run", "vocab", lambda vocab: int(vocab["base_text_tokens"]))
    versions = _field("run", "versions", dict)
    machine = _field("hardware", "machine")
    micro_batch = _field("hardware", "micro_batch", int)
    amp_dtype = _field("hardware", "amp_dtype")
    # Fields that files written before them lack: None there. The best validation when this was written:
    # {"metric", "value", "step"}; the forgetting measure's {"base", "last", "within_step"} (forgetting.py);
    # with replay mixing, the samples drawn from each replay manifest, by its --train-manifest place; the open
    # log interval's sums and step count.
    best = _optional_field("progress", "best")
    forgetting = _optional_field("progress", "forgetting")
    replayed = _optional_field("data", "replayed")
    open_log_interval = _optional_field("progress", "interval")

    @property
    def model_family(self) -> str:
        """The name of the run's model family (trainers/families); FIRST_FAMILY where the file names none."""
        return str(self.sections["run"].get("model_family", FIRST_FAMILY))

    @property
    def lora(self) -> dict[str, Any] | None:
        """A LoRA run's adapter settings and base ({rank, alpha, targets, dropout, base, base_sha256}); None: full."""
        if self.format_version != LORA_VERSION:
            return None
        config = self.sections["run"]["config"]
        return {"rank": config["lora_rank"], "alpha": config["lora_alpha"], "targets": list(config["lora_targets"]),
                "dropout": config["lora_dropout"], "base": config.get("base_checkpoint"),
                "base_sha256": self.fingerprints[BASE_FINGERPRINT]}
