"""Make a run directory carry its own tokenizer and config, so it resumes wherever it is copied.

    python tools/pack_run.py runs/my_voice [--data-root OLD=NEW ...]

Copies into RUN_DIR/inputs/ the run's tokenizer and config (and its base checkpoint, but only
while the run has no checkpoint yet: every checkpoint carries the base checkpoint's tensors in
its "model" section, so a run with one never reads the base file again), each checked against
the fingerprints saved with the run first, and records them in RUN_DIR/inputs.json (written
atomically). From then on the trainer uses those copies in place of the saved paths, wherever
the run directory is. No checkpoint is rewritten.

Not copied: the training and validation manifests and the feature files they name (usually
large, kept separately): a moved run finds them with `--data-root OLD=NEW`. Inputs that are
already inside the run directory (the demo's demo_data/) are recorded, not copied.

--data-root OLD=NEW: find the inputs of a run that was already moved, as the trainer does.
Exit status 0, or 2 (with `error: ...`; nothing written) if an input is missing or is not the
file the run was trained with.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from trainers.checkpoint import schema
from trainers.config.flags import parse_data_root
from trainers.config.manifest_flags import manifest_flag
from trainers.config.settings import TrainConfig, saved_settings
from trainers.errors import UserError
from trainers.files import file_sha256, write_atomically
from trainers.run.inputs import gpt_config, model_config_fingerprint, read_model_yaml
from trainers.run.portable import (
    INPUTS_FILE, PACKED_DIR, Found, Places, common_dir, find, missing_report, moved_dirs, read_packed,
    relative_inside, saved_fingerprints, write_packed,
)
from trainers.run.run_dir import RUN_CONFIG_NAME, SavedRun
from trainers.tools import tool_main
from trainers.tools.run_files import newest_checkpoint
from trainers.torch_files import CheckpointError


def read_run(run_dir: Path) -> SavedRun:
    """The run's saved settings: its newest checkpoint's, or run_config.json's before the first checkpoint."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    newest = newest_checkpoint(run_dir)
    if newest is not None:
        try:
            ckpt = schema.read(newest, mmap=True)
        except CheckpointError as exc:
            raise UserError(str(exc)) from None
        return SavedRun(saved_settings(ckpt.settings), ckpt.machine, ckpt.run_id, ckpt, newest)
    path = run_dir / RUN_CONFIG_NAME
    if not path.is_file():
        raise UserError(f"{run_dir} holds no run (no checkpoint and no {RUN_CONFIG_NAME})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return SavedRun(saved_settings(data["config"]), data.get("machine"), str(data.get("run_id") or ""))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is unreadable ({exc})") from None


def check_fingerprints(saved: SavedRun, tokenizer: Found, config: Found, expected: dict[str, str]) -> list[str]:
    """The tokenizer and config found are the run's own: what the trainer would check on resume."""
    from trainers.families import family_for_config

    assert tokenizer.path and config.path
    problems = []
    sha = file_sha256(Path(tokenizer.path))
    if expected.get("tokenizer") and sha != expected["tokenizer"]:
        problems.append(f"--tokenizer {tokenizer.path}: its sha256 {sha[:12]}... differs from the one saved with the "
                        f"run ({expected['tokenizer'][:12]}...)")
    elif expected.get("model_config"):
        cfg = TrainConfig.from_dict({**saved.settings, "config": config.path})
        model_yaml = read_model_yaml(config.path)
        family = family_for_config(model_yaml)
        gpt = gpt_config(model_yaml, cfg, family.tokenizer.size(tokenizer.path), family)
        if model_config_fingerprint(gpt) != expected["model_config"]:
            problems.append(f"--config {config.path}: its gpt section differs from the model config saved with the "
                            "run")
    return problems


def copy_into(source: Path, target: Path) -> bool:
    """Copy `source` to `target` durably (write_atomically); False if it is already there."""
    if target.is_file() and file_sha256(target) == file_sha256(source):
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src:
        write_atomically(target, lambda dst: shutil.copyfileobj(src, dst, 1 << 20))
    return True


def pack(run_dir: Path, remaps: tuple[tuple[str, str], ...] = ()) -> list[str]:
    run_dir = Path(os.path.abspath(run_dir))
    saved = read_run(run_dir)
    settings = TrainConfig.from_dict(saved.settings)
    places = Places(run_dir, remaps, read_packed(run_dir), moved_dirs(saved, run_dir), settings.demo)
    needs_base = saved.checkpoint is None
    wanted = [k for k in ("tokenizer", "config") if getattr(settings, k)]
    if needs_base and settings.base_checkpoint:
        wanted.append("base_checkpoint")
    found = {k: find(places, k, getattr(settings, k)) for k in wanted}
    missing = [f for f in found.values() if f.path is None or not Path(f.path).is_file()]
    if missing:
        raise UserError(missing_report(missing, f"cannot pack {run_dir}"))
    if "tokenizer" in found and "config" in found:
        problems = check_fingerprints(saved, found["tokenizer"], found["config"], saved_fingerprints(saved, run_dir))
        if problems:
            raise UserError("\n".join([*problems, "these are not the files the run was trained with; pass --data-root "
                                                  "at the original ones (nothing was written)"]))

    where = f"{saved.path.name}, step {saved.checkpoint.step}" if saved.checkpoint and saved.path else \
        f"{RUN_CONFIG_NAME}, no checkpoint yet"
    lines = [f"packing {run_dir} ({where})"]
    entries = dict(read_packed(run_dir))
    names: set[str] = set()
    for key, f in found.items():
        assert f.path is not None
        rel = relative_inside(f.path, run_dir)
        if rel is None:
            name = Path(f.path).name if Path(f.path).name not in names else f"{key}-{Path(f.path).name}"
            rel = f"{PACKED_DIR}/{name}"
            copied = copy_into(Path(f.path), run_dir / rel)
            lines.append(f"{'copied' if copied else 'up to date'}: {f.flag} {f.path} -> {rel}")
        else:
            lines.append(f"already inside the run directory: {f.flag} {rel}")
        names.add(Path(rel).name)
        entries[key] = {"path": rel, "was": f.saved, "sha256": file_sha256(run_dir / rel)}
    if not needs_base and settings.base_checkpoint:
        lines.append(f"not needed: --base-checkpoint {settings.base_checkpoint} (every checkpoint carries its tensors "
                     "in its \"model\" section; it is read only to start a run at step 0)")
    write_packed(run_dir, entries)
    lines.append(f"wrote {run_dir / INPUTS_FILE}")

    outside = []
    for key, flag in (("train_manifests", "--train-manifest"), ("val_manifests", "--val-manifest")):
        for spec in getattr(settings, key):
            path = manifest_flag(spec).path
            f = find(places, key, path)
            now = f.path or f"{path} (not found here)"
            if relative_inside(now, run_dir) is None:
                outside.append(f"  {flag} {now}, and the feature files it names")
    if outside:
        lines += ["not packed (data, usually large; keep it separately and bring it along):", *outside]
        root = common_dir(manifest_flag(s).path for s in (*settings.train_manifests, *settings.val_manifests)) or "OLD"
        lines += ["to resume after moving the run directory (and the data):",
                  "  python trainers/train_gpt_v2.py --resume auto --output-dir NEW_RUN_DIR "
                  f"--data-root {root}=NEW_DATA_FOLDER"]
    else:
        lines += ["the data is inside the run directory too; after moving it, resume with:",
                  "  python trainers/train_gpt_v2.py --resume auto --output-dir NEW_RUN_DIR"]
    return lines


@tool_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Copy a run's tokenizer and config into its run directory (and "
                                                 "record them in inputs.json), so the run resumes wherever it moves.")
    parser.add_argument("run_dir", type=Path, help="the run directory")
    parser.add_argument("--data-root", action="append", default=[], metavar="OLD=NEW",
                        help="the run's saved input paths under OLD are looked for under NEW (a run already moved)")
    args = parser.parse_args(argv)
    try:
        remaps = tuple(parse_data_root(r) for r in args.data_root)
    except ValueError as exc:
        parser.error(f"--data-root: {exc}")
    print("\n".join(pack(args.run_dir, remaps)))
    return 0
