"""Export a checkpoint for IndexTTS2 inference: gpt.pth in the upstream layout, its config.yaml and tokenizer.

    python tools/export_checkpoint.py runs/my_voice --out exports/my_voice [--which latest|best|STEP] [--dtype fp16]
    python tools/export_checkpoint.py runs/my_voice/model_step4000.pth --out exports/step4000
    python tools/export_checkpoint.py checkpoints/gpt.pth --config checkpoints/config.yaml --out exports/official

Writes into the --out directory:

    gpt.pth       {"model": state dict}: the trained tensors (group A) and the conditioning encoders
                  carried from the base checkpoint (group B), nothing else (no optimizer, no run state),
                  readable with torch.load(weights_only=True); --dtype casts the floating tensors
    config.yaml   the IndexTTS2 config the run was trained with, every section kept, with
                  gpt.number_text_tokens of this run, dataset.bpe_model naming the copied tokenizer
                  and gpt_checkpoint naming gpt.pth
    <tokenizer>   a copy of the run's SentencePiece model, under its own file name
    export.json   the record of this export: what was exported and the sha256 of every file written

The output directory rule: an export never replaces a file it did not write. A file of one of
those names may be replaced only if export.json (written by an earlier export into the same
directory) lists it with the sha256 it still has. Anything else there is left alone; files an
earlier export wrote and this one does not write again (a tokenizer of another name) are removed.

Every file is written under a temporary name, fsynced and renamed, and export.json lists both the
old and the new files while the renames happen, so a killed export leaves no half-written file and
the next export into the same directory is not refused.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # so the tool runs from any working directory
    sys.path.insert(0, str(REPO_ROOT))

from trainers.checkpoint import schema  # noqa: E402
from trainers.checkpoint.files import CheckpointError, load_checkpoint  # noqa: E402
from trainers.errors import UserError  # noqa: E402
from trainers.files import file_sha256, write_text_atomically  # noqa: E402
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT  # noqa: E402
from trainers.model.vocabulary import tokenizer_size  # noqa: E402
from trainers.model.weights import (  # noqa: E402
    CARRIED_PREFIXES, MODEL_NAMESPACES, split_state_dict, state_dict_of, strip_module_prefix,
)
from tools.run_files import BEST_NAME, newest_checkpoint, step_checkpoints  # noqa: E402

GPT_NAME = "gpt.pth"
CONFIG_NAME = "config.yaml"
RECORD_NAME = "export.json"
RECORD_FORMAT = "indextts2-gpt-export/1"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STEP = re.compile(r"^(0|[1-9][0-9]*)$")
# GPTConfig fields that decide tensor shapes or token meanings; dropout does not, and the number of
# text tokens is the run's own (set from the checkpoint).
STRUCTURE_FIELDS = ("model_dim", "layers", "heads", "max_text_tokens", "max_mel_tokens", "number_mel_codes",
                    "start_text_token", "stop_text_token", "start_mel_token", "stop_mel_token")
MAX_LISTED = 12


# ---------------------------------------------------------------- which file

def checkpoint_path(target: Path, which: str | None) -> Path:
    """The checkpoint to export: `target` itself if it is a file, else the one `which` names in the run directory."""
    if target.is_file():
        if which is not None:
            raise UserError(f"--which {which} applies to a run directory; {target} is a file, which is exported "
                            "as it is")
        return target
    if not target.is_dir():
        raise UserError(f"{target}: no such run directory or checkpoint file")
    which = which or "latest"
    if which == "latest":
        found = newest_checkpoint(target)
        if found is None:
            raise UserError(f"{target} holds no checkpoint (no latest.pth or model_step*.pth); is it a run directory "
                            "of this trainer, and has the run saved its first checkpoint?")
        return found
    if which == "best":
        best = target / BEST_NAME
        if not best.is_file():
            raise UserError(f"{target} has no {BEST_NAME}: runs written before the trainer kept the best checkpoint "
                            "do not have one; export --which latest or --which STEP (a model_step{STEP}.pth) instead")
        return best
    if not STEP.match(which):
        raise UserError(f"--which {which!r}: expected latest, best or a step number such as 4000")
    steps = step_checkpoints(target)
    if int(which) not in steps:
        have = ", ".join(str(s) for s in sorted(steps)) or "none"
        raise UserError(f"{target} has no model_step{which}.pth (steps kept: {have}; older ones were deleted as "
                        "--keep-checkpoints allows)")
    return steps[int(which)]


# ---------------------------------------------------------------- what is exported

@dataclass
class Source:
    path: Path
    kind: str  # "trainer", "official" ({"model": sd}) or "raw" (a bare state dict)
    state: dict[str, torch.Tensor]
    checkpoint: schema.Checkpoint | None = None

    def describe(self) -> str:
        if self.checkpoint is None:
            return f"{self.path} ({'official {model: state dict}' if self.kind == 'official' else 'raw state dict'})"
        c = self.checkpoint
        return f"{self.path} (trainer checkpoint, step {c.step}, run {c.run_id or 'unnamed'})"


def load_source(path: Path) -> Source:
    """A trainer checkpoint (through the schema) or an official gpt.pth; tensors are mapped, not read."""
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
        ckpt = schema.read(path, mmap=mmap)
        return Source(path, "trainer", dict(ckpt.model), ckpt)
    except schema.SchemaError as exc:
        obj = load_checkpoint(path, mmap=mmap)  # it loaded above; only its contents were not a trainer checkpoint
        if schema.is_trainer_checkpoint(obj):
            raise UserError(f"{path}: {exc.reason}") from None
    state = state_dict_of(obj)
    if state is None or "text_embedding.weight" not in strip_module_prefix(state)[0]:
        raise UserError(f"{path}: neither a checkpoint of this trainer nor an IndexTTS2 gpt.pth (no "
                        "text_embedding.weight state dict)")
    return Source(path, "official" if isinstance(obj.get("model"), dict) else "raw", state)


def expected_group_a(gpt: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the training-path tensors for `gpt`, from the model built on the meta device."""
    with torch.device("meta"):
        model = UnifiedVoiceGPT(gpt)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@dataclass
class Selection:
    state: dict[str, torch.Tensor]
    trained: int
    carried: int
    left_out: list[str] = field(default_factory=list)


def select_tensors(state: Mapping[str, torch.Tensor], gpt: GPTConfig, source: Path) -> Selection:
    """Exactly the keys upstream's UnifiedVoice loads: group A as `gpt` shapes it, then the carried group B."""
    trained, carried, dropped = split_state_dict(state)
    expected = expected_group_a(gpt)
    problems = [f"missing: {k}" for k in expected if k not in trained]
    problems += [f"{k}: file {tuple(trained[k].shape)}, config {shape}" for k, shape in expected.items()
                 if k in trained and tuple(trained[k].shape) != shape]
    problems += [f"not in the model of the config: {k}" for k in trained
                 if k not in expected and k.startswith(MODEL_NAMESPACES)]
    if problems:
        raise UserError("\n".join([f"{source} does not fit the gpt section of the config:", *_listed(problems),
                                   "pass the --config the checkpoint was trained with"]))
    lacking = [p + "*" for p in CARRIED_PREFIXES if not any(k.startswith(p) for k in carried)]
    if lacking:
        raise UserError(f"{source} lacks the conditioning-encoder tensors {', '.join(lacking)}, which IndexTTS2 "
                        "inference loads strictly: export a checkpoint of a run started with --base-checkpoint "
                        "(the official gpt.pth), whose tensors the trainer carries into every checkpoint")
    unknown = [k for k in trained if k not in expected]  # outside the model's namespaces and group B
    selected = {k: trained[k] for k in expected}
    selected.update(carried)
    return Selection(selected, len(expected), len(carried), sorted(dropped + unknown))


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


def read_yaml(path: Path, hint: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: file not found; {hint}") from None
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpt"), dict):
        raise UserError(f"{path}: no 'gpt' section; pass the IndexTTS2 config.yaml the checkpoint was trained with")
    return data


def text_tokens_of(source: Source) -> int:
    if source.checkpoint is not None:
        return source.checkpoint.text_tokens
    return int(strip_module_prefix(source.state)[0]["text_embedding.weight"].shape[0]) - 1


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
    data = read_yaml(config_path, "pass --config with the IndexTTS2 config the checkpoint was trained with")
    text_tokens = text_tokens_of(source)
    try:
        gpt = GPTConfig.from_yaml_section(data["gpt"], number_text_tokens=text_tokens)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{config_path}: {exc}") from None
    saved = ckpt.model_config if ckpt is not None else {}
    differ = [f"{k} {data['gpt'].get(k, getattr(gpt, k))!r} (run: {saved[k]!r})" for k in STRUCTURE_FIELDS
              if k in saved and saved[k] != getattr(gpt, k)]
    if differ:
        raise UserError(f"{config_path} is not the config {source.path} was trained with: gpt " + ", ".join(differ)
                        + "; pass --config with the run's config")
    configured = data["gpt"].get("number_text_tokens")
    if configured != text_tokens:
        notes.append(f"gpt.number_text_tokens set to {text_tokens} (the checkpoint's vocabulary; {config_path.name} "
                     f"had {configured})")
    tokenizer = resolve_tokenizer(source, data, config_path, tokenizer_flag)
    pieces = tokenizer_size(str(tokenizer))
    if pieces != text_tokens:
        raise UserError(f"{tokenizer} has {pieces} pieces but {source.path} has {text_tokens} text tokens: it is not "
                        "the tokenizer of this checkpoint; pass --tokenizer with the one it was trained with")
    if tokenizer.name in (GPT_NAME, CONFIG_NAME, RECORD_NAME):
        raise UserError(f"the tokenizer's file name {tokenizer.name} clashes with a file the export writes; "
                        "rename it (e.g. bpe.model) and pass --tokenizer")
    return Inference(data, config_path, tokenizer, gpt, notes)


def resolve_tokenizer(source: Source, config: dict[str, Any], config_path: Path, flag: Path | None) -> Path:
    ckpt = source.checkpoint
    if ckpt is None:
        bpe = (config.get("dataset") or {}).get("bpe_model")
        path = flag or (config_path.parent / bpe if bpe else None)
        if path is None:
            raise UserError(f"{config_path} names no dataset.bpe_model; pass --tokenizer with the SentencePiece model "
                            f"of {source.path}")
        if not path.is_file():
            raise UserError(f"tokenizer {path} not found; pass --tokenizer with the SentencePiece model of "
                            f"{source.path}")
        return path
    recorded = ckpt.settings.get("tokenizer")
    expected_sha = ckpt.fingerprints.get("tokenizer")
    path = flag or (Path(recorded) if recorded else None)
    if path is None or not path.is_file():
        what = f"the run's tokenizer {path} (recorded in {source.path}) is missing" if path else \
            f"{source.path} records no tokenizer"
        sha = f" (sha256 {expected_sha})" if expected_sha else ""
        raise UserError(f"{what}; pass --tokenizer PATH with the SentencePiece model the run was trained with{sha}, "
                        "e.g. after copying it back or if the run directory moved")
    if expected_sha and file_sha256(path) != expected_sha:
        raise UserError(f"{path} is not the tokenizer the run was trained with (its sha256 differs from the one "
                        f"recorded in {source.path}, {expected_sha}); pass --tokenizer with the original file")
    return path


def inference_config(data: dict[str, Any], text_tokens: int, tokenizer_name: str) -> dict[str, Any]:
    """The config with this export's vocabulary and file names; every other key as it was."""
    out = dict(data)
    out["gpt"] = {**data["gpt"], "number_text_tokens": text_tokens}
    out["dataset"] = {**(data.get("dataset") or {}), "bpe_model": tokenizer_name}
    out["gpt_checkpoint"] = GPT_NAME
    return out


# ---------------------------------------------------------------- the output directory

@dataclass
class Record:
    """export.json of an earlier export: for each file it wrote, the sha256 it may have."""

    files: dict[str, set[str]]
    hashes: dict[Path, str] = field(default_factory=dict)  # of the files checked, so each is read once

    @classmethod
    def read(cls, out: Path) -> "Record | None":
        path = out / RECORD_NAME
        if not path.exists() and not path.is_symlink():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data["format"] != RECORD_FORMAT:
                raise ValueError(data["format"])
            entries = [*data["files"].items(), *data.get("pending", {}).items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            entries = None
        if entries is None or not all(isinstance(v, str) and _plain_name(k) for k, v in entries):
            raise UserError(f"{path} is not a record written by this tool; choose another --out directory (an "
                            "export never replaces files it did not write)")
        files: dict[str, set[str]] = {}
        for name, sha in entries:
            files.setdefault(name, set()).add(sha)
        return cls(files)

    def wrote(self, name: str, path: Path) -> str | None:
        """The sha256 of `path` if it is a file an export wrote under `name`, unchanged since; else None."""
        if name not in self.files or not path.is_file() or path.is_symlink():
            return None
        if path not in self.hashes:
            self.hashes[path] = file_sha256(path)
        return self.hashes[path] if self.hashes[path] in self.files[name] else None


def _plain_name(name: str) -> bool:
    return isinstance(name, str) and name == Path(name).name and not name.startswith(".")


def check_output(out: Path, names: list[str]) -> Record | None:
    """Refuse unless every file the export writes is new or was written, unchanged, by an earlier export."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory (it is created if missing)")
    if not out.is_dir():
        return None
    record = Record.read(out)
    foreign = [n for n in names if (out / n).exists() or (out / n).is_symlink()]
    foreign = [n for n in foreign if record is None or record.wrote(n, out / n) is None]
    if foreign:
        raise UserError(f"--out {out} already holds {', '.join(foreign)}, which this tool did not write (or which "
                        f"changed since; {RECORD_NAME} records what an export wrote): nothing was written. Choose an "
                        "empty or new directory, or move those files away")
    return record


def _temporary(out: Path, name: str) -> Path:
    return out / f".{name}.tmp-{os.getpid()}"


def _remove_temporaries(out: Path, names: list[str]) -> None:
    """Temporaries of a killed export into this directory."""
    pattern = re.compile(r"^\.(" + "|".join(re.escape(n) for n in names) + r")\.tmp-[0-9]+$")
    for entry in out.iterdir():
        if pattern.match(entry.name) and (entry.is_file() or entry.is_symlink()):
            entry.unlink(missing_ok=True)


def _write_temporary(out: Path, name: str, write: Callable[[Any], None]) -> tuple[Path, str]:
    tmp = _temporary(out, name)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, file_sha256(tmp)


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:
            pass  # some filesystems refuse; the renames are still atomic
        finally:
            os.close(fd)


def write_export(out: Path, files: dict[str, Callable[[Any], None]], record: Record | None,
                 info: dict[str, Any]) -> dict[str, str]:
    """Write `files` (name -> writer of its bytes) into `out` atomically; returns their sha256."""
    out.mkdir(parents=True, exist_ok=True)
    previous = record.files if record else {}
    _remove_temporaries(out, [*files, *previous])
    temps: dict[str, tuple[Path, str]] = {}
    try:
        for name, write in files.items():
            temps[name] = _write_temporary(out, name, write)
    except BaseException:
        for tmp, _ in temps.values():
            tmp.unlink(missing_ok=True)
        raise
    new = {name: sha for name, (_, sha) in temps.items()}
    # Files an earlier export wrote that are still as it wrote them: replaced below, or removed
    # if this export does not write them again (a tokenizer of another name).
    kept = {name: sha for name in previous if record and (sha := record.wrote(name, out / name))}
    # While files are renamed the record accepts the old and the new bytes, so a kill here leaves
    # a directory the next export may still replace.
    _write_record(out, info, kept, pending=new)
    for name, (tmp, _) in temps.items():
        os.replace(tmp, out / name)
    _fsync_dir(out)
    for name in kept:
        if name not in files:
            (out / name).unlink(missing_ok=True)
    _write_record(out, info, new)
    return new


def _write_record(out: Path, info: dict[str, Any], files: dict[str, str], pending: dict[str, str] | None = None
                  ) -> None:
    data = {"format": RECORD_FORMAT, **info, "files": files}
    if pending is not None:
        data["pending"] = pending
    write_text_atomically(out / RECORD_NAME, json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------- the export

@dataclass
class Export:
    source: Source
    out: Path
    dtype: str
    selection: Selection
    inference: Inference
    text_tokens: int
    files: dict[str, str]

    def lines(self) -> list[str]:
        sel, inf, out = self.selection, self.inference, self.out
        tok = inf.tokenizer.name
        values = sum(t.numel() for t in sel.state.values())
        lines = [f"exported {self.source.describe()} as {self.dtype} to {out}",
                 f"  {GPT_NAME}: {len(sel.state)} tensors ({sel.trained} trained, {sel.carried} carried), "
                 f"{values:,} values",
                 f"  {CONFIG_NAME}: from {inf.config_source}; gpt.number_text_tokens {self.text_tokens}, "
                 f"dataset.bpe_model {tok}, gpt_checkpoint {GPT_NAME}",
                 f"  {tok}: copy of {inf.tokenizer} ({self.text_tokens} pieces)"]
        lines += [f"note: {n}" for n in inf.notes]
        if sel.left_out:
            lines.append(f"left out (upstream's UnifiedVoice does not load them): {', '.join(_listed(sel.left_out))}")
        lines += ["point IndexTTS2 inference at:",
                  f"  config     {out / CONFIG_NAME}",
                  f"  gpt        {out / GPT_NAME}",
                  f"  tokenizer  {out / tok}",
                  "config.yaml names the other two by file name, like the official one: keep the three together, "
                  "with the other model files inference needs (s2mel, ...) from your IndexTTS2 checkpoints folder "
                  "beside them"]
        return lines


def export(target: Path, out: Path, which: str | None = None, dtype: str = "fp32", config: Path | None = None,
           tokenizer: Path | None = None) -> Export:
    path = checkpoint_path(target, which)
    source = load_source(path)
    inference = resolve_inference(source, config, tokenizer)
    selection = select_tensors(source.state, inference.gpt, path)
    tok_name = inference.tokenizer.name
    record = check_output(out, [GPT_NAME, CONFIG_NAME, tok_name])
    state = cast(selection.state, DTYPES[dtype])
    text_tokens = inference.gpt.number_text_tokens
    config_text = yaml.safe_dump(inference_config(inference.config, text_tokens, tok_name), sort_keys=False)
    tokenizer_bytes = inference.tokenizer.read_bytes()
    ckpt = source.checkpoint
    info = {"source": str(path.resolve()), "kind": source.kind, "step": ckpt.step if ckpt else None,
            "run_id": ckpt.run_id if ckpt else None, "dtype": dtype, "text_tokens": text_tokens}
    try:
        files = write_export(out, {
            GPT_NAME: lambda f: torch.save({"model": state}, f),
            CONFIG_NAME: lambda f: f.write(config_text.encode("utf-8")),
            tok_name: lambda f: f.write(tokenizer_bytes),
        }, record, info)
    except OSError as exc:
        raise UserError(f"could not write into --out {out}: {exc.strerror or exc}; no file there is half-written"
                        ) from None
    return Export(source, out, dtype, selection, inference, text_tokens, files)


def _listed(items: list[str]) -> list[str]:
    if len(items) <= MAX_LISTED:
        return list(items)
    return [*items[:MAX_LISTED], f"... and {len(items) - MAX_LISTED} more"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Export a checkpoint for IndexTTS2 inference: gpt.pth in the "
                                                 "upstream layout, config.yaml and the tokenizer, into --out.")
    parser.add_argument("source", type=Path, help="run directory, a trainer checkpoint (.pth) or an official gpt.pth")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument("--which", help="for a run directory: latest (default), best, or a step number")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of the floating tensors (integer buffers are kept); default fp32")
    parser.add_argument("--config", type=Path, help="IndexTTS2 config.yaml (default: the run directory's "
                                                    "config.yaml; required for an official gpt.pth)")
    parser.add_argument("--tokenizer", type=Path, help="SentencePiece model (default: the one the run recorded; for "
                                                       "an official gpt.pth the config's dataset.bpe_model)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = export(args.source, args.out, args.which, args.dtype, args.config, args.tokenizer)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        print("\n".join(result.lines()))
    except BrokenPipeError:  # output piped into a reader that stopped (e.g. head); the export is done
        sys.stdout = open(os.devnull, "w")
    return 0


if __name__ == "__main__":
    sys.exit(main())
