#!/usr/bin/env python3
"""Reliability campaign: attack the trainer on the demo config and count what kept its promises.

    python benchmarks/reliability_campaign.py [--seed 1] [--kills 10] [--signals 6] [--quick | --smoke]
                                              [--parts kills,signals,corruptions,inputs]
                                              [--lora-rank R] [--sample-interval N] [--family indextts25]
                                              [--work-dir DIR] [--keep] [--json FILE]

The promises under attack (README.md, docs/reliability.md): stopping and resuming never changes the result
(bit-identical on the same machine), nothing a user has is ever lost, and bad input gets a
clear error (exit status 2, naming the flag, file or line), never a traceback.

Parts:

  kills        Two uninterrupted reference runs (background saves off and on; they must agree
               with each other), then --kills trials. Each trial starts a run and SIGKILLs it,
               either after a random wall-clock delay or at an exact point drawn from the
               fault-injection grammar (trainers/faults.py: micro:N:J mid accumulation,
               step:N, save:N:tmp_written|renamed|linked, best.pth's save:N:best_tmp_written|
               best_renamed, validation:N, setup; with --sample-interval also generate:N:0,
               mid-generation), then resumes it
               with `--resume auto` (killed again 0-2 more times) until it finishes. Delays are
               drawn over the length of the rest of the run, as the reference runs timed it here;
               a run killed before it wrote run_config.json is started again with its command.
               Background saves are off, on, or switched at random per invocation. Each resume
               that gets as far as saying where it resumes must start from the newest complete
               checkpoint and print no "damaged" warning; the end must equal the reference:
               every model and optimizer tensor torch.equal, the same position, the same
               sample_ids.tsv (with --sample-interval: every validation's sample set, equal to
               the reference's, and no temporary file left under samples/), and latest.pth naming
               the newest model_step file. Then three fixed trials (not with --smoke): a run killed
               between the final model_step file's rename and latest.pth's link (the resume has
               nothing to train and must still repair latest.pth), a finished run resumed with
               a new end and --rewarm, killed before the continuation's first save (at start-up's
               end, mid-step or after a step), which `--resume auto` alone must continue to the end
               of the uninterrupted continuation (a third reference run), and the finished run
               branched into a new directory the same way (--resume its latest.pth --output-dir
               NEW), killed before the branch's first save: `--resume auto --output-dir NEW` alone
               must end as the uninterrupted branch (a fourth reference run).
  signals      --signals trials: SIGTERM, SIGINT or SIGHUP (sometimes twice) at a random instant.
               Expected: exit 128+N (the kernel's default, reported as -N, is accepted too before
               start-up finished, when nothing was trained; never once the trainer is exiting, which
               ignores stop signals), or 0 when it finished before the signal (or had logged its last
               step: only the final validation, save and exit were left), a
               checkpoint at the step the trainer says it stopped at, then an exact resume. A run
               that goes on for more than 0.5 s after the signal and ends with 0 lost the signal.
  corruptions  A finished reference run is copied and its newest checkpoint damaged (flipped
               byte in tensor data, in the pickle, in the zip directory, truncation, a zeroed
               range, garbage, an edited field re-saved without new checksums, removed or
               dangling latest.pth, several or all checkpoints damaged, a damaged best.pth or
               named file). `tools/inspect_checkpoint.py --verify` must say 1 for a damaged file;
               `--resume auto` must warn naming it, rename it aside with its bytes kept, resume
               from the newest intact checkpoint and end bit-identical to the reference (or stop
               with status 2 and change nothing when no checkpoint is intact). Damage that leaves
               the loaded content identical (a zip CRC or timestamp) is counted as harmless. Then
               what the tools read: an adapter file with a flipped tensor byte, which
               indextts-merge-lora must refuse (status 2, naming it; the intact file merges), and
               (not with --smoke) the newest checkpoint damaged, which indextts-export must refuse
               by name and pass over when exporting the run directory (the newest intact one,
               with a note; the run directory unchanged).
  inputs       109 bad inputs (37 flags, 14 config, 17 manifest, 10 feature files, 8 base
               checkpoint, 4 tokenizer, 18 run directory, two trainers on one directory). Each is
               run in this process through trainers.train_gpt_v2.main (argparse's SystemExit is
               its status), or in a subprocess where the case is about processes, and classified:
               clear error (status 2, no traceback, the message names the flag/key/file), traceback,
               accepted silently, or other; a refused run must also leave the output directory as
               it was (not created when it did not exist). Feature file contents are checked when
               a sample is first read (trainers/data/features.py), after the run has started: there
               a clear error that keeps the run directory for `--resume auto` keeps the promise and
               is counted apart, as "clear error after start-up". Then (not with --smoke) sample sets
               that cannot be written mid-run, on a short run with --sample-interval 1: a directory
               where a set goes, and a full disk under samples/ (a 64 KiB tmpfs, filled; skipped
               with a note without root). The run must warn naming the set, train on and save its
               final checkpoint, status 0: "warned, trained on".

--quick trains a 12-step run instead of 40, with 3 kill and 3 signal trials unless given (and the three
fixed ones), 4 corruption and 8 input cases (and the tools' and sample sets' cases; see
docs/reliability.md for its time). --smoke (for tests/test_benchmarks.py) trains 6 steps, with one
kill trial (one SIGKILL), one signal trial, 2 corruption cases and the damaged adapter file, and 3
input cases: every part once, to check that the script runs.

--family indextts25 runs the kills, signals and corruptions on the IndexTTS-2.5 demo (checkpoints/demo25.yaml,
its corpus, tiktoken file and base) instead of IndexTTS2's; its bad inputs are those of tests/test_indextts25.py,
so the inputs part (written for IndexTTS2's files) is refused there.
The reference runs are built whatever --parts says: every part compares with or copies them.
The campaign's folder (runs, logs) is made under --work-dir and kept, or in the temporary
directory and deleted unless --keep.

Prints one table, then every trial that broke its promise with the reason, and exits 1 if any
did (0 otherwise; 2 on bad usage or when the reference runs fail), so the script doubles as a
check. Wall-clock kills are drawn from --seed but where they land depends on the machine's
speed; the exact kill points, damage and inputs are reproducible. Trainer subprocesses and this
process use one intra-op thread (as tests/demo_runs.py does), so in-process and subprocess runs
compute the same floats.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

SCRIPT = REPO / "trainers" / "train_gpt_v2.py"
FAULT_VARS = ("INDEXTTS_TRAIN_KILL_AT", "INDEXTTS_TRAIN_OOM_ABOVE", "INDEXTTS_TRAIN_OOM_AT",
              "INDEXTTS_TRAIN_NAN_FROM", "INDEXTTS_TRAIN_NAN_WEIGHTS_AT")
LOCK_NAME = ".trainer.lock"  # its content names the last holder: not part of what a run "has"
PARTS = ("kills", "signals", "corruptions", "inputs")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# ----------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """The run every trial trains: steps, checkpoint and validation cadence, micro-batches per step."""

    steps: int
    save_every: int
    val_every: int
    accumulation: int = 2
    keep: int = 3
    lora_rank: int = 0  # > 0: every run trains LoRA adapters of this rank (with adapter dropout) instead
    sample_interval: int = 0  # > 0: every run also generates samples at validation (the trainer's --sample-interval)

    def flags(self) -> list[str]:
        lora = ["--lora-rank", str(self.lora_rank), "--lora-dropout", "0.1"] if self.lora_rank else []
        lora += ["--sample-interval", str(self.sample_interval)] if self.sample_interval else []
        return ["--batch-size", "8", "--grad-accumulation", str(self.accumulation), "--max-steps", str(self.steps),
                "--save-interval", str(self.save_every), "--val-interval", str(self.val_every),
                "--max-val-batches", "1", "--log-sample-ids", "--dropout", "0.1",
                "--keep-checkpoints", str(self.keep), "--log-interval", "10", *lora]

    def saves(self) -> list[int]:
        return [n for n in range(self.save_every, self.steps, self.save_every)] + [self.steps]

    def validations(self) -> list[int]:
        return [0, *range(self.val_every, self.steps, self.val_every), self.steps]


FULL = Plan(steps=40, save_every=5, val_every=10)
QUICK = Plan(steps=12, save_every=3, val_every=6)
SMOKE = Plan(steps=6, save_every=2, val_every=3)
SMOKE_CORRUPTIONS = ("newest: flip a byte in tensor data", "every checkpoint damaged")
SMOKE_INPUTS = ("unknown flag", "bad JSON on line 3")  # and the two trainers on one directory


# ------------------------------------------------------------------------------------------ processes


@dataclass
class Outcome:
    """One trainer invocation."""

    args: list[str]
    status: int | None
    seconds: float
    stderr: str
    attack: str = ""  # what was done to it: "SIGKILL@step:7", "SIGKILL after 3.2 s", ...
    sent: list[float] = field(default_factory=list)  # seconds after start at which a signal was actually sent
    said: list[str] = field(default_factory=list)  # what the trainer had logged when each signal was sent

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.stderr.splitlines()[-lines:])

    def gist(self) -> str:
        return gist(self.stderr)

    def warnings(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if " WARNING " in line]

    def resumed_step(self) -> int | None:
        """The step the trainer said it resumed from (None: it started at step 0)."""
        marker = "resuming from "
        for line in self.stderr.splitlines():
            if marker in line and "(step " in line:
                try:
                    return int(line.split("(step ", 1)[1].split(",", 1)[0])
                except ValueError:
                    return None
        return None


def gist(text: str) -> str:
    """The line of a log that says what went wrong: a fatal error, the last exception, the first ERROR (the
    trainer's message; advice follows it), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if ln.startswith(("terminate called", "Fatal Python error"))]
    raised = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception|Exit|Interrupt)\b", ln)]
    logged = [ln for ln in lines if " ERROR " in ln]
    return (fatal or raised[-1:] or logged[:1] or lines[-1:] or ["(no output)"])[0]


def run_timing(result: Outcome, steps: int) -> tuple[float, float]:
    """(start-up seconds, seconds per step) of a finished run, from its "first optimizer step finished" line."""
    marker = "first optimizer step finished "
    line = next((ln for ln in result.stderr.splitlines() if marker in ln), None)
    startup = float(line.split(marker, 1)[1].split()[0]) if line else result.seconds / 2
    return startup, max(0.01, (result.seconds - startup) / max(1, steps - 1))


def child_env(kill_at: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FAULT_VARS}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if kill_at:
        env["INDEXTTS_TRAIN_KILL_AT"] = kill_at
    return env


def run_subprocess(out: Path, args: list[str], log: Path, kill_at: str | None = None,
                   signals: list[tuple[float, int]] | None = None, timeout: float = 600) -> Outcome:
    """The trainer in a process of its own; `signals`: (seconds after start, signal) sent from outside."""
    argv = [sys.executable, str(SCRIPT), "--output-dir", str(out), *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(argv, cwd=REPO, env=child_env(kill_at), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)
        sent: list[float] = []
        said: list[str] = []
        for at, signum in signals or []:
            try:
                proc.wait(timeout=max(0.0, at - (time.monotonic() - t0)))
                break  # it ended before the signal was due
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signum)
                sent.append(time.monotonic() - t0)
                said.append(log.read_text(encoding="utf-8", errors="replace"))
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
    return Outcome(argv[2:], status, time.monotonic() - t0, log.read_text(encoding="utf-8", errors="replace"),
                   sent=sent, said=said)


def run_in_process(args: list[str]) -> Outcome:
    """trainers.train_gpt_v2.main in this process; an escaping exception is reported as status 1 with its traceback."""
    from trainers.main import main

    saved = {k: os.environ.pop(k) for k in FAULT_VARS if k in os.environ}
    err, out = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                status = main(list(args))
            except SystemExit as exc:  # argparse: usage errors exit 2, --help 0
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:  # what the real entry point would print before exiting 1
                traceback.print_exc(file=err)
                status = 1
    finally:
        os.environ.update(saved)
    return Outcome(list(args), status, time.monotonic() - t0, err.getvalue() + out.getvalue())


# ------------------------------------------------------------------------------------- run directories


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True, map_location="cpu")


def _diff_nested(a: Any, b: Any, where: str, out: list[str]) -> None:
    if len(out) >= 5:
        return
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
            out.append(f"{where} differs")
    elif isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            out.append(f"{where}: keys differ")
            return
        for k in a:
            _diff_nested(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            out.append(f"{where}: length differs")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff_nested(x, y, f"{where}[{i}]", out)
    elif a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
        out.append(f"{where}: {a!r} != {b!r}")


class Reference:
    """A finished uninterrupted run, held in memory for comparisons."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.state = load(run / "latest.pth")
        self.sample_ids = (run / "sample_ids.tsv").read_text(encoding="utf-8")
        self.sample_sets = sample_sets(run)

    def differences(self, run: Path) -> list[str]:
        """[] when `run` ended exactly where the reference did: position, model, optimizer, sample ids."""
        final = final_checkpoint(run)
        try:
            other = load(final)
        except Exception as exc:  # noqa: BLE001 - any failure to read is a difference
            return [f"{final.name} unreadable: {type(exc).__name__}: {exc}"]
        found: list[str] = []
        for section, key in (("progress", "step"), ("data", "epoch"), ("data", "step_in_epoch")):
            a, b = self.state[section][key], other.get(section, {}).get(key)
            if a != b:
                found.append(f"{section}.{key}: {b!r} instead of {a!r}")
        _diff_nested(self.state["model"], other.get("model"), "model", found)
        _diff_nested(self.state["optim"]["optimizer"], other.get("optim", {}).get("optimizer"), "optimizer", found)
        ids = run / "sample_ids.tsv"
        if not ids.is_file() or ids.read_text(encoding="utf-8") != self.sample_ids:
            found.append("sample_ids.tsv differs")
        if self.sample_sets:  # --sample-interval: every validation's set, whole and equal, and no leftover
            theirs = sample_sets(run)
            if sorted(theirs) != sorted(self.sample_sets):
                found.append(f"sample sets of steps {sorted(theirs)} instead of {sorted(self.sample_sets)}")
            found += [f"the sample set of step {step} differs" for step in sorted(set(theirs) & set(self.sample_sets))
                      if theirs[step] != self.sample_sets[step]]
            leftovers = sorted(p.name for p in (run / "samples").iterdir() if p.name.startswith("."))
            if leftovers:
                found.append(f"temporary files left in samples/: {leftovers}")
        return found


def sample_sets(run: Path) -> dict[int, tuple]:
    """Each sample set under RUN_DIR/samples by step, as comparable values: ids, codes, stopped flags, metrics."""
    from trainers.run.sample_sets import list_sets, read_step

    sets = {}
    for step in list_sets(run):
        s = read_step(run, step)
        sets[step] = (tuple(s.ids), tuple(tuple(c.tolist()) for c in s.codes), tuple(s.stopped),
                      tuple(sorted(s.metrics.items())))
    return sets


def step_files(run: Path) -> list[int]:
    steps = []
    for p in run.glob("model_step*.pth"):
        middle = p.name[len("model_step"):-len(".pth")]
        if middle.isdigit() and p.is_file():
            steps.append(int(middle))
    return sorted(steps)


def final_checkpoint(run: Path) -> Path:
    """What --resume auto would continue: latest.pth, or without a usable one the newest step file.

    A finished run that is resumed has nothing to do and saves nothing, so a removed or dangling
    latest.pth stays as it was and its state is in the newest step file."""
    latest = run / "latest.pth"
    steps = step_files(run)
    if latest.exists() or not steps:
        return latest
    return run / f"model_step{steps[-1]}.pth"


def latest_behind(run: Path) -> str | None:
    """After a finished run: None when latest.pth names its newest model_step file, else what it names instead."""
    steps = step_files(run)
    latest = run / "latest.pth"
    if not steps or (latest.exists() and os.path.samefile(latest, run / f"model_step{steps[-1]}.pth")):
        return None
    named = [s for s in steps if latest.exists() and os.path.samefile(latest, run / f"model_step{s}.pth")]
    return (f"latest.pth names model_step{named[0]}.pth, not the newest model_step{steps[-1]}.pth" if named else
            f"latest.pth {'is missing' if not latest.exists() else 'names no model_step file'}; the newest is "
            f"model_step{steps[-1]}.pth")


def newest_saved_step(run: Path) -> int:
    steps = step_files(run)
    return steps[-1] if steps else 0


def snapshot(path: Path) -> dict[str, str] | None:
    """Every entry under `path` and its content digest (None: `path` does not exist)."""
    if not os.path.lexists(path):
        return None
    if not path.is_dir():
        return {".": _digest_of(path)}
    found = {}
    for root, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            p = Path(root, name)
            rel = str(p.relative_to(path))
            if name == LOCK_NAME:
                continue
            found[rel] = _digest_of(p)
    return found


def _digest_of(p: Path) -> str:
    if p.is_symlink():
        return "symlink->" + os.readlink(p)
    if p.is_dir():
        return "dir"
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError as exc:
        return f"unreadable {exc.strerror}"


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run directory in which latest.pth is again a hard link to its step file."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("latest.pth", LOCK_NAME))
    twin = next(p for p in src.glob("model_step*.pth") if os.path.samefile(p, src / "latest.pth"))
    os.link(dst / twin.name, dst / "latest.pth")
    return dst


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ part 1: kills


@dataclass
class Campaign:
    work: Path
    seed: int
    plan: Plan
    assets: list[str]
    quick: bool
    smoke: bool = False
    references: dict[str, Reference] = field(default_factory=dict)
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timing: tuple[float, float] = (4.5, 0.2)  # start-up s, s per step (incl. saves, validations): measured below

    def rng(self, *key: object) -> random.Random:
        return random.Random(":".join(str(k) for k in (self.seed, *key)))

    def estimated_seconds(self, from_step: int) -> float:
        """Length of an invocation that starts at `from_step`, from the reference runs' timing on this machine."""
        startup, per_step = self.timing
        return startup + per_step * (self.plan.steps - from_step)

    # -- references

    def build_references(self) -> None:
        timings = []
        for mode in ("off", "on"):
            out = self.work / "reference" / f"background_{mode}"
            flag = "--background-saves" if mode == "on" else "--no-background-saves"
            result = run_subprocess(out, [*self.assets, *self.plan.flags(), flag], out.parent / f"{mode}.log")
            if result.status != 0:
                raise CampaignError(f"the reference run (background saves {mode}) failed with status {result.status}:"
                                    f"\n{result.tail()}")
            self.references[mode] = Reference(out)
            timings.append(run_timing(result, self.plan.steps))
        # Wall-clock kills and signals are drawn over the length of a run here, so they land all over it.
        self.timing = (max(t[0] for t in timings), max(t[1] for t in timings))
        differs = self.references["off"].differences(self.references["on"].run)
        self.results["references"] = [{"name": "background saves on == off", "ok": not differs,
                                       "verdict": "bit-identical" if not differs else "differing",
                                       "problems": differs}]

    # -- kill points

    def exact_points(self, rng: random.Random, saved: int, fresh: bool) -> str:
        """A kill point that lies ahead of the newest checkpoint (step `saved`), category first."""
        p = self.plan
        ahead = range(saved + 1, p.steps + 1)
        choices: dict[str, list[str]] = {
            "micro": [f"micro:{n}:{j}" for n in ahead for j in range(p.accumulation)],
            "step": [f"step:{n}" for n in ahead],
            "save": [f"save:{n}:{ev}" for n in p.saves() if n > saved for ev in ("tmp_written", "renamed", "linked")],
            "best": [f"save:{n}:best_{ev}" for n in p.validations() if n > saved or (n == 0 and fresh)
                     for ev in ("tmp_written", "renamed")],  # best.pth, written at a validation
            "validation": [f"validation:{n}" for n in p.validations() if n > saved or (n == 0 and fresh)],
        }
        if p.sample_interval:  # after the first batch generated at a validation, before its set is written
            choices["generate"] = [f"generate:{n}:0" for n in p.validations() if (n > saved or (n == 0 and fresh))
                                   and (n % p.sample_interval == 0 or n == p.steps)]
        if rng.random() < 0.05:
            return "setup"
        category = rng.choice([c for c, pts in choices.items() if pts])
        return rng.choice(choices[category])

    def kills(self, count: int) -> None:
        records = []
        for i in range(count):
            records.append(self.kill_trial(i))
            r = records[-1]
            print(f"  kill trial {i + 1}/{count}: {r['verdict']:<14} {r['attacks']}", flush=True)
        if not self.smoke:  # the kills that once left the run behind: at the final save, after a plan change or branch
            for trial in (self.final_save_trial, self.plan_change_trial, self.branch_trial):
                records.append(trial(len(records)))
                r = records[-1]
                print(f"  kill trial {r['name']}: {r['verdict']:<14} {r['attacks']}", flush=True)
        self.results["kills"] = records

    def final_save_trial(self, i: int) -> dict[str, Any]:
        """Killed between the final model_step file's rename and latest.pth's link: the resume has nothing to
        train and must still leave latest.pth naming that newest checkpoint."""
        out = self.work / "kills" / f"trial{i:02d}" / "run"
        point = f"save:{self.plan.steps}:renamed"
        runs, problems = self.killed_then_resumed(out, [*self.assets, *self.plan.flags()], point, "", "nothing to do")
        return self.fixed_record(i, "final save, killed between rename and link", out, runs, problems)

    def plan_change_trial(self, i: int) -> dict[str, Any]:
        """A finished run continued with a new end and a re-warm, killed before the continuation's first save:
        `--resume auto` alone must train the continuation, as the uninterrupted continuation did."""
        out = copy_run(self.references["off"].run, self.work / "kills" / f"trial{i:02d}" / "run")
        steps = self.plan.steps
        point = self.rng("plan change", i).choice(["setup", f"micro:{steps + 1}:0", f"step:{steps + 1}"])
        runs, problems = self.killed_then_resumed(out, ["--resume", "auto", *self.longer_plan()], point,
                                                  f" (resumed with {' '.join(self.longer_plan())})",
                                                  "continuing the plan")
        return self.fixed_record(i, "plan change, killed before its first save", out, runs, problems,
                                 self.extended_reference())

    def branch_trial(self, i: int) -> dict[str, Any]:
        """The finished run branched into a new directory (--resume ITS/latest.pth --output-dir NEW) with a new end,
        killed before the branch's first save: `--resume auto` alone must continue the branch from that checkpoint,
        as the uninterrupted branch did (never start over from the base model)."""
        out = self.work / "kills" / f"trial{i:02d}" / "run"
        origin = self.references["off"].run / "latest.pth"
        steps = self.plan.steps
        point = self.rng("branch", i).choice(["setup", f"micro:{steps + 1}:0", f"step:{steps + 1}"])
        runs, problems = self.killed_then_resumed(out, ["--resume", str(origin), *self.longer_plan()], point,
                                                  f" (a branch of {origin} with {' '.join(self.longer_plan())})",
                                                  "continuing its branch")
        return self.fixed_record(i, "branch, killed before its first save", out, runs, problems,
                                 self.branch_reference())

    def killed_then_resumed(self, out: Path, args: list[str], point: str, about: str,
                            said: str) -> tuple[list[Outcome], list[str]]:
        """`args` SIGKILLed at `point`, then `--resume auto` alone, which must exit 0 saying `said`."""
        first = run_subprocess(out, [*args, "--no-background-saves"], out.parent / "invocation0.log", kill_at=point)
        first.attack = f"SIGKILL@{point}{about}"
        problems = [] if first.status == -signal.SIGKILL else [f"the kill at {point} did not land: status "
                                                               f"{first.status}\n{first.tail()}"]
        second = run_subprocess(out, ["--resume", "auto"], out.parent / "invocation1.log")
        second.attack = "--resume auto"
        if second.status != 0 or said not in second.stderr:
            problems.append(f"the resume exited {second.status} without saying \"{said}\":\n{second.tail()}")
        return [first, second], problems

    def longer_plan(self) -> list[str]:
        return ["--max-steps", str(self.plan.steps + self.plan.save_every), "--rewarm"]

    def extended_reference(self) -> Reference:
        """The reference run continued, uninterrupted, with `longer_plan` (built once)."""
        if "extended" not in self.references:
            out = copy_run(self.references["off"].run, self.work / "reference" / "extended")
            result = run_in_process(["--output-dir", str(out), "--resume", "auto", *self.longer_plan(),
                                     "--no-background-saves"])
            if result.status != 0:
                raise CampaignError(f"the extended reference run failed with status {result.status}:\n{result.tail()}")
            self.references["extended"] = Reference(out)
        return self.references["extended"]

    def branch_reference(self) -> Reference:
        """The reference run branched, uninterrupted, into a new directory with `longer_plan` (built once)."""
        if "branch" not in self.references:
            out = self.work / "reference" / "branch"
            result = run_in_process(["--output-dir", str(out), "--resume", str(self.references["off"].run / "latest.pth"),
                                     *self.longer_plan(), "--no-background-saves"])
            if result.status != 0:
                raise CampaignError(f"the branch reference run failed with status {result.status}:\n{result.tail()}")
            self.references["branch"] = Reference(out)
        return self.references["branch"]

    def fixed_record(self, i: int, name: str, out: Path, invocations: list[Outcome], problems: list[str],
                     reference: Reference | None = None) -> dict[str, Any]:
        problems += [f"invocation {n} printed a traceback:\n{o.tail()}" for n, o in enumerate(invocations)
                     if "Traceback" in o.stderr]
        finished = invocations[-1].status == 0
        behind = latest_behind(out) if finished else None
        if behind:
            problems.append(behind)
        differs = (reference or self.references["off"]).differences(out) if finished else []
        verdict = "crashed" if not finished else "differing" if differs else \
            ("bit-identical" if not problems else "broke a promise")
        landed = sum(o.status == -signal.SIGKILL for o in invocations)
        return {"trial": i, "name": name, "background_saves": "off", "kills": landed, "verdict": verdict,
                "ok": verdict == "bit-identical", "attacks": [o.attack for o in invocations],
                "statuses": [o.status for o in invocations], "resumed_from": [o.resumed_step() for o in invocations],
                "problems": problems + differs, "dir": str(out.parent)}

    def kill_trial(self, i: int) -> dict[str, Any]:
        rng = self.rng("kill", i)
        mode = rng.choice(["off", "on", "mixed"])
        trial = self.work / "kills" / f"trial{i:02d}"
        out = trial / "run"
        kills_wanted = 1 if self.smoke else rng.choice([1, 1, 2, 2, 3])
        invocations: list[Outcome] = []
        problems: list[str] = []
        kills_done = 0
        for n in range(kills_wanted + 4):  # a few spare invocations for kills that never landed
            # Killed before run_config.json was written, nothing names the run: the user repeats the command.
            fresh = not (out / "run_config.json").is_file()
            args = [*self.assets, *self.plan.flags()] if fresh else ["--resume", "auto"]
            background = mode == "on" or (mode == "mixed" and rng.random() < 0.5)
            args.append("--background-saves" if background else "--no-background-saves")
            saved = newest_saved_step(out) if out.exists() else 0
            log = trial / f"invocation{n}.log"
            if kills_done < kills_wanted and saved < self.plan.steps:  # a finished run has nothing left to kill
                if rng.random() < 0.6:
                    point = self.exact_points(rng, saved, saved == 0)  # every start from step 0 validates first
                    result = run_subprocess(out, args, log, kill_at=point)
                    result.attack = f"SIGKILL@{point}"
                else:
                    delay = round(rng.uniform(0.3, 0.9 * self.estimated_seconds(saved)), 2)
                    result = run_subprocess(out, args, log, signals=[(delay, signal.SIGKILL)])
                    result.attack = f"SIGKILL after {delay} s"
            else:
                result = run_subprocess(out, args, log)
                result.attack = "to the end"
            result.attack += " [bg]" if background else ""
            invocations.append(result)
            if not fresh:
                resumed = result.resumed_step()
                said_nothing = resumed is None and result.status == -signal.SIGKILL  # killed before it said
                if saved and resumed != saved and not said_nothing:
                    problems.append(f"invocation {n} resumed from step {resumed}, the newest complete checkpoint is "
                                    f"step {saved}")
                damaged = [w for w in result.warnings() if "damaged" in w or "corrupt" in w]
                if damaged:
                    problems.append(f"invocation {n}: a kill left a damaged checkpoint: {damaged[0]}")
            if "Traceback" in result.stderr:
                problems.append(f"invocation {n} printed a traceback:\n{result.tail()}")
            if result.status == -signal.SIGKILL:
                kills_done += 1
                continue
            if result.status == 0:  # the run is complete: nothing is left to kill
                if result.attack.startswith("SIGKILL@"):
                    problems.append(f"invocation {n}: the kill point {result.attack} was never reached")
                break
            problems.append(f"invocation {n} ({result.attack}) exited with status {result.status}: {result.gist()}\n"
                            f"{result.tail()}")
            break
        finished = invocations[-1].status == 0
        if not finished:
            verdict = "crashed"
        else:
            behind = latest_behind(out)
            if behind:
                problems.append(behind)
            differs = self.references["on" if mode == "on" else "off"].differences(out)
            problems += differs
            verdict = "differing" if differs else ("bit-identical" if not problems else "broke a promise")
        return {"trial": i, "background_saves": mode, "kills": kills_done, "verdict": verdict,
                "ok": verdict == "bit-identical", "attacks": [o.attack for o in invocations],
                "statuses": [o.status for o in invocations], "resumed_from": [o.resumed_step() for o in invocations],
                "problems": problems, "dir": str(trial)}

    # -- part 1b: stop signals

    def signals(self, count: int) -> None:
        records = []
        for i in range(count):
            records.append(self.signal_trial(i))
            r = records[-1]
            print(f"  signal trial {i + 1}/{count}: {r['verdict']:<14} {r['attack']} -> status {r['statuses']}",
                  flush=True)
        self.results["signals"] = records

    def signal_trial(self, i: int) -> dict[str, Any]:
        rng = self.rng("signal", i)
        signum = STOP_SIGNALS[i % len(STOP_SIGNALS)] if i < len(STOP_SIGNALS) else rng.choice(STOP_SIGNALS)
        twice = rng.random() < 0.25
        background = rng.random() < 0.5
        delay = round(rng.uniform(0.5, 0.9 * self.estimated_seconds(0)), 2)
        trial = self.work / "signals" / f"trial{i:02d}"
        out = trial / "run"
        sends = [(delay, signum)] + ([(delay + round(rng.uniform(0.0, 0.3), 2), signum)] if twice else [])
        flag = "--background-saves" if background else "--no-background-saves"
        name = signal.Signals(signum).name
        attack = f"{name}{' x2' if twice else ''} after {delay} s{' [bg]' if background else ''}"
        first = run_subprocess(out, [*self.assets, *self.plan.flags(), flag], trial / "invocation0.log",
                               signals=sends)
        problems: list[str] = []
        outcomes = [first]
        expected = 128 + signum
        trained = "first optimizer step finished" in first.stderr
        if "Traceback" in first.stderr:
            problems.append(f"a traceback after {name}:\n{first.tail()}")
        last_step_done = bool(first.said) and f"step {self.plan.steps}/{self.plan.steps} " in first.said[0]
        if first.status == 0 and first.sent and first.seconds - first.sent[0] > 0.5 and not last_step_done:
            # Not a race with the exit: it went on for a while after the signal, then ended as if none came.
            verdict_note = "ignored the signal"
            problems.append(f"the {name} sent {first.sent[0]:.2f} s after start was lost: the run went on for "
                            f"{first.seconds - first.sent[0]:.1f} s and finished with status 0")
        elif first.status == 0:
            verdict_note = "finished before the signal"
        elif first.status == expected:
            verdict_note = "stopped"
            stop_line = [ln for ln in first.stderr.splitlines() if "stopped by signal at step" in ln]
            if stop_line and not twice:
                step = int(stop_line[-1].split("at step ", 1)[1].split(";", 1)[0])
                have = load(out / "latest.pth")["progress"]["step"] if (out / "latest.pth").exists() else None
                if have != step:
                    problems.append(f"stopped at step {step} but latest.pth holds step {have}")
            elif not stop_line and trained and "second stop signal" not in first.stderr and \
                    "training finished" not in first.stderr:
                problems.append(f"status {expected} without saying where it stopped:\n{first.tail()}")
        elif first.status == -signum and not trained:
            verdict_note = "stopped before start-up finished (kernel default)"
        else:
            verdict_note = "wrong status"
            problems.append(f"{name}: exit status {first.status}, expected {expected}: {first.gist()}\n{first.tail()}")
        for n in range(1, 4):
            if outcomes[-1].status == 0 or problems:
                break
            # Stopped before run_config.json was written: nothing names the run, the user repeats the command.
            again = ["--resume", "auto"] if (out / "run_config.json").is_file() else [*self.assets, *self.plan.flags()]
            result = run_subprocess(out, [*again, flag], trial / f"invocation{n}.log")
            outcomes.append(result)
            if result.status != 0 or "Traceback" in result.stderr:
                problems.append(f"resume after {name} exited {result.status}:\n{result.tail()}")
            damaged = [w for w in result.warnings() if "damaged" in w or "corrupt" in w]
            if damaged:
                problems.append(f"a stop signal left a damaged checkpoint: {damaged[0]}")
        differs: list[str] = []
        if outcomes[-1].status == 0:
            differs = self.references["on" if background else "off"].differences(out)
        if differs:
            verdict = "differing"
        elif outcomes[-1].status != 0 or any("Traceback" in o.stderr for o in outcomes):
            verdict = "crashed"
        elif problems:
            verdict = "broke a promise"
        else:
            verdict = "bit-identical"
        problems += differs
        return {"trial": i, "signal": name, "twice": twice, "background_saves": background, "delay_s": delay,
                "attack": attack, "first": verdict_note, "trained": trained, "statuses": [o.status for o in outcomes],
                "verdict": verdict, "ok": not problems and outcomes[-1].status == 0, "problems": problems,
                "dir": str(trial)}


class CampaignError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------ part 2: corruptions


def zip_layout(path: Path) -> dict[str, Any]:
    """Byte ranges of a torch zip checkpoint: tensor data records, the pickle, local headers, central directory.

    torch writes its records uncompressed, so a record's bytes sit in the file as they are."""
    data = path.read_bytes()
    records, headers, pickle = [], [], None
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            h = info.header_offset
            name_len = int.from_bytes(data[h + 26:h + 28], "little")
            extra_len = int.from_bytes(data[h + 28:h + 30], "little")
            start = h + 30 + name_len + extra_len
            headers.append((h, start))
            if info.filename.endswith("/data.pkl"):
                pickle = (start, info.file_size)
            elif "/data/" in info.filename and info.file_size:
                records.append((start, info.file_size))
    eocd = data.rfind(b"PK\x05\x06")
    central = int.from_bytes(data[eocd + 16:eocd + 20], "little")
    if central == 0xFFFFFFFF:  # zip64: the directory offset is in the zip64 end record
        z64 = data.rfind(b"PK\x06\x06")
        central = int.from_bytes(data[z64 + 48:z64 + 56], "little")
    return {"records": records, "pickle": pickle, "headers": headers, "central": (central, len(data))}


def write_in_place(path: Path, offset: int, chunk: bytes) -> None:
    """Overwrite bytes of the file itself: every hard link sees it, as with damage on the disk."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(chunk)


def flip_at(path: Path, offset: int, rng: random.Random) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        byte = f.read(1)[0]
    mask = 1 << rng.randrange(8)
    write_in_place(path, offset, bytes([byte ^ mask]))
    return f"byte {offset} 0x{byte:02x} -> 0x{byte ^ mask:02x}"


def damage_tensor_byte(path: Path, rng: random.Random) -> str:
    start, size = rng.choice(zip_layout(path)["records"])
    return "tensor data: " + flip_at(path, start + rng.randrange(size), rng)


def damage_pickle_byte(path: Path, rng: random.Random) -> str:
    start, size = zip_layout(path)["pickle"]
    return "data.pkl: " + flip_at(path, start + rng.randrange(size), rng)


def damage_zip_directory(path: Path, rng: random.Random) -> str:
    layout = zip_layout(path)
    if rng.random() < 0.5:
        lo, hi = layout["central"]
        return "central directory: " + flip_at(path, rng.randrange(lo, hi), rng)
    lo, hi = rng.choice(layout["headers"])
    return "local file header: " + flip_at(path, rng.randrange(lo, hi), rng)


def damage_truncate(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    keep = rng.randrange(size)
    os.truncate(path, keep)
    return f"truncated to {keep} of {size} bytes"


def damage_zero_range(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    length = rng.randint(1, 4096)
    offset = rng.randrange(size - length)
    write_in_place(path, offset, bytes(length))
    return f"zeroed bytes {offset}..{offset + length - 1}"


def damage_garbage(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    write_in_place(path, 0, rng.randbytes(size))
    return f"replaced by {size} random bytes"


FIELD_EDITS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("progress.step - 1", lambda o: o["progress"].__setitem__("step", o["progress"]["step"] - 1)),
    ("data.epoch + 1", lambda o: o["data"].__setitem__("epoch", o["data"]["epoch"] + 1)),
    ("run.config.learning_rate x 2",
     lambda o: o["run"]["config"].__setitem__("learning_rate", o["run"]["config"]["learning_rate"] * 2)),
    ("progress.samples_seen + 16",
     lambda o: o["progress"].__setitem__("samples_seen", o["progress"]["samples_seen"] + 16)),
]


def edited_bytes(path: Path, rng: random.Random) -> tuple[bytes, str]:
    obj = load(path)
    what, edit = rng.choice(FIELD_EDITS)
    edit(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)  # the old "integrity" record is kept as it was
    return buf.getvalue(), what


def damage_edit_field(path: Path, rng: random.Random) -> str:
    data, what = edited_bytes(path, rng)
    with open(path, "r+b") as f:  # the same file: both names see the edit
        f.truncate(0)
        f.write(data)
    return f"edited {what}, re-saved with the old checksums"


DAMAGES: dict[str, Callable[[Path, random.Random], str]] = {
    "flip a byte in tensor data": damage_tensor_byte,
    "flip a byte in the pickle": damage_pickle_byte,
    "flip a byte in the zip directory": damage_zip_directory,
    "truncate": damage_truncate,
    "zero a range": damage_zero_range,
    "replace with garbage": damage_garbage,
    "edit a field, old checksums": damage_edit_field,
}


@dataclass
class Expect:
    status: int = 0
    resumed: int | None = None  # the step the resume must start from (None: nothing to do or refused)
    damaged: list[str] = field(default_factory=list)  # names whose data is damaged: warned about, set aside
    warn: list[str] = field(default_factory=list)  # other words a WARNING must contain
    unchanged: bool = False  # a refusal: the run directory stays exactly as it was
    needles: list[str] = field(default_factory=list)  # words the refusal must contain


def corruption_cases(c: Campaign) -> list[tuple[str, Callable[[Path, random.Random], tuple[str, Expect, list[Path]]]]]:
    """(name, setup) pairs; setup damages a copy of the reference run and says what --resume auto must do."""
    p = c.plan
    last, prev, third = p.steps, p.saves()[-2], p.saves()[-3]

    def newest(kind: str):
        def setup(run: Path, rng: random.Random):
            what = DAMAGES[kind](run / f"model_step{last}.pth", rng)  # latest.pth is the same file
            return what, Expect(resumed=prev, damaged=[f"model_step{last}.pth"]), [run / f"model_step{last}.pth"]
        return setup

    def two_newest(run: Path, rng: random.Random):
        a = DAMAGES["flip a byte in tensor data"](run / f"model_step{last}.pth", rng)
        b = DAMAGES["truncate"](run / f"model_step{prev}.pth", rng)
        return (f"step {last}: {a}; step {prev}: {b}",
                Expect(resumed=third, damaged=[f"model_step{last}.pth", f"model_step{prev}.pth"]),
                [run / f"model_step{last}.pth", run / f"model_step{prev}.pth"])

    def all_damaged(run: Path, rng: random.Random):
        for s in step_files(run):
            rng.choice([damage_tensor_byte, damage_truncate, damage_garbage])(run / f"model_step{s}.pth", rng)
        return ("every model_step file damaged",
                Expect(status=2, unchanged=True, needles=["no intact checkpoint"]), [])

    def latest_edited_alone(run: Path, rng: random.Random):
        data, what = edited_bytes(run / "latest.pth", rng)
        (run / "latest.pth").unlink()  # a file of its own now; model_step{last} keeps the original
        (run / "latest.pth").write_bytes(data)
        return (f"latest.pth alone: edited {what}",
                Expect(resumed=None, damaged=["latest.pth"]), [run / "latest.pth"])

    def step_file_removed(run: Path, rng: random.Random):
        (run / f"model_step{last}.pth").unlink()
        return (f"model_step{last}.pth removed (latest.pth, its hard link, remains)", Expect(resumed=None), [])

    def latest_removed(run: Path, rng: random.Random):
        (run / "latest.pth").unlink()
        return "latest.pth removed", Expect(resumed=None, warn=["latest.pth"]), []

    def latest_dangling(run: Path, rng: random.Random):
        (run / "latest.pth").unlink()
        os.symlink("model_step99999.pth", run / "latest.pth")
        return "latest.pth a dangling symlink to model_step99999.pth", Expect(resumed=None, warn=["latest.pth"]), []

    def symlinked_latest_target_removed(run: Path, rng: random.Random):
        (run / "latest.pth").unlink()
        (run / f"model_step{last}.pth").unlink()
        os.symlink(f"model_step{last}.pth", run / "latest.pth")
        return (f"latest.pth a symlink to model_step{last}.pth, which was removed",
                Expect(resumed=prev, warn=["latest.pth"]), [])

    def damaged_best_resumed(run: Path, rng: random.Random):
        what = damage_tensor_byte(run / "best.pth", rng)
        return (f"best.pth: {what}; --resume best",
                Expect(status=2, unchanged=True, needles=["best.pth"]), [run / "best.pth"])

    def damaged_named(run: Path, rng: random.Random):
        what = damage_edit_field(run / f"model_step{prev}.pth", rng)
        return (f"model_step{prev}.pth: {what}; --resume model_step{prev}.pth",
                Expect(status=2, unchanged=True, needles=[f"model_step{prev}.pth"]), [run / f"model_step{prev}.pth"])

    cases = [(f"newest: {kind}", newest(kind)) for kind in DAMAGES]
    cases += [("two newest damaged", two_newest), ("every checkpoint damaged", all_damaged),
              ("latest.pth alone edited", latest_edited_alone), ("step file behind latest.pth removed", step_file_removed),
              ("latest.pth removed", latest_removed), ("latest.pth dangling symlink", latest_dangling),
              ("symlinked latest.pth, target removed", symlinked_latest_target_removed),
              ("damaged best.pth, --resume best", damaged_best_resumed),
              ("damaged file named by --resume", damaged_named)]
    if c.quick:
        keep = {"newest: flip a byte in tensor data", "newest: edit a field, old checksums", "every checkpoint damaged",
                "latest.pth dangling symlink"}
        cases = [case for case in cases if case[0] in keep]
    if c.smoke:
        cases = [case for case in cases if case[0] in SMOKE_CORRUPTIONS]
    return cases


def inspect_verify(path: Path) -> tuple[int, str]:
    from trainers.tools.inspect_checkpoint import main as inspect_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = inspect_main([str(path), "--verify"])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001
            traceback.print_exc(file=err)
            status = -1  # the tool itself crashed
    return status, out.getvalue() + err.getvalue()


def content_equal(a: Any, path: Path) -> bool:
    try:
        b = load(path)
    except Exception:  # noqa: BLE001
        return False
    found: list[str] = []
    _diff_nested(a, b, "", found)
    return not found


def corruptions(c: Campaign) -> None:
    ref = c.references["off"]
    records = []
    for i, (name, setup) in enumerate(corruption_cases(c)):
        rng = c.rng("corrupt", name)
        run = copy_run(ref.run, c.work / "corruptions" / f"case{i:02d}" / "run")
        originals = {p.name: load(p) for p in run.glob("*.pth") if p.is_file()}
        what, expect, damaged_paths = setup(run, rng)
        problems: list[str] = []
        harmless = bool(damaged_paths) and all(
            p.name in originals and content_equal(originals[p.name], p) for p in damaged_paths)
        if harmless:  # the bytes changed where torch never looks (a CRC, a timestamp): still a good checkpoint
            expect = Expect(resumed=None) if expect.status == 0 else expect
        damaged_digests = {p.name: sha(p) for p in damaged_paths if p.is_file()}
        # inspect_checkpoint --verify on each damaged file: 1 when its content changed
        verify = []
        for p in damaged_paths:
            status, text = inspect_verify(p)
            verify.append(status)
            if not harmless and status != 1:
                problems.append(f"inspect_checkpoint --verify {p.name}: status {status}, expected 1: "
                                f"{text.strip()[-300:]}")
            if "Traceback" in text:
                problems.append(f"inspect_checkpoint --verify {p.name} printed a traceback")
        before = snapshot(run)
        if name == "damaged best.pth, --resume best":
            args = ["--output-dir", str(run), "--resume", "best"]
        elif name == "damaged file named by --resume":
            args = ["--output-dir", str(run), "--resume", str(damaged_paths[0])]
        else:
            args = ["--output-dir", str(run), "--resume", "auto"]
        result = run_in_process(args)
        (run.parent / "resume.log").write_text(result.stderr, encoding="utf-8")
        if "Traceback" in result.stderr:
            problems.append(f"traceback:\n{result.tail()}")
        if result.status != expect.status:
            problems.append(f"status {result.status}, expected {expect.status}:\n{result.tail()}")
        if expect.needles and not any(n in result.stderr for n in expect.needles):
            problems.append(f"the refusal does not name {expect.needles}:\n{result.tail()}")
        if expect.unchanged and snapshot(run) != before:
            problems.append("the refused resume changed the run directory")
        resumed = result.resumed_step()
        missed = False
        if expect.status == 0:
            if resumed != expect.resumed and not (expect.resumed is None and resumed == c.plan.steps):
                problems.append(f"resumed from step {resumed}, expected {expect.resumed or c.plan.steps}")
                missed = not harmless and resumed == c.plan.steps and bool(expect.damaged)
            warnings = result.warnings()
            for bad in ([] if harmless else expect.damaged):
                names = {bad, "latest.pth"} if bad == f"model_step{c.plan.steps}.pth" else {bad}
                if not any(any(n in w for n in names) and ("damaged" in w or "corrupt" in w) for w in warnings):
                    problems.append(f"no WARNING names the damaged {bad}")
                if (run / bad).exists() and bad in damaged_digests and sha(run / bad) == damaged_digests[bad]:
                    problems.append(f"the damaged {bad} was left in place")
            for word in expect.warn:
                if not any(word in w for w in warnings):
                    problems.append(f"no WARNING mentions {word}")
            # nothing is lost: the damaged bytes are kept under some name in the run directory
            kept = {sha(p) for p in run.iterdir() if p.is_file()}
            for bad, digest in damaged_digests.items():
                if digest not in kept:
                    problems.append(f"the damaged {bad} was deleted (its bytes are nowhere in the run directory)")
            if result.status == 0:
                problems += ref.differences(run)
        if not problems:
            verdict = "harmless" if harmless else ("detected" if damaged_paths or expect.damaged else "handled")
        elif missed or any("differs" in p or "instead of" in p for p in problems):
            verdict = "missed"
        else:
            verdict = "failed"
        records.append({"case": name, "damage": what, "verdict": verdict, "ok": not problems,
                        "status": result.status, "resumed_from": resumed, "inspect_verify": verify,
                        "problems": problems, "dir": str(run.parent)})
        print(f"  corruption {i + 1:2d}: {verdict:<9} {name} ({what})", flush=True)
    for case in tool_cases(c):  # what the tools read: an adapter file to merge, a checkpoint to export
        records.append(case(c, len(records)))
        r = records[-1]
        print(f"  corruption {len(records):2d}: {r['verdict']:<9} {r['case']} ({r['damage']})", flush=True)
    c.results["corruptions"] = records


def tool_cases(c: Campaign) -> list[Callable[[Campaign, int], dict[str, Any]]]:
    """The merge of a damaged adapter file; the export of a damaged checkpoint, named and as a run's newest."""
    return [damaged_adapter_file] if c.smoke else [damaged_adapter_file, damaged_export]


def run_tool(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str, str]:
    """A tool's main() in this process: (status, stdout, stderr); an escaping exception is status -1."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001
            traceback.print_exc(file=err)
            status = -1
    return status, out.getvalue(), err.getvalue()


def tool_record(name: str, what: str, problems: list[str], folder: Path, status: int) -> dict[str, Any]:
    return {"case": name, "damage": what, "verdict": "detected" if not problems else "missed", "ok": not problems,
            "status": status, "resumed_from": None, "inspect_verify": [], "problems": problems, "dir": str(folder),
            "tool": True}


def damaged_adapter_file(c: Campaign, i: int) -> dict[str, Any]:
    """An adapter file with a flipped byte in tensor data: indextts-merge-lora must refuse it (exit 2, naming the
    file), write nothing, and merge the intact file."""
    from trainers.checkpoint import adapter_file
    from trainers.files import file_sha256
    from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
    from trainers.model.lora import LoraSettings, add_adapters, adapter_state_dict
    from trainers.model.lora_file import AdapterFile
    from trainers.tools.merge_lora import main as merge_main

    rng = c.rng("adapter file", i)
    folder = c.work / "corruptions" / f"case{i:02d}"
    folder.mkdir(parents=True)
    base = Path(c.assets[c.assets.index("--base-checkpoint") + 1])
    gpt = yaml.safe_load((REPO / "checkpoints" / "demo.yaml").read_text(encoding="utf-8"))["gpt"]
    model = UnifiedVoiceGPT(GPTConfig.from_yaml_section(gpt))
    settings = LoraSettings(rank=4, alpha=8.0)
    add_adapters(model, settings, seed=rng.randrange(2**31))
    adapters = {k: v.detach() + (0.01 if k.endswith(".lora_b") else 0.0) for k, v in adapter_state_dict(model).items()}
    path = folder / "voice.lora.pth"
    adapter_file.write(AdapterFile(settings, str(base), file_sha256(base), adapters), path)
    problems = []
    status, _, err = run_tool(merge_main, ["--adapter", str(path), "--base", str(base), "--out", str(folder / "ok.pth")])
    if status != 0:
        problems.append(f"the intact adapter file did not merge: status {status}: {gist(err)}")
    what = damage_tensor_byte(path, rng)
    status, _, err = run_tool(merge_main, ["--adapter", str(path), "--base", str(base), "--out", str(folder / "m.pth")])
    if status != 2 or "damaged adapter file" not in err or str(path) not in err:
        problems.append(f"the merge of the damaged file exited {status}: {gist(err) if err else '(no message)'}")
    if (folder / "m.pth").exists() or "Traceback" in err:
        problems.append("the refused merge wrote its --out" if (folder / "m.pth").exists() else "a traceback")
    return tool_record("adapter file merged", what, problems, folder, status)


def damaged_export(c: Campaign, i: int) -> dict[str, Any]:
    """The newest checkpoint damaged: exporting it by name is refused (exit 2, naming it); exporting the run directory
    exports the newest intact one, as --resume auto would continue it, and says so; the run directory is unchanged."""
    from tests.demo_runs import full_config
    from trainers.tools.export_checkpoint import main as export_main

    rng = c.rng("export", i)
    folder = c.work / "corruptions" / f"case{i:02d}"
    run = copy_run(c.references["off"].run, folder / "run")
    config = full_config(folder / "config.yaml")
    last, prev = c.plan.steps, c.plan.saves()[-2]
    newest = run / f"model_step{last}.pth"
    what = damage_tensor_byte(newest, rng)
    before = snapshot(run)
    problems = []
    status, _, err = run_tool(export_main, [str(newest), "--out", str(folder / "named"), "--config", str(config)])
    if status != 2 or str(newest) not in err or "does not match the checksums" not in err:
        problems.append(f"exporting the damaged {newest.name} exited {status}: {gist(err) if err else '(no message)'}")
    if (folder / "named").exists():
        problems.append("the refused export created its --out")
    status, out, err = run_tool(export_main, [str(run), "--out", str(folder / "dir"), "--config", str(config)])
    record = folder / "dir" / "export.json"
    step = json.loads(record.read_text(encoding="utf-8"))["step"] if record.is_file() else None
    if status != 0 or step != prev or f"exported model_step{prev}.pth, the newest intact checkpoint" not in out:
        problems.append(f"exporting the run directory exited {status} with step {step}, expected model_step{prev}: "
                        f"{gist(err + out)}")
    if snapshot(run) != before:
        problems.append("the export changed the run directory")
    return tool_record("checkpoint exported", what, problems, folder, status)


# ------------------------------------------------------------------------------------- part 3: bad inputs

SHORT = ["--max-steps", "2", "--save-interval", "1", "--val-interval", "0", "--max-val-batches", "1",
         "--log-interval", "1"]


@dataclass
class CaseEnv:
    """A case's own folder, the demo assets, and helpers that write bad files into the folder."""

    folder: Path
    assets: dict[str, Path]
    reference: Path
    out: Path = Path()

    def argv(self, *extra: str, train: Any = "", val: Any = "", tokenizer: Any = "", base: Any = "") -> list[str]:
        """Demo flags with some replaced ("" keeps the demo's file, None leaves the flag out), then `extra`."""
        chosen = {"--train-manifest": train, "--val-manifest": val, "--tokenizer": tokenizer, "--base-checkpoint": base}
        args = ["--demo"]
        for flag, value in chosen.items():
            if value is not None:
                args += [flag, str(value if value != "" else self.assets[flag])]
        return [*args, *SHORT, *extra]

    def write(self, name: str, content: str | bytes) -> Path:
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return path

    def npy(self, name: str, array: np.ndarray) -> Path:
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, array)
        return path

    def lines(self, which: str = "--train-manifest") -> list[dict[str, Any]]:
        """The demo manifest's lines with every feature path made absolute (so a copy may live anywhere)."""
        src = self.assets[which]
        rows = []
        for line in src.read_text(encoding="utf-8").splitlines():
            obj = json.loads(line)
            for k, v in list(obj.items()):
                if k.endswith("_path") and isinstance(v, str):
                    obj[k] = str(src.parent / v)
            rows.append(obj)
        return rows

    def manifest(self, name: str, rows: list[Any], raw: dict[int, bytes] | None = None) -> Path:
        """Rows as JSONL; `raw` replaces line i (0-based) by bytes as they are."""
        out = []
        for i, row in enumerate(rows):
            out.append(raw[i] if raw and i in raw else json.dumps(row).encode())
        return self.write(name, b"\n".join(out) + b"\n")

    def all_lines(self, which: str, **changes: Any) -> Path:
        """A copy of a demo manifest with the same fields changed on every line."""
        rows = [{**row, **changes} for row in self.lines(which)]
        return self.manifest(which.strip("-") + ".jsonl", rows)

    def config(self, edit: Callable[[dict[str, Any]], Any], name: str = "config.yaml") -> Path:
        data = yaml.safe_load((REPO / "checkpoints" / "demo.yaml").read_text(encoding="utf-8"))
        edit(data)
        return self.write(name, yaml.safe_dump(data, sort_keys=False))

    def base(self, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
        obj = load(self.assets["--base-checkpoint"])
        edit(obj["model"])
        path = self.folder / "gpt.pth"
        torch.save(obj, path)
        return path

    def run_copy(self) -> Path:
        self.out = copy_run(self.reference, self.folder / "run")
        return self.out


@dataclass(frozen=True)
class InputCase:
    name: str
    group: str
    build: Callable[[CaseEnv], list[str]]  # the arguments after --output-dir
    needles: tuple[str, ...]  # the message must contain one of these (the flag, key, file or line)
    existing_run: bool = False  # True: --output-dir is a copy of a finished run, which must stay unchanged


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node = data
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    return edit


def _first(rows: list[dict[str, Any]], **changes: Any) -> list[dict[str, Any]]:
    return [{**rows[0], **changes}, *rows[1:]]


def _drop(rows: list[dict[str, Any]], line: int, key: str) -> list[dict[str, Any]]:
    rows = [dict(r) for r in rows]
    del rows[line][key]
    return rows


def _tensor(key: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(model: dict[str, torch.Tensor]) -> None:
        model[key] = change(model[key])
    return edit


def _nan_at(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = float("nan")
    return t


def _inf_at(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("inf")
    return t


def flag_cases() -> list[InputCase]:
    def f(name: str, *extra: str, needles: tuple[str, ...] | None = None) -> InputCase:
        flag = extra[0].split("=")[0]
        return InputCase(name, "flags", lambda e: e.argv(*extra), needles or (flag,))

    return [
        f("negative learning rate", "--learning-rate", "-1e-3"),
        f("learning rate above 1", "--learning-rate", "5"),
        f("learning rate nan", "--learning-rate", "nan"),
        f("learning rate not a number", "--learning-rate", "abc"),
        f("negative max steps", "--max-steps", "-5"),
        f("fractional max steps", "--max-steps", "1.5"),
        f("max steps beyond 2**31", "--max-steps", "99999999999"),
        f("effective batch 0", "--effective-batch", "0"),
        f("negative batch size", "--batch-size", "-1"),
        f("dropout 1", "--dropout", "1.0"),
        f("negative dropout", "--dropout", "-0.1"),
        f("weight decay 2", "--weight-decay", "2"),
        f("negative seed", "--seed", "-1"),
        f("seed 2**64", "--seed", str(2**64)),
        f("100000 workers", "--num-workers", "100000"),
        f("save interval 0", "--save-interval", "0"),
        f("log interval 0", "--log-interval", "0"),
        f("epochs 0", "--epochs", "0"),
        f("infinite grad clip", "--grad-clip", "inf"),
        f("both loss weights 0", "--text-loss-weight", "0", "--mel-loss-weight", "0"),
        f("batch x accumulation != effective batch", "--batch-size", "8", "--grad-accumulation", "3",
          "--effective-batch", "16", needles=("--effective-batch",)),
        f("cuda on a machine without it", "--device", "cuda") if not torch.cuda.is_available()
        else f("cuda device index out of range", "--device", "cuda:64"),
        f("unknown device", "--device", "banana"),
        f("unknown data order", "--data-order", "sideways"),
        f("unknown flag", "--no-such-flag", needles=("--no-such-flag",)),
        f("more train samples than the data has", "--train-samples", "100000"),
        f("epochs whose steps overflow", "--epochs", "1000000000", "--max-steps", "0", needles=("--epochs",)),
        f("--additional-epochs on a new run", "--additional-epochs", "2"),
        f("--scale-lr on a new run", "--scale-lr", "linear"),
        f("--data-root without =", "--data-root", "nonsense"),
        f("min lr ratio 1.5", "--min-lr-ratio", "1.5"),
        f("negative val batch size", "--val-batch-size", "-3"),
        f("warmup steps written 1e3", "--warmup-steps", "1e3"),
        f("unknown best metric", "--best-metric", "accuracy"),
        f("negative lr decay steps", "--lr-decay-steps", "-1"),
        f("negative keep checkpoints", "--keep-checkpoints", "-1"),
        f("learning rate given twice, second bad", "--learning-rate", "1e-4", "--learning-rate", "-inf"),
    ]


def config_cases() -> list[InputCase]:
    def c(name: str, make: Callable[[CaseEnv], Path], needles: tuple[str, ...]) -> InputCase:
        return InputCase(name, "config", lambda e: e.argv("--config", str(make(e))), needles)

    return [
        c("missing config file", lambda e: e.folder / "missing.yaml", ("--config",)),
        c("config not YAML", lambda e: e.write("config.yaml", "gpt: [unclosed\n  - : :\n"), ("--config",)),
        c("config without gpt section", lambda e: e.write("config.yaml", "dataset:\n  bpe_model: bpe.model\n"),
          ("gpt",)),
        c("config gpt is a list", lambda e: e.write("config.yaml", "gpt:\n  - 1\n  - 2\n"), ("gpt",)),
        c("config is a directory", lambda e: e.folder, ("--config",)),
        c("gpt.layers -2", lambda e: e.config(_set("gpt.layers", -2)), ("gpt.layers",)),
        c("gpt.model_dim a word", lambda e: e.config(_set("gpt.model_dim", "sixty-four")), ("gpt.model_dim",)),
        c("gpt.layers true", lambda e: e.config(_set("gpt.layers", True)), ("gpt.layers",)),
        c("gpt.heads not dividing model_dim", lambda e: e.config(_set("gpt.heads", 3)), ("gpt.heads",)),
        c("gpt.max_text_tokens below the data", lambda e: e.config(_set("gpt.max_text_tokens", 4)),
          ("max_text_tokens",)),
        c("gpt.number_mel_codes against the specials", lambda e: e.config(_set("gpt.number_mel_codes", 99)),
          ("number_mel_codes", "start_mel_token")),
        c("gpt.number_text_tokens negative", lambda e: e.config(_set("gpt.number_text_tokens", -5)),
          ("number_text_tokens",)),
        c("gpt.model_dim missing", lambda e: e.config(lambda d: d["gpt"].pop("model_dim")), ("gpt.model_dim",)),
        c("nonsense gpt key (typo of layers)", lambda e: e.config(_set("gpt.layrs", 6)), ("layrs",)),
    ]


def manifest_cases() -> list[InputCase]:
    def m(name: str, make: Callable[[CaseEnv], Path], needles: tuple[str, ...], which: str = "train") -> InputCase:
        def build(e: CaseEnv) -> list[str]:
            path = make(e)
            return e.argv(train=path) if which == "train" else e.argv(val=path)
        return InputCase(name, "manifest", build, needles)

    return [
        m("missing manifest", lambda e: e.folder / "nope.jsonl", ("nope.jsonl",)),
        m("manifest is a directory", lambda e: e.folder, (str(Path("case")),)),
        m("bad JSON on line 3", lambda e: e.manifest("t.jsonl", e.lines(), raw={2: b'{"id": "x", '}), ("t.jsonl:3",)),
        m("missing field on line 2", lambda e: e.manifest("t.jsonl", _drop(e.lines(), 1, "target_codes_path")),
          ("t.jsonl:2",)),
        m("text length beyond the config", lambda e: e.manifest("t.jsonl", _first(e.lines(), target_text_len=9999)),
          ("t.jsonl:1",)),
        m("code length as a string", lambda e: e.manifest("t.jsonl", _first(e.lines(), target_code_len="42")),
          ("t.jsonl:1",)),
        m("code length 0", lambda e: e.manifest("t.jsonl", _first(e.lines(), target_code_len=0)), ("t.jsonl:1",)),
        m("non-UTF-8 bytes on line 4",
          lambda e: e.manifest("t.jsonl", e.lines(), raw={3: json.dumps(e.lines()[3]).encode().replace(
              b'"en"', b'"\xff\xfe"')}), ("t.jsonl:4",)),
        m("feature path is a directory", lambda e: e.manifest("t.jsonl", _first(e.lines(),
                                                                               target_codes_path=str(e.folder))),
          ("t.jsonl:1",)),
        m("absolute path to a missing file",
          lambda e: e.manifest("t.jsonl", _first(e.lines(), prompt_condition_path="/nonexistent/cond.npy")),
          ("t.jsonl:1",)),
        m("feature path /dev/null", lambda e: e.manifest("t.jsonl", _first(e.lines(), prompt_emo_vec_path="/dev/null")),
          ("t.jsonl:1",)),
        m("empty manifest", lambda e: e.write("t.jsonl", ""), ("t.jsonl",)),
        m("a JSON array line", lambda e: e.manifest("t.jsonl", [[1, 2], *e.lines()[1:]]), ("t.jsonl:1",)),
        m("binary file as manifest", lambda e: e.write("t.jsonl", e.assets["--tokenizer"].read_bytes()), ("t.jsonl",)),
        m("empty id", lambda e: e.manifest("t.jsonl", _first(e.lines(), id="")), ("t.jsonl:1",)),
        m("empty ::lang suffix", lambda e: Path(str(e.assets["--train-manifest"]) + "::"), ("::",)),
        m("bad validation manifest line",
          lambda e: e.manifest("v.jsonl", e.lines("--val-manifest"), raw={0: b"not json"}), ("v.jsonl:1",), "val"),
    ]


def feature_cases() -> list[InputCase]:
    def x(name: str, make: Callable[[CaseEnv], Path], needles: tuple[str, ...], which: str = "train") -> InputCase:
        def build(e: CaseEnv) -> list[str]:
            path = make(e)
            return e.argv(train=path) if which == "train" else e.argv(val=path)
        return InputCase(name, "features", build, needles)

    def all_train(e: CaseEnv, key: str, array: np.ndarray, length_key: str | None = None) -> Path:
        bad = e.npy(f"bad_{key}.npy", array)
        changes: dict[str, Any] = {key: str(bad)}
        if length_key:
            changes[length_key] = int(array.shape[0])
        return e.all_lines("--train-manifest", **changes)

    emo_nan = np.full(64, np.nan, dtype=np.float32)
    return [
        x("NaN emotion vector (validation)",
          lambda e: e.all_lines("--val-manifest", emo_vec_path=str(e.npy("nan.npy", emo_nan))), ("nan.npy",), "val"),
        x("absurd conditioning values", lambda e: all_train(e, "prompt_condition_path",
                                                            np.full((32, 64), 1e30, dtype=np.float32)),
          ("bad_prompt_condition_path.npy",)),
        x("conditioning of another model_dim", lambda e: all_train(e, "prompt_condition_path",
                                                                   np.zeros((32, 80), dtype=np.float32)),
          ("bad_prompt_condition_path.npy",)),
        x("codes 2-D", lambda e: all_train(e, "target_codes_path", np.ones((40, 2), dtype=np.int32)),
          ("bad_target_codes_path.npy",)),
        x("text ids of float dtype", lambda e: all_train(e, "target_text_ids_path", np.ones(10, dtype=np.float32),
                                                         "target_text_len"), ("bad_target_text_ids_path.npy",)),
        x("code id beyond the mel vocabulary", lambda e: all_train(e, "target_codes_path",
                                                                   np.full(40, 200, dtype=np.int32), "target_code_len"),
          ("bad_target_codes_path.npy",)),
        x("negative text id", lambda e: all_train(e, "target_text_ids_path", np.full(10, -3, dtype=np.int32),
                                                  "target_text_len"), ("bad_target_text_ids_path.npy",)),
        x("codes shorter than the manifest says", lambda e: all_train(e, "target_codes_path",
                                                                      np.ones(3, dtype=np.int32)),
          ("bad_target_codes_path.npy",)),
        x("feature file that is not .npy", lambda e: e.all_lines(
            "--train-manifest", prompt_emo_vec_path=str(e.write("garbage.npy", b"\x00garbage" * 50))),
          ("garbage.npy",)),
        x("emotion vector of the wrong shape", lambda e: all_train(e, "prompt_emo_vec_path",
                                                                   np.zeros(7, dtype=np.float32)),
          ("bad_prompt_emo_vec_path.npy",)),
    ]


def base_and_tokenizer_cases() -> list[InputCase]:
    def b(name: str, make: Callable[[CaseEnv], Path], needles: tuple[str, ...]) -> InputCase:
        return InputCase(name, "base checkpoint", lambda e: e.argv(base=make(e)), needles)

    def t(name: str, make: Callable[[CaseEnv], Path], needles: tuple[str, ...]) -> InputCase:
        return InputCase(name, "tokenizer", lambda e: e.argv(tokenizer=make(e)), needles)

    layer = "gpt.h.0.attn.c_attn.weight"
    return [
        b("missing base checkpoint", lambda e: e.folder / "gpt.pth", ("gpt.pth",)),
        b("base checkpoint with a NaN", lambda e: e.base(_tensor(layer, _nan_at)), ("gpt.pth",)),
        b("base checkpoint with an inf", lambda e: e.base(_tensor("text_embedding.weight", _inf_at)), ("gpt.pth",)),
        b("base checkpoint with integer weights", lambda e: e.base(_tensor(layer, lambda t: t.to(torch.int64))),
          (layer,)),
        b("base checkpoint with a wrong shape", lambda e: e.base(_tensor(layer, lambda t: t[:, :96].clone())),
          (layer,)),
        b("base checkpoint of garbage", lambda e: e.write("gpt.pth", random.Random(3).randbytes(4096)), ("gpt.pth",)),
        b("base checkpoint holding no tensors", lambda e: _saved(e.folder / "gpt.pth", {"model": {"a": "b"}}),
          ("gpt.pth",)),
        b("base checkpoint is a directory", lambda e: e.folder, ("--base-checkpoint",)),
        t("tokenizer that is a text file", lambda e: e.write("bpe.model", "not a sentencepiece model\n"),
          ("--tokenizer",)),
        t("missing tokenizer", lambda e: e.folder / "bpe.model", ("--tokenizer",)),
        t("tokenizer is a directory", lambda e: e.folder, ("--tokenizer",)),
        t("tokenizer /dev/null", lambda e: Path("/dev/null"), ("--tokenizer",)),
    ]


def _saved(path: Path, obj: Any) -> Path:
    torch.save(obj, path)
    return path


def run_dir_cases() -> list[InputCase]:
    def r(name: str, build: Callable[[CaseEnv], list[str]], needles: tuple[str, ...], existing: bool) -> InputCase:
        return InputCase(name, "run directory", build, needles, existing)

    def resume_args(e: CaseEnv, *extra: str) -> list[str]:
        e.run_copy()
        return ["--resume", "auto", *extra]

    def out_is_file(e: CaseEnv) -> list[str]:
        e.out = e.write("a_file", "x")
        return e.argv()

    def out_under_dev_null(e: CaseEnv) -> list[str]:
        e.out = Path("/dev/null/run")
        return e.argv()

    def no_best(e: CaseEnv) -> list[str]:
        (e.run_copy() / "best.pth").unlink()
        return ["--resume", "best"]

    def bad_run_config(e: CaseEnv) -> list[str]:
        e.out = e.folder / "run"
        e.out.mkdir()
        (e.out / "run_config.json").write_text("{ half", encoding="utf-8")
        return ["--resume", "auto"]

    def other_runs_checkpoint(e: CaseEnv) -> list[str]:
        other = e.folder / "other"
        obj = load(e.reference / "latest.pth")
        obj["run"]["run_id"] = "0123456789abcdef"  # another run: the id is all that differs here
        from trainers.checkpoint import integrity  # recompute the checksums so only the identity is at stake
        obj.pop("integrity")
        obj["integrity"] = integrity.compute(obj)
        other.mkdir()
        torch.save(obj, other / "model_step1.pth")
        e.run_copy()
        return ["--resume", str(other / "model_step1.pth")]

    def changed_data(e: CaseEnv) -> list[str]:
        e.run_copy()
        rows = e.lines()[:-16]
        return ["--resume", "auto", "--train-manifest", str(e.manifest("t.jsonl", rows))]

    other_tokenizer = REPO / "tests" / "fixtures" / "v1_run" / "data" / "bpe.model"
    return [
        r("--output-dir is a regular file", out_is_file, ("a_file",), False),
        r("--output-dir under /dev/null", out_under_dev_null, ("/dev/null/run",), False),
        r("fresh start over an existing run", lambda e: (e.run_copy(), e.argv())[1], ("--resume auto",), True),
        r("resume with another seed", lambda e: resume_args(e, "--seed", "7"), ("seed",), True),
        r("resume with another effective batch", lambda e: resume_args(e, "--effective-batch", "32"),
          ("effective_batch", "effective batch"), True),
        r("resume with another dropout", lambda e: resume_args(e, "--dropout", "0.2"), ("dropout",), True),
        r("resume with other training data", changed_data, ("data", "manifest"), True),
        r("resume with another tokenizer file", lambda e: resume_args(e, "--tokenizer", str(other_tokenizer)),
          ("tokenizer",), True),
        r("--resume a tokenizer file", lambda e: ["--resume", str(e.assets["--tokenizer"])], ("bpe.model",), False),
        r("--resume a JSON file", lambda e: ["--resume", str(e.assets["--val-manifest"])], ("val.jsonl",), False),
        r("--resume an official gpt.pth", lambda e: ["--resume", str(e.assets["--base-checkpoint"])],
          ("--base-checkpoint",), False),
        r("--resume a missing file", lambda e: ["--resume", str(e.folder / "nope.pth")], ("--resume",), False),
        r("--resume a directory", lambda e: ["--resume", str(e.folder)], ("--resume",), False),
        r("--resume best without best.pth", no_best, ("best.pth",), True),
        r("--resume auto with a corrupt run_config.json", bad_run_config, ("run_config.json",), True),
        r("--resume another run's checkpoint into a run", other_runs_checkpoint, ("another run",), True),
        r("--additional-epochs with --max-steps", lambda e: resume_args(e, "--additional-epochs", "1",
                                                                       "--max-steps", "80"),
          ("--additional-epochs",), True),
        r("samples is a regular file (--sample-interval)", samples_a_file, ("samples",), False),
    ]


def samples_a_file(e: CaseEnv) -> list[str]:
    """A user's file named `samples` in the run directory: the sample sets cannot go there, refused at start-up."""
    e.out.mkdir(parents=True)
    (e.out / "samples").write_text("my notes\n", encoding="utf-8")
    return e.argv("--sample-interval", "1")


# Sample sets that cannot be written mid-run: a warning naming the file and the cause, and the run trains on and
# saves its checkpoints (a listening aid is not worth a checkpoint). (name, what is put under RUN/samples)
SAMPLE_WRITE_FAILURES = ("a directory where a sample set goes", "a full disk under samples/")


def sample_write_failure(c: Campaign, name: str, i: int) -> dict[str, Any] | None:
    """One of SAMPLE_WRITE_FAILURES on a short run with --sample-interval 1; None when it cannot be set up here (a
    tmpfs needs root)."""
    folder = c.work / "inputs" / f"case{i:02d}"
    out = folder / "run"
    (out / "samples").mkdir(parents=True)
    mounted = False
    if name.startswith("a directory"):
        (out / "samples" / "step_00000002.npz").mkdir()
    else:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(out / "samples")],
                                 capture_output=True).returncode == 0
        if not mounted:
            shutil.rmtree(folder)
            return None
        with open(out / "samples" / "filler", "wb", buffering=0) as f:  # a user's file fills the disk
            with contextlib.suppress(OSError):
                while f.write(b"x" * 4096):
                    pass
    case = InputCase(name, "run directory", lambda e: [], ("could not write the sample set",))
    env = CaseEnv(folder, dict(zip(c.assets[1::2], map(Path, c.assets[2::2]))), c.references["off"].run, out=out)
    try:
        result = run_in_process(["--output-dir", str(out), *env.argv("--sample-interval", "1")])
    finally:
        if mounted:
            subprocess.run(["umount", str(out / "samples")], check=False)
    saved = final_checkpoint(out)
    step = load(saved)["progress"]["step"] if saved.is_file() else None
    problems = []
    if "Traceback" in result.stderr or result.status != 0:
        problems.append(f"status {result.status}: {result.gist()}")
    if not any("could not write the sample set of step" in w and "samples" in w for w in result.warnings()):
        problems.append("no WARNING names the sample set that could not be written")
    if step != 2 or latest_behind(out):
        problems.append(f"the final checkpoint holds step {step}, expected 2; {latest_behind(out) or ''}")
    rec = record_input(case, result, "warned, trained on and saved" if not problems else "failed", not problems,
                       None, None, folder)
    rec["problems"] = problems
    return rec


def all_input_cases(quick: bool, smoke: bool = False) -> list[InputCase]:
    cases = [*flag_cases(), *config_cases(), *manifest_cases(), *feature_cases(), *base_and_tokenizer_cases(),
             *run_dir_cases()]
    if quick:
        keep = {"negative learning rate", "unknown flag", "bad JSON on line 3", "config not YAML",
                "tokenizer that is a text file", "resume with another seed", "samples is a regular file (--sample-interval)"}
        cases = [case for case in cases if case.name in keep]
    if smoke:
        cases = [case for case in cases if case.name in SMOKE_INPUTS]
    return cases


def classify(result: Outcome, needles: tuple[str, ...], untouched: bool, read_late: bool = False) -> tuple[str, bool]:
    """(category, kept its promise). `read_late`: a feature file's content, checked when the sample is first read."""
    if "Traceback" in result.stderr or result.status == 1:
        return "traceback", False
    if result.status == 0:
        return "accepted silently", False
    if result.status != 2:
        return f"other (status {result.status})", False
    if not any(n in result.stderr for n in needles):
        return "unclear error (names none of " + ", ".join(needles) + ")", False
    if not untouched:
        # Feature contents are checked when a sample is first read (trainers/data/features.py): the run has
        # started, and its directory stays so that --resume auto continues it once the file is fixed.
        if read_late and "continue with --resume auto" in result.stderr:
            return "clear error after start-up (run directory kept for --resume auto)", True
        return "clear error, but the output directory was changed", False
    return "clear error", True


def bad_inputs(c: Campaign) -> None:
    assets = dict(zip(c.assets[1::2], map(Path, c.assets[2::2])))
    records = []
    cases = all_input_cases(c.quick, c.smoke)
    for i, case in enumerate(cases):
        folder = c.work / "inputs" / f"case{i:02d}"
        folder.mkdir(parents=True)
        env = CaseEnv(folder, assets, c.references["off"].run, out=folder / "run")
        try:
            args = case.build(env)
        except Exception as exc:  # noqa: BLE001 - a campaign bug, not the trainer's
            records.append({"case": case.name, "group": case.group, "category": f"not run: {exc}", "ok": False,
                            "status": None, "message": traceback.format_exc()})
            print(f"  input {i + 1:3d}: not run ({exc})", flush=True)
            continue
        before = snapshot(env.out)
        result = run_in_process(["--output-dir", str(env.out), *args])
        after = snapshot(env.out)
        category, ok = classify(result, case.needles, after == before, read_late=case.group == "features")
        records.append(record_input(case, result, category, ok, before, after, folder))
        print(f"  input {i + 1:3d}: {input_label(records[-1]):<26} {case.group}: {case.name}", flush=True)
    records.append(two_trainers(c, len(cases)))
    r = records[-1]
    print(f"  input {len(cases) + 1:3d}: {input_label(r):<26} {r['group']}: {r['case']}", flush=True)
    for name in () if c.smoke else SAMPLE_WRITE_FAILURES:
        rec = sample_write_failure(c, name, len(records))
        if rec is None:
            c.notes.append(f"not run: {name} (mounting a tmpfs needs root)")
            continue
        records.append(rec)
        print(f"  input {len(records):3d}: {input_label(rec):<26} {rec['group']}: {name}", flush=True)
    c.results["inputs"] = records


def record_input(case: InputCase, result: Outcome, category: str, ok: bool, before: Any, after: Any,
                 folder: Path) -> dict[str, Any]:
    (folder / "trainer.log").write_text(result.stderr, encoding="utf-8")
    errors = [ln for ln in result.stderr.splitlines() if " ERROR " in ln or "error:" in ln]
    changed = None
    if before != after:
        if before is None:
            changed = f"created with {sorted(after or {})[:8]}"
        else:
            changed = sorted(k for k in set(before) | set(after or {}) if before.get(k) != (after or {}).get(k))[:8]
    return {"case": case.name, "group": case.group, "category": category, "ok": ok, "status": result.status,
            "args": result.args, "needles": list(case.needles), "message": "\n".join(errors)[:1500] or result.tail(),
            "output_dir_changed": changed, "seconds": round(result.seconds, 2)}


def two_trainers(c: Campaign, i: int) -> dict[str, Any]:
    """A second trainer on a directory a running trainer holds: refused, and the first one unharmed."""
    folder = c.work / "inputs" / f"case{i:02d}"
    out = folder / "run"
    case = InputCase("two trainers on one directory", "processes", lambda e: [], ("another trainer",))
    argv = [sys.executable, str(SCRIPT), "--output-dir", str(out), *c.assets, *c.plan.flags()]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "first.log", "w", encoding="utf-8") as err:
        first = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=err)
        # The first trainer locks the directory before it reads anything there: the second one starts while the
        # first still sets up (the moment a second trainer used to find no run and no lock).
        deadline = time.monotonic() + 300
        while not (out / LOCK_NAME).exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        locked = (out / LOCK_NAME).exists()
        result = run_in_process(["--output-dir", str(out), "--resume", "auto"])
        still_running = first.poll() is None
        first.send_signal(signal.SIGTERM)
        first_status = first.wait(timeout=120)
    category, ok = classify(result, case.needles, True)
    problems = []
    if not locked:
        problems.append("the first trainer had not locked its directory within 300 s: the case did not test the lock")
    if not still_running:
        problems.append("the first trainer had already ended: the case did not test the lock")
    if first_status not in (0, 128 + signal.SIGTERM):
        problems.append(f"the first trainer exited {first_status} after SIGTERM")
    else:  # the first trainer's run, continued to the end, is the reference run
        resumed = run_in_process(["--output-dir", str(out), "--resume", "auto"])
        if resumed.status != 0:
            problems.append(f"resuming the first trainer's run exited {resumed.status}:\n{resumed.tail()}")
        else:
            problems += c.references["off"].differences(out)
    rec = record_input(case, result, category if not problems else category + " (first run harmed)",
                       ok and not problems, None, None, folder)
    rec["problems"] = problems
    rec["first_trainer_status"] = first_status
    return rec


# ------------------------------------------------------------------------------------------------- report


@dataclass
class Row:
    """One line of the table: a part, its trials, how many kept the promise, and what happened to them."""

    part: str
    tried: int
    kept: int
    breakdown: list[tuple[str, int]]  # every trial in exactly one category
    note: str = ""  # a figure across categories

    def text(self) -> str:
        return "; ".join(filter(None, [self.note, ", ".join(f"{label} {n}" for label, n in self.breakdown)]))


def _count(labels: list[str], order: list[str]) -> list[tuple[str, int]]:
    """(label, count) in `order`, then any other label seen; labels of the order that never occur show 0."""
    seen = {label: labels.count(label) for label in labels}
    return [(label, seen.get(label, 0)) for label in order] + [(k, n) for k, n in seen.items() if k not in order]


def kill_label(r: dict[str, Any]) -> str:
    return {"bit-identical": "resumed bit-identically", "differing": "differed"}.get(r["verdict"], "failed")


def signal_label(r: dict[str, Any]) -> str:
    if r["verdict"] == "differing":
        return "differed"
    if not r["ok"]:
        return "failed"
    if r["first"].startswith("finished before the signal"):
        return "finished before the signal"
    if not r["trained"]:
        return "stopped before the first step, then bit-identical"
    return "stopped mid-run, resumed bit-identically"


def corruption_label(r: dict[str, Any]) -> str:
    if not r["ok"]:
        return "failed"
    if r.get("tool"):
        return "caught by merge/export"
    if r["verdict"] == "harmless":
        return "harmless"
    if r["status"] != 0:
        return "refused cleanly"
    return "fell back, ended bit-identical"


def input_label(r: dict[str, Any]) -> str:
    """A clear error (at start-up, or at a feature file's first read) keeps the promise; an unclear one, or one
    that changed the output directory, is "other"."""
    if r["ok"]:
        if r["category"].startswith("warned"):
            return "warned, trained on"
        return "clear error after start-up" if r["category"].startswith("clear error after") else "clear error"
    if r["category"].startswith(("traceback", "accepted silently")):
        return r["category"].split(" (", 1)[0]
    return "other"


def summarize(c: Campaign) -> list[Row]:
    rows = []
    refs = c.results.get("references", [])
    if refs:
        rows.append(Row("references", len(refs), sum(r["ok"] for r in refs),
                        _count([r["verdict"] for r in refs], ["bit-identical"])))
    if "kills" in c.results:
        rs = c.results["kills"]
        breakdown = _count([kill_label(r) for r in rs], ["resumed bit-identically", "differed", "failed"])
        attacks = [a for r in rs for a in r["attacks"] if a.startswith("SIGKILL")]
        exact = sum(a.startswith("SIGKILL@") for a in attacks)
        note = (f"{sum(r['kills'] for r in rs)} SIGKILLs landed of {len(attacks)} sent ({exact} at exact points, "
                f"{len(attacks) - exact} after a delay)")
        rows.append(Row("kills", len(rs), sum(r["ok"] for r in rs), breakdown, note))
    if "signals" in c.results:
        rs = c.results["signals"]
        rows.append(Row("signals", len(rs), sum(r["ok"] for r in rs), _count(
            [signal_label(r) for r in rs], ["stopped mid-run, resumed bit-identically", "stopped before the first "
                                           "step, then bit-identical", "finished before the signal", "differed",
                                           "failed"])))
    if "corruptions" in c.results:
        rs = c.results["corruptions"]
        verifiable = [r for r in rs if r["inspect_verify"] and r["verdict"] != "harmless"]
        detected = sum(all(s == 1 for s in r["inspect_verify"]) for r in verifiable)
        breakdown = _count([corruption_label(r) for r in rs],
                           ["fell back, ended bit-identical", "refused cleanly", "caught by merge/export", "harmless",
                            "failed"])
        note = f"damage detected by inspect_checkpoint --verify {detected}/{len(verifiable)}"
        rows.append(Row("corruptions", len(rs), sum(r["ok"] for r in rs), breakdown, note))
    if "inputs" in c.results:
        rs = c.results["inputs"]
        rows.append(Row("inputs", len(rs), sum(r["ok"] for r in rs), _count(
            [input_label(r) for r in rs],
            ["clear error", "clear error after start-up", "warned, trained on", "traceback", "accepted silently",
             "other"])))
    return rows


def render_table(rows: list[Row]) -> str:
    lines = [f"{'part':<12} {'tried':>5} {'kept':>5}  breakdown", "-" * 100]
    lines += [f"{r.part:<12} {r.tried:>5} {r.kept:>5}  {r.text()}" for r in rows]
    lines.append("-" * 100)
    lines.append(f"{'all':<12} {sum(r.tried for r in rows):>5} {sum(r.kept for r in rows):>5}")
    return "\n".join(lines)


def one_line(text: str, width: int = 220) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def reason(problems: list[str]) -> str:
    """Each problem's first line; one that ends in ':' before a log excerpt gets the excerpt's telling line."""
    said = []
    for p in problems:
        head, _, rest = p.partition("\n")
        said.append(f"{head} {gist(rest)}" if head.endswith(":") and rest.strip() else head)
    return "; ".join(said)


def failures(c: Campaign) -> list[tuple[str, str]]:
    """(trial, reason) for every trial that broke its promise, in the order they ran."""
    found = []
    for r in c.results.get("references", []):
        if not r["ok"]:
            found.append((f"references: {r['name']}", one_line(reason(r["problems"]))))
    for r in c.results.get("kills", []):
        if not r["ok"]:
            found.append((f"kills/trial{r['trial']:02d}{' ' + r['name'] if r.get('name') else ''} (background "
                          f"saves {r['background_saves']}; "
                          f"{' -> '.join(r['attacks'])})", one_line(f"{r['verdict']}: {reason(r['problems'])}")))
    for r in c.results.get("signals", []):
        if not r["ok"]:
            found.append((f"signals/trial{r['trial']:02d} ({r['attack']})",
                          one_line(f"{r['verdict']}, statuses {r['statuses']}: {reason(r['problems'])}")))
    for r in c.results.get("corruptions", []):
        if not r["ok"]:
            found.append((f"corruptions: {r['case']} ({r['damage']})",
                          one_line(f"{r['verdict']}: {reason(r['problems'])}")))
    for r in c.results.get("inputs", []):
        if not r["ok"]:
            extra = reason(r.get("problems", []))
            changed = f"; output dir changed: {r['output_dir_changed']}" if "changed" in r["category"] else ""
            found.append((f"inputs/{r['group']}: {r['case']}",
                          one_line(f"{r['category']} (status {r['status']}){changed}"
                                   f"{'; ' + extra if extra else ''}: {gist(r['message'])}")))
    return found


def machine() -> str:
    return (f"{socket.gethostname()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__} (1 intra-op thread), "
            f"device {'cuda' if torch.cuda.is_available() else 'cpu'}")


# --------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1, help="draws kill points, delays, damage and signals [1]")
    p.add_argument("--kills", type=int, help="kill trials [10; 3 with --quick]")
    p.add_argument("--signals", type=int, help="stop-signal trials [6; 3 with --quick]")
    p.add_argument("--quick", action="store_true",
                   help=f"a {QUICK.steps}-step run instead of {FULL.steps}, a few corruption and input cases")
    p.add_argument("--smoke", action="store_true", help=f"a {SMOKE.steps}-step run, every part once: checks the "
                   "script runs (seconds, for the test suite)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank in every run (the kills, signals and corruptions of a LoRA "
                        "run) [0: full fine-tuning]")
    p.add_argument("--sample-interval", type=int, default=0,
                   help="every run also generates samples at the validations of steps divisible by N, and each "
                        "run's sample sets must equal the reference's, with no temporary file left [0: off]")
    p.add_argument("--family", choices=("indextts2", "indextts25"), default="indextts2",
                   help="the model family whose demo every run trains [indextts2]; indextts25: without the inputs part")
    p.add_argument("--parts", help=f"comma-separated, of {', '.join(PARTS)} [all; with --family indextts25 all but "
                                   "inputs]")
    p.add_argument("--work-dir", type=Path,
                   help="make the campaign's folder under DIR and keep it (default: a temporary one, deleted)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (runs, logs) for inspection")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every trial's record to FILE")
    args = p.parse_args(argv)
    if args.parts is None:
        args.parts = ",".join(part for part in PARTS if args.family == "indextts2" or part != "inputs")
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if args.family == "indextts25" and "inputs" in args.parts:
        p.error("--parts inputs: its cases are written for IndexTTS2's files; the refusals of IndexTTS-2.5's inputs "
                "are tests/test_indextts25.py")
    unknown = [s for s in args.parts if s not in PARTS]
    if unknown or not args.parts:
        p.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}" if unknown
                else "--parts: name at least one part")
    if args.quick and args.smoke:
        p.error("--quick and --smoke: choose one")
    args.kills = (1 if args.smoke else 3 if args.quick else 10) if args.kills is None else args.kills
    args.signals = (1 if args.smoke else 3 if args.quick else 6) if args.signals is None else args.signals
    if args.kills < 0 or args.signals < 0:
        p.error("--kills and --signals must be >= 0")
    if args.json is not None and args.json.is_dir():
        p.error(f"--json {args.json}: a directory")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as the trainer subprocesses: in-process resumes compute the same floats
    plan = replace(SMOKE if args.smoke else QUICK if args.quick else FULL, lora_rank=args.lora_rank,
                   sample_interval=args.sample_interval)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"reliability_campaign-seed{args.seed}-", dir=args.work_dir))
    keep = args.keep or args.work_dir is not None
    t0 = time.monotonic()
    print(f"machine: {machine()}")
    print(f"campaign: seed {args.seed}, parts {', '.join(args.parts)}; {args.family} demo run of {plan.steps} steps, "
          f"a checkpoint "
          f"every {plan.save_every}, validation every {plan.val_every}, {plan.accumulation} micro-batches per step"
          f"{f', LoRA rank {plan.lora_rank}' if plan.lora_rank else ''}"
          f"{f', samples generated every {plan.sample_interval} steps' if plan.sample_interval else ''}; "
          f"work directory {work}", flush=True)
    campaign = Campaign(work, args.seed, plan, [], args.quick, args.smoke)
    try:
        from tests.demo_runs import demo25_flags, demo_flags  # the corpus, tokenizer and base the tests train on

        campaign.assets = (demo25_flags if args.family == "indextts25" else demo_flags)(work / "assets")
        print("references: two uninterrupted runs (background saves off, on)", flush=True)
        campaign.build_references()
        startup, per_step = campaign.timing
        print(f"  start-up {startup:.1f} s, then {per_step:.2f} s per step; background saves on == off: "
              f"{campaign.results['references'][0]['verdict']}", flush=True)
        # Every part compares with or copies the reference runs, so they are built whatever --parts says.
        for part in args.parts:
            started = time.monotonic()
            print(f"{part}:", flush=True)
            if part == "kills":
                campaign.kills(args.kills)
            elif part == "signals":
                campaign.signals(args.signals)
            elif part == "corruptions":
                corruptions(campaign)
            else:
                bad_inputs(campaign)
            campaign.notes.append(f"{part}: {time.monotonic() - started:.0f} s")
    except CampaignError as exc:
        print(f"campaign failed: {exc}", file=sys.stderr)
        return 2
    finally:
        if keep:
            print(f"runs and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - t0
    rows = summarize(campaign)
    failed = failures(campaign)
    print()
    print(render_table(rows))
    print(f"wall time {seconds / 60:.1f} min ({'; '.join(campaign.notes)}); seed {args.seed}")
    if failed:
        print(f"\n{len(failed)} trial(s) broke a promise:")
        for name, reason in failed:
            print(f"  {name}\n      {reason}")
    else:
        print("\nevery trial kept its promise")
    if args.json is not None:
        report = {"machine": machine(), "seed": args.seed, "quick": args.quick, "smoke": args.smoke,
                  "parts": args.parts, "family": args.family,
                  "plan": vars(plan), "seconds": round(seconds, 1), "work_dir": str(work) if keep else None,
                  "table": [{"part": r.part, "tried": r.tried, "kept": r.kept,
                             "breakdown": dict(r.breakdown), "note": r.note} for r in rows],
                  "failed": [{"trial": n, "reason": why} for n, why in failed], "results": campaign.results}
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
