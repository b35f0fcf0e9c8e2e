"""What every acceptance check is given: the machine, a work directory, the current check's deadline,
inputs and runs shared between checks, and the trainer started as a process (alone or under torchrun).

Every process a check starts gets this checkout on PYTHONPATH: the GPU machine runs a copy of the working
tree that is not pip-installed, where the trainer script would otherwise exit 2 ("no trainers package"),
and a machine with another checkout installed would run that one's code."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks.acceptance.corpus import IDX2, IDX25, OFFICIAL_CONFIG, read_gpt, write_official_25
from tests.demo_runs import REPO, SCRIPT, demo25_flags, demo_flags, subprocess_env
from trainers.model.gpt_model import GPTConfig

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
# A hung collective under torchrun ends after this many seconds instead of 30 minutes.
DDP_BACKSTOP = {"INDEXTTS_DDP_TIMEOUT_S": "120"}


class CheckTimeout(Exception):
    """The current check ran past its budget."""


@dataclass(frozen=True)
class Finished:
    """A finished trainer process: its exit status, its log (stderr) and how long it took."""

    args: list[str]
    returncode: int
    stderr: str
    seconds: float

    def tail(self, chars: int = 1500) -> str:
        return self.stderr[-chars:].strip()


def child_env(kill_at: str | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process a check starts: the tests' (one thread, no fault variables but those
    given), with this checkout first on PYTHONPATH."""
    full = subprocess_env(kill_at, env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full.get("PYTHONPATH")) if p)
    return full


@dataclass
class Context:
    work: Path  # a fresh directory for this invocation
    gpus: int  # CUDA devices visible
    gpu_name: str | None
    dry_run: bool  # CPU sides only, even where a GPU is present
    budget_scale: float = 1.0
    smoke: bool = False  # --smoke: a dry run whose CPU sides measure at smaller sizes where they can
    # The models under test: a config.yaml per family (--config) in place of its official one (corpus.py).
    configs: dict[str, Path] = field(default_factory=dict)
    deadline: float = math.inf  # of the check running now (time.monotonic)
    memo: dict[str, Any] = field(default_factory=dict)
    logs: int = 0  # trainer logs written so far, for their file names

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run or not self.gpus else "cuda"

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CheckTimeout()
        return left

    def shared(self, key: str, make: Callable[[], Any]) -> Any:
        """`make()` once per invocation: inputs and runs that several checks compare against."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def config(self, family: str = IDX2) -> Path:
        """The config.yaml of a family under test: the one --config named, else its official one (2.5's written
        into the work folder once, from 2.0's)."""
        if family in self.configs:
            return self.configs[family]
        if family == IDX25:
            return self.shared("config25", lambda: write_official_25(self.folder("official25/config.yaml")))
        return OFFICIAL_CONFIG

    def gpt(self, family: str = IDX2, **changes: Any) -> GPTConfig:
        """The gpt section of a family's config under test, with `changes`."""
        return read_gpt(self.config(family), **changes)

    @property
    def log_dir(self) -> Path:
        """Every process's log and whatever else the archive of logs should hold."""
        path = self.work / "logs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def demo(self, family: str = IDX2) -> list[str]:
        """Flags naming a family's demo corpus, tokenizer and base checkpoint (generated once, as the tests do; 2.5's
        with its config, checkpoints/demo25.yaml)."""
        make = demo25_flags if family == IDX25 else demo_flags
        return self.shared(f"demo_assets/{family}", lambda: make(self.folder(f"demo_assets_{family}")))

    def demo_tokenizer(self) -> Path:
        flags = self.demo()
        return Path(flags[flags.index("--tokenizer") + 1])

    def folder(self, name: str) -> Path:
        path = self.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def trainer(self, out: Path, *args: str, kill_at: str | None = None, env: dict[str, str] | None = None,
                launcher: list[str] | None = None) -> Job:
        """The trainer as a process of its own, to be started by `run` (`launcher`: another way to start
        train_gpt_v2.py, e.g. with a memory cap; it gets the trainer's flags after its own arguments)."""
        command = [*(launcher or [sys.executable, str(SCRIPT)]), "--output-dir", str(out), *args]
        return Job(command, child_env(kill_at, env))

    def torchrun(self, processes: int, out: Path, *args: str, kill_at: str | None = None,
                 env: dict[str, str] | None = None) -> Job:
        command = [*TORCHRUN, str(processes), str(SCRIPT), "--output-dir", str(out), *args]
        return Job(command, child_env(kill_at, {**DDP_BACKSTOP, **(env or {})}))

    def run(self, *jobs: Job) -> list[Finished]:
        """The jobs at the same time (a run's start-up dominates on a GPU machine), each logging to a file (no
        pipe to fill); every process they started is ended when the check's time is up or anything interrupts."""
        started, running = time.monotonic(), []
        try:
            for job in jobs:
                self.logs += 1
                log = self.log_dir / f"{self.logs:03d}.log"
                with open(self.log_dir / "commands.txt", "a", encoding="utf-8") as index:
                    index.write(f"{log.name}: {' '.join(job.command)}\n")
                with open(log, "w", encoding="utf-8") as sink:
                    proc = subprocess.Popen(job.command, env=job.env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=sink,
                                            start_new_session=True)
                running.append((proc, log))
            for proc, _ in running:
                try:
                    proc.wait(timeout=self.remaining())
                except subprocess.TimeoutExpired:
                    raise CheckTimeout() from None
        except BaseException:  # the time is up, the check's alarm, Ctrl-C: leave nothing running
            for proc, _ in running:
                end_tree(proc)
            raise
        seconds = round(time.monotonic() - started, 1)
        return [Finished(job.command, proc.returncode, log.read_text(encoding="utf-8", errors="replace"), seconds)
                for job, (proc, log) in zip(jobs, running)]

    def run_one(self, job: Job) -> Finished:
        return self.run(job)[0]


@dataclass(frozen=True)
class Job:
    command: list[str]
    env: dict[str, str]


def end_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to a process and every process below it (torchrun starts each worker in a session of its own,
    so the process group alone would miss them), then reap it. A process already reaped is left alone: its
    number may belong to another process by now."""
    if proc.poll() is not None:
        return
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, deepest first, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found: list[int] = []
    level = [pid]
    while level:
        level = [child for child, parent in parents.items() if parent in level]
        found = level + found
    return found
