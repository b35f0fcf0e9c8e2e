"""Running the acceptance checks: one status line per check (and indented lines with its figures in words), a
time budget each, everything into one JSON file.

A check is a function of the `Context` returning an `Outcome` (passed, figures, note, lines). A check that
needs more GPUs than the machine has (or any GPU, in a dry run) runs its CPU side instead, when it has one:
the same code up to the point where a GPU is needed (command lines, the CPU half of a comparison, a small
model on the CPU). That side must pass; the check is then reported as skipped, with why. An exception in
a check is a failure of that check, never the end of the run.

Budgets: `budget_s` is the check's share of the GPU run (the checks one GPU runs by default add up to
GPU_RUN_BUDGET_S; an `on_request` check runs only when named); `cpu_budget_s` bounds its CPU side, which on a
loaded 2-core machine may take longer than the GPU part would: there a budget only stops a hang. On the GPU a
check may also spend what the checks before it left unspent: the first H100 runs took 214 s and 269 s for the
same checks (a slower machine, each check 1.0-1.6x), and the whole run, not each check, is what must fit.
"""
from __future__ import annotations

import json
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

from benchmarks.acceptance.context import CheckTimeout, Context


# The GPU machine lends 15 minutes, its 1-2 minute start included, at most 10 per command: a whole run in 5
# leaves a rerun of the checks that failed (their budgets add up to less) room in the same loan.
GPU_RUN_BUDGET_S = 300


class Outcome(NamedTuple):
    passed: bool | None  # None: skipped
    figures: dict[str, Any]
    note: str = ""
    lines: tuple[str, ...] = ()  # the figures in words, printed under the status line


@dataclass(frozen=True)
class Check:
    name: str
    needs_gpus: int  # 0: runs anywhere
    budget_s: float  # the whole check on one H100, everything it starts included
    run: Callable[[Context], Outcome]
    cpu_side: Callable[[Context], Outcome] | None = None
    what: str = ""  # one line for --list and the JSON
    cpu_budget_s: float = 180.0  # its CPU side (a dry run), on a loaded 2-core machine
    # Not in a GPU run's 300 s: run with --only NAME when a loan has time left (a dry run runs its CPU side).
    on_request: bool = False
    # Checks whose runs this one reuses (Context.shared): run without them, it makes those runs itself.
    reuses: tuple[str, ...] = ()


@dataclass
class Record:
    name: str
    status: str  # "pass", "fail" or "skip"
    note: str
    figures: dict[str, Any]
    seconds: float
    budget_s: float
    needs_gpus: int
    cpu_side: str | None = None  # "passed" / "failed" when the CPU side ran instead of the check
    what: str = ""
    lines: list[str] = field(default_factory=list)

    def line(self) -> str:
        """The status line, and under it the figures in words (or, for a check that gives none, all figures)."""
        figures = ", ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        if self.lines:
            head = f"{self.status.upper()} {self.name}: {self.note}".rstrip(": ")
            return "\n".join([head, *(f"  {line}" for line in self.lines)])
        if self.status == "pass":
            return f"PASS {self.name}: {figures or self.note}"
        text = self.note + (f" [{figures}]" if figures else "")
        return f"{self.status.upper()} {self.name}: {text}"


@dataclass
class Report:
    command: list[str]
    machine: dict[str, Any]
    dry_run: bool
    smoke: bool = False
    records: list[Record] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.status != "fail" for r in self.records)

    def write(self, path: Path) -> None:
        data = {"command": self.command, "machine": self.machine, "dry_run": self.dry_run, "smoke": self.smoke,
                "passed": self.passed,
                "checks": [vars(r) for r in self.records]}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(path)


def run_check(check: Check, ctx: Context, extra_s: float = 0.0) -> Record:
    """One check within its budget; its CPU side instead where the machine lacks the GPUs it needs. `extra_s`:
    seconds added to a GPU budget (what earlier checks left unspent, the budgets of reused checks not run)."""
    gpu_part = ctx.gpus >= check.needs_gpus and not (check.needs_gpus and ctx.dry_run)
    budget = (check.budget_s if gpu_part or not check.needs_gpus else check.cpu_budget_s) * ctx.budget_scale
    extra = extra_s if gpu_part else 0.0
    budget += extra
    started = time.monotonic()
    ctx.deadline = started + budget
    step = check.run if gpu_part else check.cpu_side
    try:
        if step is None:
            outcome = Outcome(None, {}, "")
        else:
            with _alarm(budget):
                outcome = step(ctx)
    except CheckTimeout:
        given = f" (with {extra:.0f} s carried over)" if extra >= 0.5 else ""
        outcome = Outcome(False, {}, f"over its budget of {budget:.0f} s{given} (--budget-scale raises it)")
    except (Exception, SystemExit) as exc:  # a broken check fails alone (argparse exits); the others still run
        outcome = Outcome(False, {}, f"raised {_last_frame(exc)}")
    seconds = round(time.monotonic() - started, 1)
    record = Record(check.name, "", outcome.note, outcome.figures, seconds, round(budget), check.needs_gpus,
                    what=check.what, lines=list(outcome.lines))
    if gpu_part:
        record.status = {True: "pass", False: "fail", None: "skip"}[outcome.passed]
        return record
    why = _why_not_run(check, ctx)
    if step is None:
        record.status, record.note = "skip", why
    elif outcome.passed:
        record.status, record.cpu_side = "skip", "passed"
        record.note = f"{why}; CPU side passed" + (f": {outcome.note}" if outcome.note else "")
    else:
        record.status, record.cpu_side = "fail", "failed"
        record.note = f"{why}; its CPU side failed: {outcome.note}"
    return record


def _why_not_run(check: Check, ctx: Context) -> str:
    if ctx.dry_run and ctx.gpus >= check.needs_gpus:
        return "--dry-run"
    if ctx.gpus == 0:
        return "no CUDA device"
    return f"needs {check.needs_gpus} GPUs, this machine has {ctx.gpus}"


class _alarm:
    """SIGALRM after `seconds`: CheckTimeout in the check's own code; its processes are ended by the context."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        self.previous = signal.signal(signal.SIGALRM, _raise_timeout)
        signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 0.001))

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


def _raise_timeout(signum: int, frame: object) -> None:
    raise CheckTimeout()


def _last_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}{where}: {text[0] if text else ''}"[:600]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)
