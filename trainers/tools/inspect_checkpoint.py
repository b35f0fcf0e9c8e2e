"""Describe a GPT checkpoint and, given its base gpt.pth, how far the base-vocabulary rows drifted.

    python tools/inspect_checkpoint.py runs/x [--which latest|best|STEP] [--base checkpoints/gpt.pth] [--json]
    python tools/inspect_checkpoint.py runs/x/model_step4000.pth --verify [--json]

A run directory is read as tools/export_checkpoint.py reads it (run_files.checkpoint_path):
its newest complete checkpoint, or the one --which names.

Use it before resuming an old run: if the base rows of text_embedding/text_head differ from
the base checkpoint, that run was not trained with frozen base vocabulary rows.

A trainer checkpoint is described only if it matches the checksums written with it. --verify
checks just that and says ok, corrupt (which tensor or field, or why the file cannot be read) or
not verifiable (files of checkpoint formats 1 and 2 and official gpt.pth files carry no checksums);
exit status 0 for ok and not verifiable, 1 for corrupt, 2 if the file is missing.

The comparison with the base is in base_drift.py, --verify in verify_checkpoint.py (beside this file).
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from trainers.checkpoint import schema
from trainers.config.settings import saved_settings
from trainers.errors import UserError
from trainers.families import FAMILIES
from trainers.model.weights import state_dict_of, strip_module_prefix
from trainers.tools import tool_main
from trainers.tools.base_drift import LoadedFile, compare_with_base
from trainers.tools.run_files import WHICH_HELP, checkpoint_path
from trainers.tools.verify_checkpoint import render_verify, verify
from trainers.torch_files import CheckpointError, load_checkpoint

LAYER_KEY = re.compile(r"^gpt\.h\.(\d+)\.")
# The hardware section's amp_dtype (str of a torch dtype) as --amp's documentation names it.
AMP_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16 with loss scaling", "None": "off"}


# ---------------------------------------------------------------- loading

def load_file(path: Path, label: str) -> LoadedFile:
    """Read a trainer checkpoint, an official {"model": sd} file or a raw state dict."""
    try:
        obj = load_checkpoint(path)
        ckpt = schema.parse(obj, path) if schema.is_trainer_checkpoint(obj) else None
    except CheckpointError as exc:
        raise UserError(f"{label} {path}: {exc.reason}; pass an intact checkpoint (e.g. an older model_step*.pth)"
                        ) from None
    if ckpt is not None:
        kind, state = "trainer", ckpt.model
    else:
        kind = "official" if isinstance(obj.get("model"), dict) else "raw"
        state = state_dict_of(obj)
    if state is None:
        raise UserError(f"{label} {path}: not a state dict (expected tensors, or a dict with a 'model' "
                        "state dict); pass a gpt.pth or a checkpoint written by the trainer")
    state, stripped = strip_module_prefix(state)
    if "text_embedding.weight" not in state and not (ckpt and ckpt.lora):  # LoRA: the rows may be the base's
        raise UserError(f"{label} {path}: no text_embedding.weight; is this an IndexTTS2 GPT checkpoint?")
    return LoadedFile(path, kind, state, ckpt, stripped)


# ---------------------------------------------------------------- description

def model_family(ck: LoadedFile) -> str | None:
    """The model family (trainers/families): a trainer checkpoint names it; an official file's keys tell it."""
    if ck.checkpoint is not None:
        return ck.checkpoint.model_family
    return next((f.name for f in FAMILIES.values() if f.holds_state(ck.state)), None)


def describe(ck: LoadedFile) -> dict[str, Any]:
    """Facts about one file (the JSON object without the comparison part)."""
    c = ck.checkpoint
    model_cfg = c.model_config if c else {}
    rows, dim = ck.state["text_embedding.weight"].shape[:2] if "text_embedding.weight" in ck.state else \
        (c.text_tokens + 1, model_cfg.get("model_dim", 0))
    return {
        "file": str(ck.path),
        "kind": ck.kind,
        "format": f"{schema.FORMAT_PREFIX}{c.format_version}" if c else None,
        "module_prefix_stripped": ck.stripped_prefix,
        "step": c.step if c else None,
        "epoch": c.epoch if c else None,
        "step_in_epoch": c.step_in_epoch if c else None,
        "samples_seen": c.samples_seen if c else None,
        "config": summarize_config(c.settings) if c else None,
        "vocab": {
            "text_tokens": c.text_tokens if c else int(rows) - 1,
            "base_text_tokens": c.base_text_tokens if c else None,
            "new_text_tokens": c.text_tokens - c.base_text_tokens if c else None,
            "rows": int(rows),
        },
        "tokenizer_sha256": c.fingerprints.get("tokenizer") if c else None,
        "model": {
            "family": model_family(ck),
            "layers": model_cfg.get("layers", count_layers(ck.state)),
            "dim": model_cfg.get("model_dim", int(dim)),
            "heads": model_cfg.get("heads"),
        },
        "tensors": len(ck.state),
        "parameters": sum(t.numel() for t in ck.state.values()),
        "amp_dtype": c.amp_dtype if c else None,
        "mixed_precision": mixed_precision(c.amp_dtype, saved_settings(c.settings).get("amp")) if c else None,
        "micro_batch": (c.micro_batch or None) if c else None,
        "hardware": c.machine if c and c.machine != "unknown" else None,
        "last_validation": last_validation(c.history) if c else None,
        "starts": [{k: e.get(k) for k in ("kind", "step", "time", "machine", "checkpoint", "changes")}
                   for e in c.history if isinstance(e, dict) and e.get("kind") in ("start", "resume")] if c else [],
        "integrity": c.integrity if c else "no checksums (not a trainer checkpoint)",
        "lora": c.lora if c else None,  # a LoRA run's adapter settings and base (None: full fine-tuning)
        "text_rows_saved": "text_embedding.weight" in ck.state,  # False: a LoRA checkpoint on its base's rows
        "versions": (c.versions or None) if c else None,
    }


def summarize_config(saved: dict[str, Any]) -> dict[str, Any]:
    cfg = saved_settings(saved)  # older files did not store every derived value
    keys = ("effective_batch", "batch_size", "grad_accumulation", "learning_rate", "weight_decay", "seed",
            "freeze_base_vocab", "max_steps", "epochs", "amp", "tokenizer", "base_checkpoint")
    summary = {k: cfg.get(k) for k in keys}
    summary["freeze_base_vocab_recorded"] = "freeze_base_vocab" in saved
    return summary


def mixed_precision(amp_dtype: str, requested: str | None) -> str:
    """What the run computed in when it wrote the checkpoint, and why where --amp asked for more.

    `requested` is the saved --amp mode (saved_settings() turns the old on/off switch into auto/off)."""
    used = AMP_NAMES.get(amp_dtype, amp_dtype)
    if used == "off" and requested == "auto":
        return "off (--amp auto: fp32 on the CPU)"
    return used


def count_layers(state: dict[str, torch.Tensor]) -> int | None:
    return len({int(m.group(1)) for k in state if (m := LAYER_KEY.match(k))}) or None


def last_validation(metrics: list[Any]) -> dict[str, Any] | None:
    """The newest validation entry, keys named val_*; the trainer logs {"kind": "val", ...}."""
    for entry in reversed(metrics):
        if not isinstance(entry, dict):
            continue
        if entry.get("kind") == "val":
            values = {f"val_{k}": v for k, v in entry.items() if k not in ("kind", "step", "epoch")}
        else:
            values = {k: v for k, v in entry.items() if k.startswith("val_")}
        if values:
            return {"step": entry.get("step"), **values}
    return None


# ---------------------------------------------------------------- text output

def render_text(facts: dict[str, Any]) -> list[str]:
    lines = [file_line(facts)]
    if facts["kind"] == "trainer":
        lines += trainer_lines(facts)
    lines += vocab_lines(facts)
    if facts.get("drift") is not None:
        lines += drift_lines(facts)
    elif not facts["text_rows_saved"]:
        lines.append("drift: none possible (a LoRA checkpoint that trains no text rows: its rows are its base's)")
    else:
        hint = (facts.get("config") or {}).get("base_checkpoint") or "checkpoints/gpt.pth"
        lines.append(f"drift: not checked (pass --base {hint} to compare the base vocabulary rows)")
    return lines


def file_line(facts: dict[str, Any]) -> str:
    kind = {"trainer": f"trainer checkpoint, format {facts['format']}",
            "official": "official checkpoint, {'model': state dict}",
            "raw": "raw state dict"}[facts["kind"]]
    if facts["module_prefix_stripped"]:
        kind += "; 'module.' key prefix stripped"
    return f"file: {facts['file']} ({kind})"


def split_text(cfg: dict[str, Any], facts: dict[str, Any]) -> str:
    """How the effective batch was split: as written (newer files) and as requested (0 = auto)."""
    requested = " x ".join("auto" if not v else str(v) for v in (cfg["batch_size"], cfg["grad_accumulation"]))
    micro, effective = facts.get("micro_batch"), cfg["effective_batch"]
    if not micro or not effective:
        return f"micro-batch {requested}"
    where = f" on {facts['hardware']}" if facts.get("hardware") else ""
    return f"written at micro-batch {micro} x {math.ceil(effective / micro)}{where}; requested {requested}"


def trainer_lines(facts: dict[str, Any]) -> list[str]:
    lines = [f"step: {show(facts['step'])} (epoch {show(facts['epoch'])}, step {show(facts['step_in_epoch'])} "
             f"of that epoch; {show(facts['samples_seen'])} samples seen)"]
    cfg = facts["config"]
    if cfg is not None:
        freeze = show(cfg["freeze_base_vocab"]) if cfg["freeze_base_vocab_recorded"] else "unknown (not recorded)"
        lines.append(f"config: effective batch {show(cfg['effective_batch'])} ({split_text(cfg, facts)}), "
                     f"lr {show(cfg['learning_rate'])}, "
                     f"weight decay {show(cfg['weight_decay'])}, seed {show(cfg['seed'])}, freeze_base_vocab {freeze}")
        lines.append(f"length: epochs {show(cfg['epochs'])}, max_steps {show(cfg['max_steps'])}; "
                     f"amp {facts['mixed_precision']}")
        lines.append(f"files: base_checkpoint {show(cfg['base_checkpoint'])}, tokenizer {show(cfg['tokenizer'])}")
    lines.append(f"integrity: {facts['integrity']}")
    lines.append(lora_line(facts["lora"]))
    return lines


def lora_line(lora: dict[str, Any] | None) -> str:
    if lora is None:
        return "lora: none (full fine-tuning: the checkpoint holds the whole model)"
    return (f"lora: rank {lora['rank']}, alpha {show(lora['alpha'])} (scale {show(lora['alpha'] / lora['rank'])}), "
            f"targets {','.join(lora['targets'])}, adapter dropout {show(lora['dropout'])}; the checkpoint holds the "
            f"adapters and trained rows only, on base {lora['base']} (sha256 {lora['base_sha256'][:16]}...)")


def vocab_lines(facts: dict[str, Any]) -> list[str]:
    v, m = facts["vocab"], facts["model"]
    base = f" (base {v['base_text_tokens']}, {v['new_text_tokens']} new)" if v["base_text_tokens"] is not None else ""
    lines = [f"vocabulary: {v['text_tokens']} text tokens{base}; text_embedding rows {v['rows']}"]
    if facts["tokenizer_sha256"]:
        lines.append(f"tokenizer sha256: {facts['tokenizer_sha256']}")
    heads = f", {m['heads']} heads" if m["heads"] is not None else ""
    family = FAMILIES.get(m["family"] or "")
    named = f"{family.title}, " if family is not None and family is not next(iter(FAMILIES.values())) else ""
    lines.append(f"model: {named}{show(m['layers'])} layers, dim {m['dim']}{heads}")
    lines.append(f"tensors: {facts['tensors']} ({facts['parameters']:,} values)")
    if facts["last_validation"]:
        val = dict(facts["last_validation"])
        step = val.pop("step")
        lines.append(f"last validation: step {show(step)} " + " ".join(f"{k} {show(x)}" for k, x in val.items()))
    for start in facts["starts"]:  # the run's start and every resume, with what changed
        where = f" from {start['checkpoint']}" if start["checkpoint"] else ""
        changed = "; ".join(start["changes"] or []) or "nothing changed"
        lines.append(f"{start['kind']}: step {show(start['step'])} at {start['time']} on {start['machine']}{where}: "
                     f"{changed}")
    if facts["versions"]:
        lines.append("versions: " + ", ".join(f"{k} {x}" for k, x in facts["versions"].items()))
    return lines


def drift_lines(facts: dict[str, Any]) -> list[str]:
    lines = [f"base: {facts['base']} ({facts['base_text_tokens_in_base_file']} text tokens)"]
    lines += [f"note: {n}" for n in facts["notes"]]
    for key, d in facts["drift"].items():
        if "skipped" in d:
            lines.append(f"drift {key}: skipped ({d['skipped']})")
            continue
        lines.append(f"drift {key}: base rows max |diff| {d['max_abs_diff']:.3e}, "
                     f"{d['rows_changed']} of {d['rows_compared']} rows changed")
        if d["new_rows"]:
            lines.append(f"new rows {key}: {d['new_rows']}, mean |value| {d['new_rows_mean_abs']:.3e}")
    lines.append(other_line(facts["other_tensors"]))
    lines.append(verdict_line(facts))
    return lines


def other_line(o: dict[str, Any]) -> str:
    largest = (f", largest relative change {o['largest_relative_change']:.3e} ({o['largest_relative_change_key']})"
               if o["largest_relative_change_key"] else "")
    return (f"other tensors: {o['differ']} of {o['compared']} differ from base{largest}; "
            f"{o['only_in_checkpoint']} only in checkpoint, {o['only_in_base']} only in base, "
            f"{o['shape_mismatches']} shape mismatches")


def verdict_line(facts: dict[str, Any]) -> str:
    base = facts["base"]
    if facts["base_rows_unchanged"]:
        how = "bit-identical to" if facts["base_rows_same_dtype"] else "same values, other dtype than"
        return f"base rows: unchanged ({how} {base})"
    changed = f"max |diff| {facts['base_rows_max_abs_diff']:.3e} in {facts['base_rows_changed']} rows"
    cfg = facts.get("config")
    if cfg is None:
        return f"base rows: changed ({changed}); the file does not record whether they were meant to stay frozen"
    if cfg["freeze_base_vocab_recorded"] and cfg["freeze_base_vocab"]:
        return (f"base rows: DRIFTED ({changed}): the run's config says freeze_base_vocab True, so freezing did not "
                f"work in the trainer that wrote it; the base tokens' embeddings/logits no longer match {base}, so "
                "text the base model read well may now be read differently, and resuming keeps the drift; to keep "
                f"them intact start a new run from {base} with freeze_base_vocab on")
    why = ("freeze_base_vocab False" if cfg["freeze_base_vocab_recorded"]
           else "the setting is not recorded: trainers before it trained every row")
    extended = (facts["vocab"].get("new_text_tokens") or 0) > 0
    advice = ("; to keep the base language's rows intact in an extended vocabulary, train with --freeze-base-vocab"
              if extended else "")
    return f"base rows: trained (freezing off; {changed}), as the run was configured ({why}){advice}"


def show(value: Any) -> str:
    """Compact value for a text line: 2e-05, 0.01, 1.234, unknown for a missing field."""
    if value is None:
        return "unknown"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# ---------------------------------------------------------------- entry point

def json_safe(value: Any) -> Any:
    # Strict JSON has no inf/nan; a diverged run can produce them, so keep them as strings.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def inspect(path: Path, base_path: Path | None) -> dict[str, Any]:
    ck = load_file(path, "checkpoint")
    facts = describe(ck)
    facts.update({"base": None, "drift": None, "base_rows_unchanged": None})
    if base_path is not None and "text_embedding.weight" not in ck.state:
        raise UserError(f"--base: {path} is a LoRA checkpoint without text rows (its vocabulary is its base's, "
                        "which it does not copy): there are no rows to compare")
    if base_path is not None:
        facts.update(compare_with_base(ck, load_file(base_path, "--base")))
    return facts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Describe a GPT checkpoint and, with --base, whether the base "
                                                 "vocabulary rows of its text embedding/head drifted.")
    parser.add_argument("checkpoint", type=Path, help="run directory (e.g. runs/x: its newest checkpoint, or "
                                                      "--which), trainer checkpoint (e.g. runs/x/latest.pth) or gpt.pth")
    parser.add_argument("--which", help=WHICH_HELP)
    parser.add_argument("--base", type=Path, help="base checkpoint the run started from (e.g. checkpoints/gpt.pth)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")
    parser.add_argument("--verify", action="store_true",
                        help="only check the file against the checksums written with it: ok / corrupt / not "
                             "verifiable; exit status 1 if corrupt")
    args = parser.parse_args(argv)
    if args.verify and args.base:
        parser.error("--verify checks one file; run it without --base")
    return args


@tool_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path = checkpoint_path(args.checkpoint, args.which)
        if args.verify:
            result = verify(path)
            print(json.dumps(result, indent=2) if args.json else "\n".join(render_verify(result)))
            return 1 if result["integrity"] == "corrupt" else 0
        facts = inspect(path, args.base)
    except UserError as exc:  # said on one line, however the message was wrapped
        raise UserError(" ".join(str(exc).split())) from None
    print(json.dumps(json_safe(facts), indent=2) if args.json else "\n".join(render_text(facts)))
    return 0
