"""The run directory: which run it holds, what to continue, and the files written beside the checkpoints.

    model_step{N}.pth, latest.pth   checkpoints (trainers/checkpoint)
    run_config.json                 the resolved settings, written before the first step, so a run
                                    killed before its first checkpoint restarts with them, and a resume
                                    (or a branch of another directory's checkpoint) killed before its
                                    first save continues the plan it accepted (trainers/run/run_plan.py)
    config.yaml                     your --config with this run's vocabulary: the config to export with
                                    when --config was the full IndexTTS2 one
    micro_batch_probe.json          the measured micro-batch per machine (trainers/hardware)
    logs/, sample_ids.tsv           TensorBoard events, the optional per-step sample record
"""
from __future__ import annotations

import difflib
import json
import logging
import os
import re
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainers.checkpoint import schema
from trainers.checkpoint.recovery import newest_intact
from trainers.checkpoint.step_files import CheckpointManager
from trainers.log_lines import log_fitting
from trainers.config.flags import CommandLine
from trainers.config.inference_keys import missing_inference_keys
from trainers.config.settings import TrainConfig, saved_settings
from trainers.errors import UserError
from trainers.families import FAMILIES, ModelFamily, family_for_config
from trainers.files import file_identity, fsync_dir, write_text_atomically
from trainers.hardware.detect import library_versions
from trainers.model.gpt_model import GPTConfig
from trainers.model.vocabulary import Vocabulary
from trainers.run import run_plan
from trainers.torch_files import CheckpointError

log = logging.getLogger("train")

RUN_CONFIG_NAME = "run_config.json"
INFERENCE_CONFIG_NAME = "config.yaml"
DEMO_OUTPUT_DIR = "runs/demo"


@dataclass(frozen=True)
class SavedRun:
    """The run being continued: a checkpoint, or the settings of a run killed before its first one."""

    settings: dict[str, Any]  # TrainConfig fields as saved, completed for older trainer versions
    machine: str | None  # the hardware key of the machine that wrote it
    run_id: str = ""  # "" for runs written before runs had an identity
    checkpoint: schema.Checkpoint | None = None
    path: Path | None = None
    damaged: tuple[tuple[Path, str], ...] = ()  # newer checkpoints that failed: set aside once the run is locked
    plan_key: dict[str, Any] | None = None  # names the checkpoint, for the plan this start records (run_plan.py)
    # A branch of this checkpoint that `run_dir` holds, stopped before its first save, which this start continues:
    # its run id (kept) and run_config.json's record of it (run_plan.branch_record).
    branch_id: str = ""
    branch: dict[str, Any] | None = None


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines the run; the "run" section of a checkpoint."""

    settings: TrainConfig  # the settings (flags) of the run
    gpt: GPTConfig
    run_dir: Path
    run_id: str
    vocab: Vocabulary
    fingerprints: dict[str, str]
    model_yaml: dict[str, Any]
    family: ModelFamily = FAMILIES["indextts2"]  # the model family (trainers/families)

    def state_dict(self) -> dict[str, Any]:
        state = {"run_id": self.run_id, "config": self.settings.to_dict(), "model_config": self.gpt.to_dict(),
                 "fingerprints": dict(self.fingerprints), "vocab": self.vocab.to_dict(),
                 "versions": library_versions()}
        if self.family is not next(iter(FAMILIES.values())):  # the first family saves what it always did
            state["model_family"] = self.family.name
        return state


def run_dir_of(cmd: CommandLine) -> Path:
    """The run directory the command names, from its flags alone (nothing is read from it)."""
    given_dir = cmd.given.get("output_dir")
    if given_dir:  # the default directory is checked below, once it is known
        refuse_non_directory(Path(given_dir))
    if cmd.resume == "best":
        return Path(given_dir or os.path.abspath(TrainConfig.output_dir))
    if cmd.resume not in (None, "auto"):
        path = Path(cmd.resume)
        if not path.is_file():
            raise UserError(f"--resume {cmd.resume}: no such file; use --resume auto to continue OUTPUT_DIR/latest.pth")
        return Path(given_dir) if given_dir else path.resolve().parent
    default_dir = demo_output_dir(cmd.given.get("config")) if cmd.given.get("demo") else TrainConfig.output_dir
    run_dir = Path(given_dir or os.path.abspath(default_dir))
    refuse_non_directory(run_dir)
    return run_dir


def demo_output_dir(config: str | None) -> str:
    """--demo's default run directory: runs/demo, or the model family's (runs/demo25 with checkpoints/demo25.yaml),
    so the demos of two families never meet in one directory. A config that cannot be read is reported later."""
    if not config:
        return DEMO_OUTPUT_DIR
    try:
        data = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return DEMO_OUTPUT_DIR
    return family_for_config(data).demo_output_dir if isinstance(data, dict) else DEMO_OUTPUT_DIR


def locate_run(cmd: CommandLine) -> tuple[Path, Path | None]:
    """The run directory and the checkpoint to resume (None: start fresh)."""
    run_dir = run_dir_of(cmd)
    if cmd.resume == "best":
        return _best_of(run_dir)
    if cmd.resume not in (None, "auto"):
        return run_dir, Path(cmd.resume)
    found = newest_checkpoint(run_dir)
    if cmd.resume == "auto":
        return run_dir, found
    if found is not None:
        raise UserError(
            f"{run_dir} already holds a run ({found.name}); pass --resume auto to continue it, "
            "or choose another --output-dir (nothing was changed)"
        )
    return run_dir, None


def refuse_non_directory(run_dir: Path) -> None:
    """--output-dir must be a directory or a path where one can be made: a file there (or in place of one of
    its parents) is named as such, before anything is read or written, instead of the system's "File exists"."""
    for path in (run_dir, *run_dir.parents):
        if path.is_dir():
            return
        if os.path.lexists(path):
            what = "a file, not a directory" if path.is_file() else "not a directory (a broken link, a device, a pipe)"
            where = f"is {what}" if path == run_dir else f"cannot be made: {path} is {what}"
            raise UserError(f"--output-dir {run_dir} {where}; pass a directory for the run (it is created if "
                            "missing), e.g. a new name; nothing was written")


def warn_new_run(run_dir: Path, existed: bool = True) -> None:
    """`--resume auto` found no run in `run_dir`: it starts one, which is right for a first start (cloud
    scripts pass --resume auto every time) and wrong after a typo in --output-dir, so say it loudly.
    `existed`: whether the directory was there before this trainer locked (and so created) it."""
    where = "does not exist" if not existed else "holds no checkpoint and no run_config.json"
    near = similar_runs(run_dir)
    log.warning("--resume auto: %s %s, so a NEW run starts there at step 0.", run_dir, where)
    if near:
        log.warning("runs next to it with similar names: %s", "; ".join(near))
        log.warning("if you meant one of them, stop this trainer (Ctrl-C) and pass its --output-dir")
    else:
        log.warning("if you meant to continue a run, stop this trainer (Ctrl-C) and check --output-dir")


def similar_runs(run_dir: Path, limit: int = 3) -> list[str]:
    """Directories beside `run_dir` whose names are close to its name and that hold a run, described."""
    try:
        siblings = [p.name for p in run_dir.parent.iterdir() if p.name != run_dir.name and p.is_dir()]
    except OSError:
        return []
    found = []
    for name in difflib.get_close_matches(run_dir.name, siblings, n=10, cutoff=0.6):
        path = run_dir.parent / name
        newest = newest_checkpoint(path)
        if newest is not None:
            found.append(f"{path} (newest checkpoint {newest.name})")
        elif (path / RUN_CONFIG_NAME).is_file():
            found.append(f"{path} (no checkpoint yet)")
        if len(found) == limit:
            break
    return found


def _best_of(run_dir: Path) -> tuple[Path, Path]:
    """`--resume best`: continue from best.pth, if that does not leave a newer branch of the run behind it."""
    manager = CheckpointManager(run_dir, keep=0)
    best = manager.best_path()
    if not best.is_file():
        raise UserError(f"--resume best: {run_dir} has no {best.name} (it is written at each validation that beats "
                        "the ones before; pass --val-manifest to validate); use --resume auto")
    newest = manager.find_resume()
    try:
        best_step = schema.read(best, mmap=True).step
        newest_step = schema.read(newest, mmap=True).step if newest else best_step
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    if newest_step > best_step:
        raise UserError(f"--resume best: {best.name} is step {best_step} but {run_dir} already holds step "
                        f"{newest_step}; continuing from it here would put a second branch of the run into this "
                        f"directory. Start the branch in a new one: --resume {best} --output-dir NEW_DIR (this run is "
                        "left as it is), or continue the run with --resume auto")
    return run_dir, best


def newest_checkpoint(run_dir: Path) -> Path | None:
    return CheckpointManager(run_dir, keep=0).find_resume() if run_dir.is_dir() else None


def read_saved_run(run_dir: Path, checkpoint: Path | None, resume: str | None) -> SavedRun | None:
    if checkpoint is not None:
        try:
            damaged: tuple[tuple[Path, str], ...] = ()
            if resume == "auto":  # past damaged checkpoints to the newest intact one
                found = newest_intact(run_dir, checkpoint)
                assert found is not None
                ckpt, checkpoint, damaged = found.checkpoint, found.path, tuple(found.damaged)
            else:  # the file the user named: a damaged one is refused
                ckpt = schema.read(checkpoint)
        except CheckpointError as exc:
            raise UserError(str(exc)) from None
        where = f"resuming from {checkpoint} (step {ckpt.step}, epoch {ckpt.epoch}, step {ckpt.step_in_epoch} of that epoch;"
        log_fitting(log, f"{where} {ckpt.integrity})", where, f"{ckpt.integrity})")
        key, machine = run_plan.checkpoint_key(ckpt), ckpt.machine
        if resume == "auto":  # a continuation stopped before its first save: the plan it accepted
            path = run_dir / RUN_CONFIG_NAME
            ckpt, planned_on = run_plan.continued(ckpt, key, run_plan.read_record(path), path)
            machine = planned_on or machine
        branch_id, branch = _unsaved_branch_of(run_dir, checkpoint, key)
        return SavedRun(saved_settings(ckpt.settings), machine, ckpt.run_id, ckpt, checkpoint, damaged, key,
                        branch_id, branch)
    if resume == "auto":
        return _unsaved_run(run_dir)
    return None


def _unsaved_branch_of(run_dir: Path, checkpoint: Path, key: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The branch command typed again: the run id and record of the branch of `checkpoint` (another directory's)
    that `run_dir` holds, stopped before its first save; ("", None) where it holds no such branch."""
    if checkpoint.resolve().parent == run_dir.resolve() or newest_checkpoint(run_dir) is not None:
        return "", None
    record = run_plan.read_record(run_dir / RUN_CONFIG_NAME)
    branch = run_plan.recorded_branch(record)
    if record is None or branch is None or branch["continues"] != key or not record.get("run_id"):
        return "", None
    return str(record["run_id"]), branch


def _unsaved_run(run_dir: Path) -> SavedRun | None:
    """A run killed before its first checkpoint restarts from step 0 with its saved settings; a branch of another
    directory's checkpoint continues that checkpoint with the plan it accepted."""
    path = run_dir / RUN_CONFIG_NAME
    if not path.is_file():
        return None
    try:
        data = run_plan.unsealed(json.loads(path.read_text(encoding="utf-8")), path)
        settings = data["config"]
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise UserError(f"{path} is unreadable ({exc}); pass the training flags again, or delete it") from None
    run_id, branch = str(data.get("run_id") or ""), run_plan.recorded_branch(data)
    if branch is not None and (data.get(run_plan.PLAN_KEY) or {}).get("continues") == branch["continues"]:
        return _unsaved_branch(run_dir, data, branch, run_id)
    log.info("--resume auto: %s has no checkpoint yet: step 0, with the settings in %s", run_dir, RUN_CONFIG_NAME)
    if branch:  # a LoRA branch starts at step 0
        log.info("(%s)", branch.get("history"))
    return SavedRun(saved_settings(settings), data.get("machine"), run_id, branch_id=run_id if branch else "",
                    branch=branch)


def _unsaved_branch(run_dir: Path, data: dict[str, Any], branch: dict[str, Any], run_id: str) -> SavedRun:
    """A branch killed before its first save: the checkpoint it branched from, read again (the very one: its key
    must match), with the plan the branch accepted. Gone or changed, it is refused: never a silent step 0."""
    key, origin = branch["continues"], Path(branch["file"])
    found, problem = _find_branched(origin, key)
    if found is None:
        what = f"run {key.get('run_id') or '(no identity)'} at step {key.get('step')}"
        raise UserError(f"--resume auto: {run_dir} holds a branch of {what} that was stopped before its first save; "
                        f"it continues {origin}, which {problem}. Put that checkpoint back and run --resume auto "
                        f"again; or start another branch: in a new --output-dir, or here once {run_dir / RUN_CONFIG_NAME}"
                        " is deleted (the directory holds no checkpoint yet; nothing was changed)")
    path, ckpt = found
    log.info("--resume auto: %s has no checkpoint yet; continuing its branch from %s", run_dir, path)
    log.info("(%s)", branch.get("history"))
    ckpt, planned_on = run_plan.continued(ckpt, key, data, run_dir / RUN_CONFIG_NAME, branch=True)
    return SavedRun(saved_settings(ckpt.settings), planned_on or ckpt.machine, ckpt.run_id, ckpt, path, (), key,
                    run_id, {**branch, "file": str(path)})


def _find_branched(origin: Path, key: dict[str, Any]) -> tuple[tuple[Path, schema.Checkpoint] | None, str]:
    """The checkpoint `key` names: `origin`, or (where that latest.pth or best.pth has moved on) the step file of
    the same step beside it, verified. None and what is wrong with `origin` where neither holds it."""
    problem = "is gone"
    step = key.get("step")
    beside = CheckpointManager(origin.parent, keep=0).step_path(step) if isinstance(step, int) else origin
    candidates = [origin, *([beside] if beside.name != origin.name else [])]
    for i, path in enumerate(candidates):
        if not path.is_file():
            continue
        try:
            ckpt = schema.read(path)
        except CheckpointError as exc:
            problem = problem if i else f"cannot be read ({exc})"
            continue
        if run_plan.checkpoint_key(ckpt) == key:
            return (path, ckpt), ""
        if i == 0:
            problem = f"now holds another checkpoint (step {ckpt.step} of run {ckpt.run_id or '(no identity)'})"
    return None, problem


def refuse_another_runs_checkpoint(run_dir: Path, saved: SavedRun) -> None:
    """The checkpoint to continue must belong to the run in `run_dir`, if `run_dir` holds one.

    From another directory (`--resume PATH --output-dir DIR`): mixing two runs' checkpoints in one
    directory would let a later --resume auto pick the other run's newer file; a branch of PATH that DIR
    holds, stopped before its first save, is no other run (`saved.branch_id`). Inside `run_dir`
    (auto, best, or an older model_step file): a file copied in from another run would carry on
    that run's weights under this run's name, so its identity must be the directory's.
    """
    assert saved.path is not None
    if saved.path.resolve().parent == run_dir.resolve():
        owner, source = _directory_owner(run_dir, saved.path)
        if not saved.run_id or owner is None or owner == saved.run_id:
            return
        raise UserError(f"{saved.path} is a checkpoint of run {saved.run_id}, but {run_dir} holds run "
                        f"{owner} (named by {source}): was it copied in from another run? Continuing it here "
                        f"would carry on that run's weights under this run's name. Move {saved.path.name} "
                        f"out of {run_dir} and resume again (the newest checkpoint of run {owner} is then "
                        f"used), or continue run {saved.run_id} in a directory of its own with --resume PATH "
                        "--output-dir NEW_DIR (nothing was changed)")
    existing = run_identity(run_dir)
    if existing is None or (existing and existing in (saved.run_id, saved.branch_id)):
        return  # no run yet, the same run, or its branch of this checkpoint stopped before its first save
    theirs = f"run {existing}" if existing else "a run from before runs had an identity"
    ours = f"run {saved.run_id}" if saved.run_id else "no recorded identity"
    raise UserError(f"{run_dir} already holds another run ({theirs}) than {saved.path} ({ours}); resuming it there "
                    "would mix the two runs' checkpoints. Pass a new --output-dir to continue it as its own branch, or "
                    "--resume auto to continue the run that is there (nothing was changed)")


def _directory_owner(run_dir: Path, chosen: Path) -> tuple[str | None, str]:
    """The run `run_dir` belongs to, and what says so: its run_config.json, or else its other checkpoints
    when they agree on one identity (None: nothing recorded one)."""
    recorded = _run_config_identity(run_dir)
    if recorded:
        return recorded, RUN_CONFIG_NAME
    manager = CheckpointManager(run_dir, keep=0)
    chosen_file = file_identity(chosen)
    owners: dict[str, list[str]] = {}
    for path in [p for _, p in manager.step_files()] + [manager.latest_path(), manager.best_path()]:
        if not path.is_file() or file_identity(path) == chosen_file:
            continue
        try:
            owners.setdefault(schema.read(path, mmap=True).run_id, []).append(path.name)
        except CheckpointError:
            continue  # a damaged file names no run
    owners.pop("", None)
    if len(owners) != 1:
        return None, ""
    (owner, names), = owners.items()
    return owner, ", ".join(names)


def _run_config_identity(run_dir: Path) -> str | None:
    """The run id in run_config.json ("" if it records none), or None without a readable file."""
    config = run_dir / RUN_CONFIG_NAME
    if not config.is_file():
        return None
    try:
        return str(json.loads(config.read_text(encoding="utf-8")).get("run_id") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def run_identity(run_dir: Path) -> str | None:
    """The identity of the run in `run_dir` ("" if it has none recorded), or None if it holds no run."""
    newest = newest_checkpoint(run_dir)
    if newest is not None:
        try:
            return schema.read(newest, mmap=True).run_id
        except CheckpointError:
            return ""
    return _run_config_identity(run_dir)


def write_inference_config(cfg: RunConfig) -> None:
    """config.yaml for inference: the user's config with the vocabulary of this run. Its model family
    names the keys its inference reads and where the config names the tokenizer."""
    tokenizer_key, title = cfg.family.tokenizer_config_key, cfg.family.inference_name
    tokenizer = cfg.settings.tokenizer
    data = {**cfg.model_yaml, "gpt": {**cfg.model_yaml["gpt"], "number_text_tokens": cfg.vocab.text_tokens}}
    path = cfg.run_dir / INFERENCE_CONFIG_NAME
    write_text_atomically(path, yaml.safe_dump(data, sort_keys=False))
    missing = missing_inference_keys(data, cfg.family.inference_keys)
    if missing and not cfg.settings.demo:  # the demo's tiny model is not for inference
        log.info("%s lacks keys %s inference reads (a trimmed --config: enough to train):", path, title)
        for line in textwrap.wrap(", ".join(missing), 88):
            log.info("  %s", line)
        log.info("to export: indextts-export --config with the full config.yaml of your %s model", title)
    if tokenizer_key is None:  # inference opens the tokenizer by a fixed name, not through the config
        return
    section, key = tokenizer_key.split(".")
    named = (data.get(section) or {}).get(key)
    if cfg.vocab.extended and named and Path(named).name != Path(tokenizer).name:
        log.info("for inference, point %s in %s at the extended tokenizer %s", tokenizer_key, path, tokenizer)
        log.info("(it names %s now)", named)


# Temporaries of write_text_atomically (run_config.json, config.yaml, ...) and of demo-data generation.
_STRAY_FILE = re.compile(r"^\.[A-Za-z0-9_.-]+\.(json|yaml|tsv)\.tmp$")
_STRAY_DIR = re.compile(r"^\.demo_data\.(tmp|stale)-[A-Za-z0-9_]+$")


def prepare_run_dir(run_dir: Path) -> None:
    """Remove what a killed trainer left half written. Call with the run directory locked."""
    removed = CheckpointManager(run_dir, keep=0).clean_stale_temporaries()
    for entry in sorted(run_dir.iterdir()):
        if _STRAY_FILE.match(entry.name) and entry.is_file():
            entry.unlink()
            removed.append(entry)
        elif _STRAY_DIR.match(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
            removed.append(entry)
    if removed:
        log.info("removed %d unfinished file(s) left by an interrupted trainer:", len(removed))
        log.info("  %s", ", ".join(p.name for p in removed))


def write_start_files(cfg: RunConfig, machine: str, plan: dict[str, Any] | None,
                      branch: dict[str, Any] | None) -> None:
    """run_config.json: the resolved settings, for a resume before the first checkpoint and for people,
    with the `plan` of a continued checkpoint and a `branch`'s record of it (trainers/run/run_plan.py)
    and a sha256 of it all, durable before the first step; and the inference config.yaml. A full disk
    or read-only directory stops here, cleanly."""
    data = run_plan.sealed({**cfg.state_dict(), "machine": machine,
                            **({run_plan.PLAN_KEY: plan} if plan else {}),
                            **({run_plan.BRANCH_KEY: branch} if branch else {})})
    run_dir = cfg.run_dir
    try:
        prepare_run_dir(run_dir)
        write_text_atomically(run_dir / RUN_CONFIG_NAME, json.dumps(data, indent=2, sort_keys=True) + "\n")
        fsync_dir(run_dir)
        write_inference_config(cfg)
    except OSError as exc:
        raise UserError(f"cannot write in the run directory {run_dir}: {exc}; free disk space or fix its permissions, "
                        "then start again (nothing was trained)") from None
