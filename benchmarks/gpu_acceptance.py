#!/usr/bin/env python3
"""One command that proves the GPU paths: every check prints PASS / FAIL / SKIP with its figures, and all of
it goes to a JSON file.

    python benchmarks/gpu_acceptance.py [--out gpu_acceptance.json] [--only NAME ...] [--dry-run | --smoke] [--list]

On one GPU it runs the checks below in about 10 minutes; the torchrun checks need 2 or more GPUs and are
skipped with fewer. Without a GPU (or with --dry-run) each GPU check runs its CPU side instead, the same
code as far as it goes without CUDA (in under a minute), and is reported SKIP with why; the script then
exits 0 when every CPU side passed. --smoke is that dry run with the CPU sides that allow it measuring at
smaller sizes (about 30 s); tests/test_gpu_acceptance.py and tests/test_benchmarks.py run it (one run for both),
so the script cannot rot.
Exit status: 0 every check that ran passed; 1 a check failed; 2 bad flags.

Each check has a time budget (--budget-scale multiplies them); one that runs over fails and the others
still run. Tolerances are stated beside each check's code (benchmarks/acceptance/) and in docs/gpu.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.acceptance import gpu_table, model_checks, official_checks, run_checks, save_checks  # noqa: E402
from benchmarks.acceptance.context import Context  # noqa: E402
from benchmarks.acceptance.runner import Check, Outcome, Report, run_check  # noqa: E402
from trainers.hardware.host_memory import host_memory  # noqa: E402
from trainers.hardware.oom_recovery import release_memory  # noqa: E402

SHM = Path("/dev/shm")
SHM_NEEDED = 40 * 10 ** 9  # the official runs' checkpoints (6-8 GB each, deleted after each run) and a spare


def machine(ctx: Context) -> Outcome:
    """What ran the checks (always passes)."""
    host = host_memory()
    names = [torch.cuda.get_device_name(i) for i in range(ctx.gpus)]
    return Outcome(True, {"gpus": names or "none", "torch": torch.__version__, "cuda": torch.version.cuda or "none",
                          "cpu_cores": os.cpu_count(), "host_memory": host.describe() if host else "unknown",
                          "work_dir": str(ctx.work)})


CHECKS = (
    Check("machine", 0, 10, machine, what="the GPUs, torch and CUDA versions, host memory"),
    Check("gpu_table", 0, 120, gpu_table.check,
          what="docs/gpu.md 'Which GPU, which settings': computed micro-batches, host RAM"),
    Check("cuda_tests", 1, 180, model_checks.cuda_tests, model_checks.cuda_tests_cpu_side,
          "the tests that skip without CUDA, run with pytest"),
    Check("dropout_masks", 1, 120, model_checks.dropout_masks, model_checks.dropout_masks_cpu_side,
          "v1 and v2 masks identical on CUDA and the CPU"),
    Check("model_losses", 1, 300, model_checks.model_losses, model_checks.model_losses_cpu_side,
          "official model: CPU vs CUDA fp32 (TF32 off), bf16 and fp16 vs fp32"),
    Check("demo_resume", 1, 300, run_checks.demo_resume, run_checks.demo_resume_cpu_side,
          "demo in the default precision SIGKILLed and resumed: bit-identical with --deterministic"),
    Check("cuda_checkpoint_on_cpu", 1, 180, run_checks.cuda_to_cpu, run_checks.cuda_to_cpu_cpu_side,
          "a CUDA-trained checkpoint resumed on the CPU"),
    Check("probe_official", 1, 600, official_checks.probe_official, official_checks.probe_official_cpu_side,
          "the micro-batch probe at the official config (+/- gradient checkpointing, --deterministic), then steps"),
    Check("official_throughput", 1, 300, official_checks.official_throughput,
          official_checks.official_throughput_cpu_side, "tokens/s, MFU and peak memory per micro-batch, official"),
    Check("forced_oom", 1, 300, official_checks.forced_oom, official_checks.forced_oom_cpu_side,
          "a real CUDA out-of-memory error (capped allocator) recovered by halving the micro-batch"),
    Check("background_save", 1, 300, save_checks.background_save, save_checks.background_save_cpu_side,
          "official-size background save: pinned bytes measured; an update after the snapshot stays out"),
    Check("torchrun_two_vs_one", 2, 300, run_checks.torchrun_vs_single, run_checks.torchrun_cpu_side,
          "torchrun with 2 processes against 1: same samples, weights within rounding"),
    Check("torchrun_sigterm_resume", 2, 300, run_checks.torchrun_sigterm, run_checks.torchrun_cpu_side,
          "SIGTERM to one rank, resumed over NCCL: bit-identical (--deterministic)"),
)
NAMES = [c.name for c in CHECKS]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_acceptance.json"), help="JSON report [gpu_acceptance.json]")
    p.add_argument("--only", action="append", choices=NAMES, metavar="NAME", help="run this check (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="the CPU sides only, even on a GPU machine")
    p.add_argument("--smoke", action="store_true", help="a dry run measuring at smaller sizes where it can (for the "
                   "test suite)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--work-dir", type=Path, help="where runs are written; a fresh folder inside it is deleted at "
                   "the end [/dev/shm when it has 40 GB free, else the system's temporary folder]")
    p.add_argument("--keep", action="store_true", help="keep the work folder (runs, logs) for inspection")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every check's time budget [1.0]")
    args = p.parse_args(argv)
    if args.budget_scale <= 0:
        p.error("--budget-scale must be positive")
    if args.work_dir is not None and not args.work_dir.is_dir():
        p.error(f"--work-dir {args.work_dir}: not an existing folder")
    return args


def work_root(given: Path | None) -> Path:
    if given is not None:
        return given
    if SHM.is_dir() and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free >= SHM_NEEDED:
        return SHM  # fsync is free there: the checks time training, not the disk
    return Path(tempfile.gettempdir())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for check in CHECKS:
            print(f"{check.name:24} {['CPU', '1 GPU', '2+ GPUs'][min(check.needs_gpus, 2)]:8} {check.what}")
        return 0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    work = Path(tempfile.mkdtemp(prefix="gpu_acceptance-", dir=work_root(args.work_dir)))
    dry_run = args.dry_run or args.smoke or not gpus
    ctx = Context(work, gpus, torch.cuda.get_device_name(0) if gpus else None, dry_run, args.budget_scale,
                  smoke=args.smoke)
    report = Report([sys.executable, *sys.argv] if argv is None else ["gpu_acceptance.py", *argv],
                    {"gpus": gpus, "gpu": ctx.gpu_name, "platform": platform.platform()}, ctx.dry_run, args.smoke)
    if not gpus:
        print("gpu_acceptance: no CUDA device: dry run of the CPU-side parts; GPU checks are SKIP with why", flush=True)
    elif dry_run:
        print(f"gpu_acceptance: {'--smoke' if args.smoke else '--dry-run'} on {gpus} x {ctx.gpu_name}: the CPU-side "
              "parts only", flush=True)
    else:
        print(f"gpu_acceptance: {gpus} x {ctx.gpu_name}; checks needing 2 GPUs are skipped with fewer", flush=True)
    started = time.monotonic()
    try:
        for check in CHECKS:
            if args.only and check.name not in args.only:
                continue
            record = run_check(check, ctx)
            release_memory(torch.device("cuda" if gpus else "cpu"))  # the next check's trainers probe free memory
            report.records.append(record)
            print(record.line(), flush=True)
            report.write(args.out)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    counts = {s: sum(r.status == s for r in report.records) for s in ("pass", "fail", "skip")}
    report.write(args.out)
    print(f"gpu_acceptance: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped in "
          f"{time.monotonic() - started:.0f} s; {args.out}{'; work folder kept: ' + str(work) if args.keep else ''}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
