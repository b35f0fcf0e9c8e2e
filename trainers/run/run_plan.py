"""The plan a resume accepted, durable before its first step: run_config.json's record of it.

A checkpoint holds the plan it was trained under: the settings (the run's end, --early-stop-patience, the
intervals, ... in its "run" section) and the learning-rate schedule with its continuations (--rewarm, in
"optim"). A resume that changes the plan makes it part of the run with its first save; a kill before that
save would lose it, and `--resume auto` alone would continue the old plan (often: "nothing to do").

So every start that continues a checkpoint records, in run_config.json, the plan it accepted (the resolved
run section, as always, and the schedule) beside the key of the checkpoint it continues (its step, run and a
digest of its fields), with a sha256 of the whole file; written atomically and fsynced once every refusal is
behind and before the first step. `--resume auto` that finds that same checkpoint again (the continuation
saved none) continues with the recorded plan, as if the continuation had saved at its first step; any other
checkpoint (one the continuation saved, which carries the plan itself, or an older one after damage) keeps
its own. Files written before the record existed carry none and change nothing; one that fails its sha256
is refused (exit 2), since which plan it holds cannot be known.

A branch (`--resume PATH --output-dir NEW`, and the LoRA branch with --lora-rank) continues a checkpoint of
another directory, so its run_config.json also names that file (the "branch" record: its path, its key and
the line the branch's history records). Killed before its first save, the branch's directory holds no
checkpoint: `--resume auto` reads the named file again (refused, exit 2, where it is gone or now holds
another checkpoint) and continues the branch with the recorded plan and the branch's own run id; the branch
command typed again is the same branch, not another run's directory (trainers/run/run_dir.py).
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainers.checkpoint import integrity, schema
from trainers.config.settings import TrainConfig, compare, saved_settings
from trainers.errors import UserError
from trainers.files import dict_sha256
from trainers.training.lr_schedule import LRSchedule

log = logging.getLogger("train")

CHECKSUM_KEY = "sha256"  # over the rest of run_config.json
PLAN_KEY = "plan"  # {"continues": checkpoint_key(...), "lr_schedule": {...}}
BRANCH_KEY = "branch"  # {"file": the checkpoint of another directory, "continues": its key, "history": a line}
# Settings that say where files are, not what the plan is (a moved or copied run has other paths): not listed.
WHERE_FILES_ARE = ("output_dir", "train_manifests", "val_manifests", "tokenizer", "config", "base_checkpoint")


def checkpoint_key(ckpt: schema.Checkpoint) -> dict[str, Any]:
    """What names the checkpoint a plan continues: its step, its run and a digest of its fields (no tensor read)."""
    return {"step": ckpt.step, "run_id": ckpt.run_id, "fields": integrity.fields_digest(ckpt.sections)}


def branch_record(file: Path, continues: dict[str, Any], history: str) -> dict[str, Any]:
    """What names the checkpoint a branch started from: its absolute path and key, and the branch's history line."""
    return {"file": str(file.resolve()), "continues": continues, "history": history}


def recorded_branch(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The branch record of run_config.json's content (None: the run is no branch, or it was written before)."""
    branch = (record or {}).get(BRANCH_KEY)
    if isinstance(branch, dict) and isinstance(branch.get("continues"), dict) and isinstance(branch.get("file"), str):
        return branch
    return None


def sealed(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the sha256 of its content, as run_config.json holds it."""
    return {**data, CHECKSUM_KEY: dict_sha256(data)}


def unsealed(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The content of a run_config.json, checked against its sha256 (files written before it had none)."""
    content = {k: v for k, v in data.items() if k != CHECKSUM_KEY}
    if CHECKSUM_KEY in data and data[CHECKSUM_KEY] != dict_sha256(content):
        raise UserError(f"{path} does not match the sha256 written with it (edited or damaged), so the plan it records "
                        "cannot be trusted; restore it from a backup, or delete it to continue the newest checkpoint "
                        "with the plan saved in it (pass the flags of any change again)")
    return content


def continued(ckpt: schema.Checkpoint, key: dict[str, Any], record: dict[str, Any] | None,
              source: Path, branch: bool = False) -> tuple[schema.Checkpoint, str | None]:
    """`ckpt` with the plan `record` (run_config.json's content) holds for it, and the machine that plan was resolved
    on; `ckpt` itself and None where the record continues another checkpoint, or none. `branch`: the record is of
    a branch of `ckpt` (a run of its own, whose run id is not the checkpoint's; the checkpoint keeps its own)."""
    plan = (record or {}).get(PLAN_KEY)
    if not isinstance(plan, dict) or plan.get("continues") != key:
        return ckpt, None
    if branch:  # the record is the branch's plan for this very checkpoint (its key matched): always taken
        run = {k: record.get(k, v) for k, v in ckpt.sections["run"].items()}
    else:
        run = {k: record[k] for k in ckpt.sections["run"] if k in record}
        if run.keys() != ckpt.sections["run"].keys() or run["run_id"] != ckpt.run_id:
            return ckpt, None
    run["run_id"] = ckpt.run_id
    optim = {**ckpt.sections["optim"], "lr_schedule": plan["lr_schedule"]}
    changed = replace(ckpt, sections={**ckpt.sections, "run": run, "optim": optim})
    said = _differences(ckpt, changed)
    if said:
        log.info("--resume auto: continuing the plan the last start accepted for %s,",
                 ckpt.path.name if ckpt.path else "this checkpoint")
        log.info("recorded in %s by a start that saved nothing; its changes:", source.name)
        for change in said:
            log.info("  %s", change)
    return changed, str(record.get("machine") or "") or None


def _differences(before: schema.Checkpoint, after: schema.Checkpoint) -> list[str]:
    old, new = (TrainConfig.from_dict(saved_settings(c.settings)) for c in (before, after))
    said = [f"{c.key} {c.saved!r} -> {c.now!r}" for c in compare(old, new, before.fingerprints, after.fingerprints)
            if c.key not in WHERE_FILES_ARE]
    if before.lr_schedule != after.lr_schedule:
        schedule = LRSchedule.from_state_dict(after.lr_schedule)
        said += ([f"learning rate {line}" for line in schedule.continuations[-1].describe()] if schedule.continuations
                 else ["learning rate as configured"])
    return said


def read_record(path: Path) -> dict[str, Any] | None:
    """run_config.json's content, verified (None: there is no file, or one that is not a JSON object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return unsealed(data, path) if isinstance(data, dict) else None
