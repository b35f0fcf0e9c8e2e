"""What an export holds (tools/export_checkpoint.py), read from the source and checked against IndexTTS2 inference.

The tensors of gpt.pth: exactly the keys and shapes upstream's UnifiedVoice loads, group A as the
config's gpt section shapes it (the model built on the meta device) and the conditioning encoders
carried from the base checkpoint (group B), cast to the export's dtype. The config.yaml: the run's
IndexTTS2 config, checked against the checkpoint, with this export's vocabulary and file names.
The tokenizer: the run's SentencePiece model, checked against the checkpoint's vocabulary.
Which model, groups, keys and tokenizer are those of the checkpoint's model family (trainers/families):
a trainer checkpoint names it, an official gpt.pth is taken for the family its config belongs to.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from trainers.checkpoint import schema
from trainers.config.config_yaml import read_config_yaml
from trainers.config.inference_keys import missing_inference_keys
from trainers.errors import UserError
from trainers.families import FAMILIES, ModelFamily, family_for_config, family_named
from trainers.files import file_sha256
from trainers.model.gpt_model import GPTConfig
from trainers.model.weights import split_state_dict, state_dict_of, strip_module_prefix
from trainers.checkpoint.recovery import described
from trainers.tools.export_output import RECORD_NAME
from trainers.tools.run_files import checkpoint_path, newest_intact_checkpoint
from trainers.torch_files import CheckpointError, load_checkpoint

GPT_NAME = "gpt.pth"
CONFIG_NAME = "config.yaml"
# GPTConfig fields that decide tensor shapes or token meanings; dropout does not, and the number of
# text tokens is the run's own (set from the checkpoint).
STRUCTURE_FIELDS = ("model_dim", "layers", "heads", "max_text_tokens", "max_mel_tokens", "number_mel_codes",
                    "start_text_token", "stop_text_token", "start_mel_token", "stop_mel_token")
MAX_LISTED = 12


# ---------------------------------------------------------------- what is exported

@dataclass
class Source:
    path: Path
    kind: str  # "trainer", "official" ({"model": sd}) or "raw" (a bare state dict)
    state: dict[str, torch.Tensor]
    checkpoint: schema.Checkpoint | None = None
    notes: list[str] = field(default_factory=list)  # damaged newer checkpoints passed over, said with the export

    def describe(self) -> str:
        if self.checkpoint is None:
            return f"{self.path} ({'official {model: state dict}' if self.kind == 'official' else 'raw state dict'})"
        c = self.checkpoint
        return f"{self.path} (trainer checkpoint, step {c.step}, run {c.run_id or 'unnamed'})"


def read_source(target: Path, which: str | None) -> Source:
    """What to export, verified against its checksums: a file as it is named, or the checkpoint of run directory
    `target` that `which` names, where "latest" (the default) is the one `--resume auto` would continue: the newest
    intact checkpoint, damaged newer ones passed over with a note."""
    if not (target.is_dir() and which in (None, "latest")):
        return load_source(checkpoint_path(target, which))
    found = newest_intact_checkpoint(target)
    notes = [f"{described(target, path)} is damaged ({why}): exported {found.path.name}, the newest intact checkpoint, "
             "which --resume auto would continue" for path, why in found.damaged]
    return Source(found.path, "trainer", dict(found.checkpoint.model), found.checkpoint, notes)


def load_source(path: Path) -> Source:
    """A trainer checkpoint (through the schema, its checksums verified) or an official gpt.pth; tensors are mapped,
    not read into memory (the checksums read each one once)."""
    try:
        return _load_source(path, mmap=True)
    except CheckpointError:
        pass  # files in torch's legacy (non-zip) format cannot be mapped; a corrupt one fails again below
    try:
        return _load_source(path, mmap=False)
    except CheckpointError as exc:
        raise UserError(f"{path}: {exc.reason}; pass a checkpoint written by the trainer or an official gpt.pth"
                        ) from None


def _load_source(path: Path, mmap: bool) -> Source:
    try:
        ckpt = schema.read(path, mmap=mmap, verify=True)
        return Source(path, "trainer", dict(ckpt.model), ckpt)
    except schema.IntegrityError as exc:
        raise UserError(f"{path}: {exc.reason}; nothing was exported. Export another checkpoint of the run (--which "
                        "STEP), or its run directory, whose newest intact checkpoint is then chosen") from None
    except schema.SchemaError as exc:
        obj = load_checkpoint(path, mmap=mmap)  # it loaded above; only its contents were not a trainer checkpoint
        if schema.is_trainer_checkpoint(obj):
            raise UserError(f"{path}: {exc.reason}") from None
    state = state_dict_of(obj)
    if state is None or "text_embedding.weight" not in strip_module_prefix(state)[0]:
        raise UserError(f"{path}: neither a checkpoint of this trainer nor an IndexTTS2 gpt.pth (no "
                        "text_embedding.weight state dict)")
    return Source(path, "official" if isinstance(obj.get("model"), dict) else "raw", state)


def expected_group_a(gpt: GPTConfig, family: ModelFamily = FAMILIES["indextts2"]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the training-path tensors for `gpt`, from the model built on the meta device."""
    return family.expected_keys(gpt)


def exported_state(state: Mapping[str, torch.Tensor], family: ModelFamily,
                   ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors of an exported gpt.pth, out of a state dict of `family` in the upstream layout (a "module." prefix
    dropped), in its order, and the names left out. The one definition of that key set, per model family (its
    `layout`), which the export and tools/merge_lora.py both write: the model's own tensors (group A, under the
    layout's model namespaces) and the tensors carried from the base (group B), what upstream's UnifiedVoice of that
    family loads strictly. Left out: what it does not expect (inference_model.*, gpt.wte.*, attention masks, 2.0's
    speaker encoders in a 2.5 file) and anything outside those names."""
    layout = family.layout
    trained, _, dropped = split_state_dict(state, layout)
    left_out = sorted(dropped + [k for k in trained if not k.startswith(layout.model_namespaces)])
    gone = set(left_out)
    return {k: v for k, v in strip_module_prefix(state)[0].items() if k not in gone}, left_out


@dataclass
class Selection:
    state: dict[str, torch.Tensor]
    trained: int
    carried: int
    left_out: list[str] = field(default_factory=list)


def select_tensors(state: Mapping[str, torch.Tensor], gpt: GPTConfig, source: Path,
                   family: ModelFamily = FAMILIES["indextts2"]) -> Selection:
    """Exactly the keys upstream's UnifiedVoice loads: group A as `gpt` shapes it, then the carried group B."""
    layout = family.layout
    kept, left_out = exported_state(state, family)
    carried = {k: v for k, v in kept.items() if k.startswith(layout.carried_prefixes)}
    trained = {k: v for k, v in kept.items() if k not in carried}
    expected = expected_group_a(gpt, family)
    problems = [f"missing: {k}" for k in expected if k not in trained]
    problems += [f"{k}: file {tuple(trained[k].shape)}, config {shape}" for k, shape in expected.items()
                 if k in trained and tuple(trained[k].shape) != shape]
    problems += [f"not in the model of the config: {k}" for k in trained if k not in expected]
    if problems:
        raise UserError("\n".join([f"{source} does not fit the gpt section of the config:", *listed(problems),
                                   "pass the --config the checkpoint was trained with"]))
    lacking = [p + "*" for p in layout.carried_prefixes if not any(k.startswith(p) for k in carried)]
    if lacking:
        raise UserError(f"{source} lacks the conditioning-encoder tensors {', '.join(lacking)}, which IndexTTS2 "
                        "inference loads strictly: export a checkpoint of a run started with --base-checkpoint "
                        "(the official gpt.pth), whose tensors the trainer carries into every checkpoint")
    selected = {k: trained[k] for k in expected}
    selected.update(carried)
    return Selection(selected, len(expected), len(carried), left_out)


def cast(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in `dtype`, integer buffers as they are; each tensor with a storage of its own size."""
    out = {}
    for key, t in state.items():
        if t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        elif not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)  # a view would save its whole storage
        out[key] = t
    return out


# ---------------------------------------------------------------- config and tokenizer

@dataclass
class Inference:
    config: dict[str, Any]
    config_source: Path
    tokenizer: Path
    gpt: GPTConfig
    notes: list[str]
    family: ModelFamily = FAMILIES["indextts2"]


def resolve_inference(source: Source, config_flag: Path | None, tokenizer_flag: Path | None) -> Inference:
    ckpt, notes = source.checkpoint, []
    if config_flag is not None:
        config_path = config_flag
    elif ckpt is not None:
        config_path = source.path.parent / CONFIG_NAME
        if not config_path.is_file():
            raise UserError(f"no {CONFIG_NAME} beside {source.path} (the trainer writes one into the run directory); "
                            "pass --config with the IndexTTS2 config the run was trained with (it was started with "
                            f"--config {ckpt.settings.get('config')})")
    else:
        raise UserError(f"{source.path} is an official gpt.pth, which records no config: pass --config with the "
                        "IndexTTS2 config.yaml that belongs to it")
    data = read_config_yaml(config_path, f"--config {config_path}" if config_flag is not None else str(config_path),
                            "pass --config with the IndexTTS2 config.yaml the checkpoint was trained with")
    family = family_named(ckpt.model_family, str(source.path)) if ckpt is not None else family_for_config(data)
    text_tokens = ckpt.text_tokens if ckpt is not None else \
        int(strip_module_prefix(source.state)[0]["text_embedding.weight"].shape[0]) - 1
    try:
        gpt = family.read_config(data["gpt"], number_text_tokens=text_tokens)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{config_path}: {exc}") from None
    saved = ckpt.model_config if ckpt is not None else {}
    differ = [f"{k} {data['gpt'].get(k, getattr(gpt, k))!r} (run: {saved[k]!r})" for k in STRUCTURE_FIELDS
              if k in saved and saved[k] != getattr(gpt, k)]
    if differ:
        raise UserError(f"{config_path} is not the config {source.path} was trained with: gpt " + ", ".join(differ)
                        + "; pass --config with the run's config")
    refuse_trimmed_config(data, config_path, config_flag is not None, source, family)
    configured = data["gpt"].get("number_text_tokens")
    if configured != text_tokens:
        notes.append(f"gpt.number_text_tokens set to {text_tokens} (the checkpoint's vocabulary; {config_path.name} "
                     f"had {configured})")
    tokenizer = resolve_tokenizer(source, data, config_path, tokenizer_flag, family)
    pieces = family.tokenizer.size(str(tokenizer))
    if pieces != text_tokens:
        raise UserError(f"{tokenizer} has {pieces} pieces but {source.path} has {text_tokens} text tokens: it is not "
                        "the tokenizer of this checkpoint; pass --tokenizer with the one it was trained with")
    if exported_tokenizer_name(tokenizer, family) in (GPT_NAME, CONFIG_NAME, RECORD_NAME):
        raise UserError(f"the tokenizer's file name {tokenizer.name} clashes with a file the export writes; "
                        "rename it (e.g. bpe.model) and pass --tokenizer")
    return Inference(data, config_path, tokenizer, gpt, notes, family)


def exported_tokenizer_name(tokenizer: Path, family: ModelFamily) -> str:
    """The tokenizer's name in the export: the name inference opens where it opens a fixed one (2.5), else its own."""
    return family.export_tokenizer_name or tokenizer.name


def refuse_trimmed_config(data: dict[str, Any], config_path: Path, flagged: bool, source: Source,
                          family: ModelFamily = FAMILIES["indextts2"]) -> None:
    """A config without every key the family's inference reads would export a config.yaml inference cannot load."""
    written = inference_config(data, 1, "bpe.model", family.tokenizer_config_key)  # as the export would write it
    missing = missing_inference_keys(written, family.inference_keys)
    if not missing:
        return
    if flagged:
        what = f"--config {config_path}"
    else:  # the run directory's copy of the config the run was started with
        started = source.checkpoint.settings.get("config") if source.checkpoint else None
        what = f"{config_path} (the trainer's copy of --config {started or 'the run was started with'})"
    name, key = family.inference_name, family.tokenizer_config_key
    came_with = " and bpe.model" if key == "dataset.bpe_model" else ""
    changed = "gpt.number_text_tokens, " + (f"{key} and gpt_checkpoint" if key else "gpt_checkpoint")
    raise UserError(f"{what} lacks keys that {name} inference reads: {', '.join(missing)}. It is a trimmed config "
                    "that holds only what the trainer reads (like this repository's checkpoints/config.yaml). Pass "
                    f"--config with the full config.yaml from your {name} checkpoints folder (the one that came "
                    f"with gpt.pth{came_with}): the export keeps all of it and changes only {changed} (nothing was "
                    "written)")


def resolve_tokenizer(source: Source, config: dict[str, Any], config_path: Path, flag: Path | None,
                      family: ModelFamily = FAMILIES["indextts2"]) -> Path:
    ckpt = source.checkpoint
    kind = family.tokenizer.kind
    if ckpt is None:  # an official gpt.pth: its tokenizer is where its inference finds it, beside the config
        key = family.tokenizer_config_key
        if key is None:
            path = flag or config_path.parent / str(family.export_tokenizer_name)
        else:
            section, name = key.split(".")
            named = (config.get(section) or {}).get(name)
            path = flag or (config_path.parent / named if named else None)
            if path is None:
                raise UserError(f"{config_path} names no {key}; pass --tokenizer with the {kind} of {source.path}")
        if not path.is_file():
            raise UserError(f"tokenizer {path} not found; pass --tokenizer with the {kind} of {source.path}")
        return path
    recorded = ckpt.settings.get("tokenizer")
    expected_sha = ckpt.fingerprints.get("tokenizer")
    path = flag or (Path(recorded) if recorded else None)
    if path is None or not path.is_file():
        what = f"the run's tokenizer {path} (recorded in {source.path}) is missing" if path else \
            f"{source.path} records no tokenizer"
        sha = f" (sha256 {expected_sha})" if expected_sha else ""
        raise UserError(f"{what}; pass --tokenizer PATH with the {kind} the run was trained with{sha}, "
                        "e.g. after copying it back or if the run directory moved")
    if expected_sha and file_sha256(path) != expected_sha:
        raise UserError(f"{path} is not the tokenizer the run was trained with (its sha256 differs from the one "
                        f"recorded in {source.path}, {expected_sha}); pass --tokenizer with the original file")
    return path


def inference_config(data: dict[str, Any], text_tokens: int, tokenizer_name: str,
                     tokenizer_key: str | None = "dataset.bpe_model") -> dict[str, Any]:
    """The config with this export's vocabulary and file names (the tokenizer's under `tokenizer_key`, the
    family's: None where inference opens a fixed name); every other key as it was."""
    out = dict(data)
    out["gpt"] = {**data["gpt"], "number_text_tokens": text_tokens}
    if tokenizer_key is not None:
        section, key = tokenizer_key.split(".")
        out[section] = {**(data.get(section) or {}), key: tokenizer_name}
    out["gpt_checkpoint"] = GPT_NAME
    return out


def listed(items: list[str]) -> list[str]:
    """`items`, the first MAX_LISTED of them and how many more if there are more."""
    if len(items) <= MAX_LISTED:
        return list(items)
    return [*items[:MAX_LISTED], f"... and {len(items) - MAX_LISTED} more"]
