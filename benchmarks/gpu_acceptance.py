#!/usr/bin/env python3
"""One command that proves the GPU paths of both models, IndexTTS2 (2.0) and IndexTTS-2.5, on one GPU in at most 5
minutes, everything it starts included; each check prints PASS / FAIL / SKIP with its figures, and all of it is
written under $OUT (or --out-dir).

    python benchmarks/gpu_acceptance.py [--only NAME ...] [--out-dir DIR] [--config CONFIG ...] [--dry-run | --smoke]

Run it from the repository root of a checkout; nothing needs installing (every process it starts gets the
checkout on PYTHONPATH). The checks run in the order of what they prove per second; each has a budget (the
checks one GPU runs by default add up to 300 s) and one over it fails, its processes killed, while the others
still run. A check named `..._25` is IndexTTS-2.5's counterpart of the one without; model_losses and
demo_resume cover both models, the others (saving, the CUDA-only tests, a checkpoint moved to the CPU) the
machinery both share. A rerun of the checks that failed (--only NAME, repeatable; the last line prints the
command) fits in the time left of the same 15-minute loan, as does `official_trainer`, which runs only when
named. `machine` always runs. The torchrun checks need 2 GPUs and are skipped with fewer.

What is written to the results folder (4 files): gpu_acceptance.json (every check's figures), console.log
(what was printed), logs.tar.gz (every process's log, the profile of a step, pytest's report) and env.json
(GPU, driver, torch, CUDA, free memory, /dev/shm). The report and the archive are rewritten after each check,
so a run cut short keeps what it proved.

Without a GPU (or with --dry-run) each GPU check runs its CPU side instead, the same code as far as it goes
without CUDA, and is reported SKIP with why; the script then exits 0 when every CPU side passed. --smoke is
that dry run at the smallest sizes; tests/test_gpu_acceptance.py and tests/test_benchmarks.py run it (one run
for both), so the script cannot rot. The table of micro-batches per GPU needs no GPU: benchmarks/gpu_table.py.
Exit status: 0 every check that ran passed; 1 a check failed; 2 bad flags; 143 stopped by SIGTERM (the check
running then ends its processes; the report keeps the checks before it).
"""
from __future__ import annotations

import argparse
import functools
import io
import json
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, TextIO

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from benchmarks.acceptance import (  # noqa: E402
    environment, model_checks, official_checks, prepare_checks, run_checks, save_checks, step_checks,
)
from benchmarks.acceptance.context import Context  # noqa: E402
from benchmarks.acceptance.corpus import IDX25, LABELS, family_of, read_gpt  # noqa: E402
from benchmarks.acceptance.runner import GPU_RUN_BUDGET_S, Check, Outcome, Report, run_check  # noqa: E402
from trainers.hardware.oom_recovery import release_memory  # noqa: E402

SHM = Path("/dev/shm")
# What the runs write at most at once: the background save's two official-size files (7.7 GB each) and a spare.
SHM_NEEDED = 24 * 10 ** 9
DEFAULT_OUT = Path("gpu_acceptance_results")  # under the current folder, without $OUT or --out-dir
ALWAYS = "machine"


def _25(check: Callable[..., Outcome]) -> Callable[[Context], Outcome]:
    """A check of IndexTTS2's run on IndexTTS-2.5 (the same code, the model and data of the other family)."""
    return functools.partial(check, family=IDX25)


# In the order of what they prove per second on one H100; budgets in seconds, everything each starts included.
CHECKS = (
    Check("machine", 0, 2, environment.machine, what="GPU, driver, torch, CUDA, free memory, /dev/shm (env.json)"),
    Check("dropout_masks", 1, 9, model_checks.dropout_masks, model_checks.dropout_masks_cpu_side,
          "v1, v2 and v3 masks identical on CUDA and the CPU (v3 compiled there; forward, backward, bf16)"),
    Check("model_losses", 1, 20, model_checks.model_losses, model_checks.model_losses_cpu_side,
          "2.0 and 2.5 at the official width: CPU vs CUDA fp32 (TF32 off), bf16 and fp16 vs fp32"),
    Check("official_step", 1, 40, step_checks.official_step, step_checks.official_step_cpu_side,
          "2.0 bf16 step at the official config: probe, tokens/s, MFU, peak memory, syncs, kernels, masks v2 vs v3, "
          "before/after"),
    Check("official_step_25", 1, 34, _25(step_checks.official_step), _25(step_checks.official_step_cpu_side),
          "2.5 bf16 step at the official config: probe, tokens/s, MFU, peak memory, syncs, kernels, masks v2 vs v3"),
    Check("demo_resume", 1, 45, run_checks.demo_resume, run_checks.demo_resume_cpu_side,
          "2.0 and 2.5 (masks v3) demos SIGKILLed mid-step and resumed on CUDA: bit-identical with --deterministic"),
    Check("oom_and_precision", 1, 40, official_checks.oom_and_precision, official_checks.oom_and_precision_cpu_side,
          "2.0: a real CUDA out-of-memory error halved, ending as the halved size does; bf16 vs fp32 validation"),
    Check("oom_and_precision_25", 1, 48, _25(official_checks.oom_and_precision),
          _25(official_checks.oom_and_precision_cpu_side), "the same for 2.5"),
    Check("background_save", 1, 27, save_checks.background_save, save_checks.background_save_cpu_side,
          "official-size save: loop blocked, background vs synchronous; pinned bytes; updates stay out"),
    Check("cuda_checkpoint_on_cpu", 1, 11, run_checks.cuda_to_cpu, run_checks.cuda_to_cpu_cpu_side,
          "a CUDA-trained checkpoint resumed on the CPU", reuses=("demo_resume",)),
    Check("cuda_tests", 1, 12, model_checks.cuda_tests, model_checks.cuda_tests_cpu_side,
          "the tests that skip without CUDA, run with pytest"),
    Check("prepare_rtf", 1, 12, prepare_checks.prepare_rtf, prepare_checks.prepare_rtf_cpu_side,
          "indextts-prepare's upstream feature models at the official sizes, both models: real-time factor"),
    Check("official_trainer", 1, 40, official_checks.official_trainer, official_checks.official_trainer_cpu_side,
          "2.0 trainer at the official config, micro-batch probed, 4 steps: no out-of-memory, the loop's rate",
          on_request=True),
    Check("torchrun_two_vs_one", 2, 120, run_checks.torchrun_vs_single, run_checks.torchrun_cpu_side,
          "torchrun with 2 processes against 1: same samples, weights within rounding"),
    Check("torchrun_sigterm_resume", 2, 120, run_checks.torchrun_sigterm, run_checks.torchrun_cpu_side,
          "SIGTERM to one rank, resumed over NCCL: bit-identical (--deterministic)"),
)
NAMES = [c.name for c in CHECKS]
ONE_GPU = [c for c in CHECKS if c.needs_gpus <= 1 and not c.on_request]  # what a GPU run runs by default
assert sum(c.budget_s for c in ONE_GPU) <= GPU_RUN_BUDGET_S


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, help=f"where the results go [$OUT when set, else ./{DEFAULT_OUT}]")
    p.add_argument("--only", action="append", choices=[c.name for c in CHECKS], metavar="NAME",
                   help=f"run this check (repeatable; '{ALWAYS}' always runs)")
    p.add_argument("--config", type=Path, action="append", default=[],
                   help="a model under test: a config.yaml whose gpt section the official-size checks of its family "
                        "use, 2.5's when it says `version: 2.5` (repeatable, one per family) [IndexTTS2: "
                        "checkpoints/config.yaml; IndexTTS-2.5: that config with 2.5's official gpt values]")
    p.add_argument("--dry-run", action="store_true", help="the CPU sides only, even on a GPU machine")
    p.add_argument("--smoke", action="store_true", help="a dry run at the smallest sizes (for the test suite)")
    p.add_argument("--list", action="store_true", help="list the checks with their budgets and exit")
    p.add_argument("--work-dir", type=Path, help="where runs are written; a fresh folder inside it is deleted at "
                   "the end [/dev/shm when it has 24 GB free, else the system's temporary folder]")
    p.add_argument("--keep", action="store_true", help="keep the work folder (runs, logs) for inspection")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every check's time budget [1.0]")
    args = p.parse_args(argv)
    if args.budget_scale <= 0:
        p.error("--budget-scale must be positive")
    if args.work_dir is not None and not args.work_dir.is_dir():
        p.error(f"--work-dir {args.work_dir}: not an existing folder")
    args.configs = {}
    for config in args.config:
        try:
            family = family_of(read_gpt(config)).name
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
            p.error(f"--config {config}: not a config.yaml with a gpt section this trainer reads: "
                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        if family in args.configs:
            p.error(f"--config {config}: a second {LABELS[family]} config (the first: {args.configs[family]}); "
                    "give one per model")
        args.configs[family] = config.resolve()
    return args


def work_root(given: Path | None) -> Path:
    if given is not None:
        return given
    if SHM.is_dir() and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free >= SHM_NEEDED:
        return SHM  # fsync is free there: the checks time training, not the disk
    return Path(tempfile.gettempdir())


def results_dir(given: Path | None) -> Path:
    folder = given or (Path(os.environ["OUT"]) if os.environ.get("OUT") else DEFAULT_OUT)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Tee(io.TextIOBase):
    """What the script prints, on the console and in console.log."""

    def __init__(self, console: TextIO, log: TextIO) -> None:
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        self.console.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()


def pack_logs(logs: Path, archive: Path) -> None:
    """Every file under `logs` into one .tar.gz (replaced atomically: a run cut short keeps the last one)."""
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        if logs.is_dir():
            tar.add(logs, arcname="logs")
    tmp.replace(archive)


class Terminated(BaseException):
    """SIGTERM (a time limit on the whole command): not a check's failure, the end of the run. The check running
    ends its processes on the way out (Context.run), the report so far is kept."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def list_checks() -> None:
    for check in CHECKS:
        where = "on request" if check.on_request else ["CPU", "1 GPU", "2+ GPUs"][min(check.needs_gpus, 2)]
        print(f"{check.name:24} {where:10} {check.budget_s:4.0f} s  {check.what}")
    print(f"one GPU: {sum(c.budget_s for c in ONE_GPU):.0f} s of budgets (at most {GPU_RUN_BUDGET_S} s)")


def selected(check: Check, only: list[str] | None, dry_run: bool) -> bool:
    """Whether a check runs: `machine` always; with --only those named; else all but the on-request ones, whose
    CPU sides a dry run runs too (so they cannot rot)."""
    if check.name == ALWAYS:
        return True
    if only:
        return check.name in only
    return dry_run or not check.on_request


def alone_s(check: Check, chosen: set[str]) -> float:
    """The budgets of the checks whose runs `check` reuses but which are not in this run: it makes those itself."""
    return sum(c.budget_s for c in CHECKS if c.name in check.reuses and c.name not in chosen)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_checks()
        return 0
    out = results_dir(args.out_dir)
    console = sys.stdout
    previous = signal.signal(signal.SIGTERM, _terminate)
    with open(out / "console.log", "w", encoding="utf-8") as log:
        sys.stdout = Tee(console, log)
        try:
            return run(args, out, [sys.executable, *sys.argv] if argv is None else ["gpu_acceptance.py", *argv])
        finally:
            signal.signal(signal.SIGTERM, previous)
            sys.stdout.flush()
            sys.stdout = console


def run(args: argparse.Namespace, out: Path, command: list[str]) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    work = Path(tempfile.mkdtemp(prefix="gpu_acceptance-", dir=work_root(args.work_dir)))
    dry_run = args.dry_run or args.smoke or not gpus
    if dry_run:  # the CPU sides are tiny: one thread is as fast idle and far faster on a loaded machine
        torch.set_num_threads(1)
    ctx = Context(work, gpus, torch.cuda.get_device_name(0) if gpus else None, dry_run, args.budget_scale,
                  smoke=args.smoke, configs=args.configs)
    configs = {LABELS[family]: str(ctx.config(family)) for family in LABELS}
    report = Report(command, {"gpus": gpus, "gpu": ctx.gpu_name, "configs": configs}, ctx.dry_run, args.smoke)
    if not gpus:
        print("gpu_acceptance: no CUDA device: dry run of the CPU-side parts; GPU checks are SKIP with why", flush=True)
    elif dry_run:
        print(f"gpu_acceptance: {'--smoke' if args.smoke else '--dry-run'} on {gpus} x {ctx.gpu_name}: the CPU-side "
              "parts only", flush=True)
    else:
        print(f"gpu_acceptance: {gpus} x {ctx.gpu_name}; checks needing 2 GPUs are skipped with fewer", flush=True)
    started, status, spare = time.monotonic(), None, 0.0
    chosen = {c.name for c in CHECKS if selected(c, args.only, dry_run)}
    try:
        for check in CHECKS:
            if check.name not in chosen:
                continue
            record = run_check(check, ctx, spare + alone_s(check, chosen))
            spare = max(0.0, record.budget_s - record.seconds) if record.needs_gpus <= gpus else spare
            release_memory(torch.device("cuda" if gpus else "cpu"))  # the next check's trainers probe free memory
            report.records.append(record)
            print(record.line(), flush=True)
            report.write(out / "gpu_acceptance.json")
            if check.name == ALWAYS:
                write_json(out / "env.json", ctx.shared("environment", lambda: environment.dump(ctx)))
            pack_logs(ctx.log_dir, out / "logs.tar.gz")
    except Terminated:
        after = report.records[-1].name if report.records else "none"
        print(f"gpu_acceptance: stopped by SIGTERM during the check after {after}; its processes ended", flush=True)
        status = 128 + signal.SIGTERM
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    counts = {s: sum(r.status == s for r in report.records) for s in ("pass", "fail", "skip")}
    report.write(out / "gpu_acceptance.json")
    failed = [r.name for r in report.records if r.status == "fail"]
    kept = f"; work folder kept: {work}" if args.keep else ""
    print(f"gpu_acceptance: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped in "
          f"{time.monotonic() - started:.0f} s; results in {out}{kept}")
    if failed:
        budget = sum(c.budget_s + alone_s(c, set(failed)) for c in CHECKS if c.name in failed or c.name == ALWAYS)
        config = [f"--config {path}" for path in args.configs.values()]
        print(f"gpu_acceptance: rerun the failed checks ({budget:.0f} s of budgets) with: python "
              f"benchmarks/gpu_acceptance.py {' '.join(['--only ' + name for name in failed] + config)}")
    return status or (0 if report.passed else 1)


if __name__ == "__main__":
    sys.exit(main())
