"""Finding a saved run's input files again after the run directory or the data moved.

A run saves the absolute paths of its inputs (manifests, tokenizer, config, base checkpoint).
When it is resumed, each saved path that was not given again on the command line is looked up
in these places, in this order, and the first file that exists is used:

    1. `--data-root OLD=NEW`: the saved path with the prefix OLD replaced by NEW (typed now);
    2. `inputs.json` in the run directory: a copy `tools/pack_run.py` put into the run
       directory for exactly that saved path;
    3. inside the run directory: a saved path under the directory the run was saved in (the
       run's saved `output_dir`, e.g. the demo's `demo_data/`) is taken relative to where the
       run directory is now (and to the folder of a `--resume PATH` checkpoint);
    4. the saved path itself;
    5. for a config that was the default of another checkout (`checkpoints/config.yaml`, or
       `checkpoints/demo.yaml` with --demo): this checkout's.

A file is never trusted by its name: every input found somewhere else than its saved path is
checked against the fingerprints saved with the run (the manifests' bytes, the tokenizer's
sha256, the model config's gpt section), and a difference is refused unless
--allow-config-change. Missing inputs are reported all at once, each with its saved path,
the places looked in and the flag that fixes it.

Nothing here rewrites a checkpoint: the paths found are saved with the next checkpoint (and in
run_config.json at start), and `inputs.json` holds the packed copies.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from trainers.config.manifest_flags import ManifestFlag, manifest_flag
from trainers.config.settings import BASE_FINGERPRINT, DEMO_DEFAULTS, TrainConfig
from trainers.errors import UserError
from trainers.files import write_text_atomically

if TYPE_CHECKING:
    from trainers.run.run_dir import SavedRun

log = logging.getLogger("train")

REPO_ROOT = Path(__file__).resolve().parents[2]
INPUTS_FILE = "inputs.json"  # the packed copies of a run's inputs, by saved path
PACKED_DIR = "inputs"  # where tools/pack_run.py copies them, inside the run directory
INPUTS_FORMAT = "indextts2-gpt-trainer-inputs/1"

# The run's path settings: (TrainConfig field, flag, fingerprint that verifies it, whether it is a list).
PATH_INPUTS = (
    ("train_manifests", "--train-manifest", "data", True),
    ("val_manifests", "--val-manifest", None, True),  # validation only: no fingerprint (see docs/moving_runs.md)
    ("tokenizer", "--tokenizer", "tokenizer", False),
    ("config", "--config", "model_config", False),
    ("base_checkpoint", "--base-checkpoint", BASE_FINGERPRINT, False),  # fingerprinted in LoRA runs only
)
FLAG_OF = {key: flag for key, flag, _, _ in PATH_INPUTS}
PACKABLE = ("tokenizer", "config", "base_checkpoint")


# ---------------------------------------------------------------- paths


def _parts(path: str) -> tuple[str, ...]:
    return Path(os.path.abspath(path)).parts


def rebase(path: str, old: str, new: str) -> str | None:
    """`path` with the directory prefix `old` replaced by `new`; None if `path` is not under `old`.

    Whole path components only: OLD=/data does not match /database/x.
    """
    p, o = _parts(path), _parts(old)
    if len(p) < len(o) or p[:len(o)] != o:
        return None
    return str(Path(os.path.abspath(new)).joinpath(*p[len(o):]))


def relative_inside(path: str, directory: Path) -> str | None:
    """`path` relative to `directory` if it lies inside it, else None."""
    p, d = _parts(path), _parts(str(directory))
    return str(Path(*p[len(d):])) if len(p) > len(d) and p[:len(d)] == d else None


# ---------------------------------------------------------------- inputs.json


def read_packed(run_dir: Path) -> dict[str, dict[str, str]]:
    """The packed copies recorded in `run_dir`/inputs.json: {key: {"path", "was", "sha256"}}; {} if none."""
    path = run_dir / INPUTS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != INPUTS_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {INPUTS_FORMAT!r}")
        entries = data["inputs"]
        if not isinstance(entries, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("was"), str)
                for e in entries.values()):
            raise ValueError("'inputs' must map each input to {path, was}")
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise UserError(f"{path} is unreadable ({exc}); run tools/pack_run.py {run_dir} again, or delete it and pass "
                        "the inputs' flags (nothing was changed)") from None
    return {k: v for k, v in entries.items() if k in PACKABLE}


def write_packed(run_dir: Path, entries: dict[str, dict[str, str]]) -> Path:
    path = run_dir / INPUTS_FILE
    data = {"format": INPUTS_FORMAT,
            "about": "copies of this run's inputs inside the run directory (paths relative to it), written by "
                     "tools/pack_run.py; the trainer uses one in place of the saved path it was copied from",
            "inputs": entries}
    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


# ---------------------------------------------------------------- looking up


@dataclass(frozen=True)
class Places:
    """Where a saved run's inputs may be now."""

    run_dir: Path
    remaps: tuple[tuple[str, str], ...] = ()  # --data-root OLD=NEW, typed now
    packed: dict[str, dict[str, str]] = field(default_factory=dict)  # inputs.json
    moved_dirs: tuple[tuple[str, str], ...] = ()  # (directory the run was saved in, where it is now)
    demo: bool = False

    def candidates(self, key: str, saved: str) -> list[tuple[str, str]]:
        """(path, why) in the order they are tried; why is "" for the saved path itself."""
        found: list[tuple[str, str]] = []
        matches = [(len(_parts(old)), old, new) for old, new in self.remaps if rebase(saved, old, new)]
        if matches:
            _, old, new = max(matches)  # the longest OLD prefix wins
            found.append((rebase(saved, old, new) or "", f"--data-root {old}={new}"))
        entry = self.packed.get(key)
        if entry and os.path.abspath(entry["was"]) == os.path.abspath(saved):
            found.append((str(self.run_dir / entry["path"]), f"packed into the run directory, see {INPUTS_FILE}"))
        for old_dir, new_dir in self.moved_dirs:
            inside = rebase(saved, old_dir, new_dir)
            if inside:
                found.append((inside, f"inside the run directory, saved as {old_dir}"))
        found.append((os.path.abspath(saved), ""))
        default = DEMO_DEFAULTS["config"] if self.demo else TrainConfig.config
        if key == "config" and Path(saved).as_posix().endswith("/" + default):
            found.append((str(REPO_ROOT / default), f"the default --config {default} of this checkout"))
        unique: dict[str, str] = {}
        for path, why in found:
            unique.setdefault(path, why)  # the first reason a path is tried for
        return list(unique.items())

    def will_be_generated(self, path: str) -> bool:
        """--demo writes its corpus into RUN_DIR/demo_data when it is missing (trainers/run/inputs.py)."""
        from trainers.run.inputs import DEMO_DATA_DIR

        return self.demo and Path(path).parent == self.run_dir / DEMO_DATA_DIR


@dataclass(frozen=True)
class Found:
    key: str
    saved: str  # the saved path (no ::lang suffix)
    path: str | None  # where it is now; None: missing
    why: str  # how it was found: "" at its saved path
    looked_in: tuple[str, ...]
    remap_missed: str = ""  # a --data-root that applied, but named no file

    @property
    def flag(self) -> str:
        return FLAG_OF[self.key]

    @property
    def moved(self) -> bool:
        return self.path is not None and self.why != ""


def find(places: Places, key: str, saved: str) -> Found:
    candidates = places.candidates(key, saved)
    looked = tuple(p for p, _ in candidates)
    missed = candidates[0][1] if candidates[0][1].startswith("--data-root") else ""
    for path, why in candidates:
        if Path(path).is_file():
            return Found(key, saved, path, why, looked, missed if why != missed else "")
    for path, why in candidates:
        if places.will_be_generated(path):
            return Found(key, saved, path, why, looked)
    return Found(key, saved, None, "", looked)


def missing_report(missing: Sequence[Found], what: str) -> str:
    """Every missing input with its saved path, the places looked in and the flags that fix it."""
    common = common_dir([m.saved for m in missing])
    own = dict.fromkeys(f"{m.flag} FILE" + (" (each of them)" if m.key.endswith("manifests") else "")
                        for m in missing)  # each flag once, in order
    return "\n".join([
        f"{what}: {len(missing)} input file(s) of the saved run are missing (nothing was changed):",
        *[f"  {m.flag} {m.saved} (looked in: {', '.join(m.looked_in)})" for m in missing],
        f"fix: pass --data-root OLD=NEW, OLD a folder these saved paths start with and NEW where it is now, e.g. "
        f"--data-root {common or '/old/folder'}=/new/folder (repeatable); or give the inputs' own flags: "
        f"{', '.join(own)}. Files found elsewhere are checked against the fingerprints saved with the run; "
        "tools/pack_run.py copies a run's tokenizer and config into its run directory so they move with it"])


def common_dir(paths: Iterable[str]) -> str:
    parents = [os.path.dirname(os.path.abspath(p)) for p in paths]
    if not parents:
        return ""
    common = os.path.commonpath(parents)
    return "" if common in ("/", "") else common


# ---------------------------------------------------------------- the trainer's use


@dataclass(frozen=True)
class Located:
    """The settings with each saved input path replaced by where it was found."""

    settings: TrainConfig
    found: tuple[Found, ...] = ()
    saved_fingerprints: dict[str, str] = field(default_factory=dict)

    def refuse_changed(self, fingerprints_now: dict[str, str], allow: bool) -> None:
        """A moved input must be the file the run was saved with: its fingerprint decides, never its name."""
        wrong = []
        for key, flag, fingerprint, _ in PATH_INPUTS:
            moved = [f for f in self.found if f.key == key and f.moved]
            saved_fp = self.saved_fingerprints.get(fingerprint or "")
            # None: not taken now (a LoRA base with --lora-rank 0), a setting difference the resume names
            if not moved or not saved_fp or fingerprints_now.get(fingerprint or "") in (None, saved_fp):
                continue
            where = ", ".join(f"{f.path} (saved as {f.saved}; {f.why})" for f in moved)
            wrong.append(f"  {flag} {where}: its {fingerprint} fingerprint differs from the one saved with the run "
                         f"({saved_fp[:12]}..., now {fingerprints_now[fingerprint or ''][:12]}...)")
        if not wrong:
            return
        if allow:
            for line in wrong:
                log.warning("continuing with a changed input (--allow-config-change):%s", line[1:])
            return
        raise UserError("\n".join([
            "input files found at a new place are not the ones this run was trained with:", *wrong,
            "the result would differ from the uninterrupted run. Point --data-root (or the input's own flag) at the "
            "original files, or pass --allow-config-change to continue anyway (nothing was changed)"]))


def locate_inputs(remaps: Sequence[tuple[str, str]], given: dict[str, Any], settings: TrainConfig,
                  saved: SavedRun | None, run_dir: Path) -> Located:
    """Find each input path of the saved run that was not given again on the command line."""
    if saved is None:
        if remaps:
            log.warning("--data-root is ignored: it applies to the saved paths of a run being resumed "
                        "(--resume auto or --resume PATH), and this run starts fresh")
        return Located(settings)
    places = Places(run_dir, tuple(remaps), read_packed(run_dir), moved_dirs(saved, run_dir), settings.demo)
    has_checkpoint = saved.checkpoint is not None
    found: list[Found] = []
    values: dict[str, Any] = {}
    for key, _, _, is_list in PATH_INPUTS:
        value = getattr(settings, key)
        if key in given or value is None:
            continue
        new_specs = []
        for spec in value if is_list else [value]:
            one = manifest_flag(spec) if is_list else ManifestFlag(spec, spec)  # a manifest's language follows it
            path = one.path
            f = find(places, key, path)
            if f.path is None and key == "base_checkpoint" and has_checkpoint and not settings.lora_rank:
                log.info("--base-checkpoint %s is not at its saved place; not needed:", path)
                log.info("the checkpoint being resumed carries every tensor of it")
                f = Found(key, path, path, "", f.looked_in)
            found.append(f)
            new_specs.append(one.moved(f.path or path))
        values[key] = tuple(new_specs) if is_list else new_specs[0]
    missing = [f for f in found if f.path is None]
    if missing:
        raise UserError(missing_report(missing, f"cannot resume the run in {run_dir}"))
    for f in found:
        if f.moved:
            log.info("input moved: %s %s -> %s", f.flag, f.saved, f.path)
            log.info("input moved: %s: %s", f.flag, f.why)
        if f.remap_missed:
            log.warning("%s: no %s at %s; using %s", f.remap_missed, f.flag, f.looked_in[0], f.path)
            log.warning("(%s)", f.why or "its saved path")
    for old, new in remaps:
        if not any(rebase(f.saved, old, new) for f in found):
            log.warning("--data-root %s=%s matched none of the saved input paths (%s)", old, new,
                        ", ".join(f.saved for f in found) or "none")
    return Located(replace(settings, **values), tuple(found), saved_fingerprints(saved, run_dir))


def moved_dirs(saved: SavedRun, run_dir: Path) -> tuple[tuple[str, str], ...]:
    """(the directory the run was saved in, where its files are now): the run directory, and the
    folder of the checkpoint given to --resume PATH."""
    old = saved.settings.get("output_dir")
    if not old:
        return ()
    now = [run_dir, *([saved.path.parent] if saved.path is not None else [])]
    news = dict.fromkeys(os.path.abspath(new) for new in now)  # each once, in this order
    return tuple((os.path.abspath(old), new) for new in news if new != os.path.abspath(old))


def saved_fingerprints(saved: SavedRun, run_dir: Path) -> dict[str, str]:
    """The fingerprints saved with the run: its checkpoint's, or run_config.json's for a run killed before one."""
    if saved.checkpoint is not None:
        return saved.checkpoint.fingerprints
    from trainers.run.run_dir import RUN_CONFIG_NAME

    try:
        data = json.loads((run_dir / RUN_CONFIG_NAME).read_text(encoding="utf-8"))
        return {k: v for k, v in dict(data.get("fingerprints") or {}).items() if isinstance(v, str)}
    except (OSError, ValueError, TypeError):
        return {}
