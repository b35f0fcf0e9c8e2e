"""benchmarks/gpu_acceptance.py: its dry run (what a machine without a GPU runs) reports every check, and a
check that breaks fails the run instead of ending it. The GPU parts themselves need a GPU to run."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_acceptance
from benchmarks.acceptance.context import Context
from benchmarks.acceptance.runner import Check, Outcome, run_check
from tests.benchmark_smokes import run_smokes
from tests.demo_runs import subprocess_env


@pytest.mark.benchmark_smokes("gpu_acceptance.py")
def test_the_dry_run_reports_every_check_and_runs_each_gpu_checks_cpu_side(tmp_path_factory):
    # --smoke: the dry run with smaller CPU-side measurements, the run tests/test_benchmarks.py also reads
    done = run_smokes(["gpu_acceptance.py"], tmp_path_factory.mktemp("benchmark_smokes"), at_once=1)["gpu_acceptance.py"]
    assert done.returncode == 0, done.output[-3000:]
    report = json.loads((done.folder / "gpu_acceptance.json").read_text())
    records = {r["name"]: r for r in report["checks"]}
    assert list(records) == gpu_acceptance.NAMES and report["dry_run"] and report["passed"]
    for check in gpu_acceptance.CHECKS:
        record = records[check.name]
        if check.needs_gpus == 0:
            assert record["status"] == "pass", record
        else:  # skipped with why, after its CPU side passed
            assert record["status"] == "skip" and record["cpu_side"] == "passed", record
            assert record["note"].startswith(("--dry-run", "no CUDA device", "needs 2 GPUs")), record
    lines = [line for line in done.output.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert [line.split(" ")[1].rstrip(":") for line in lines] == gpu_acceptance.NAMES
    # The table in the README comes from this check: its rows are all there.
    table = records["gpu_table"]["figures"]
    assert all(table[name]["micro_batch"] >= 1 for name, _, _ in gpu_acceptance.gpu_table.GPUS)


def _context(tmp_path) -> Context:
    return Context(tmp_path, gpus=0, gpu_name=None, dry_run=True)


def _raises(ctx: Context) -> Outcome:
    raise ValueError("broken")


def test_a_check_that_raises_fails_alone_and_the_run_exits_1(tmp_path, monkeypatch, capsys):
    record = run_check(Check("cpu", 0, 10, _raises), _context(tmp_path))
    assert record.status == "fail" and "ValueError" in record.note and "broken" in record.note
    record = run_check(Check("gpu", 1, 10, _raises, _raises), _context(tmp_path))
    assert record.status == "fail" and record.cpu_side == "failed", record
    record = run_check(Check("gpu", 1, 10, _raises, lambda ctx: Outcome(True, {"x": 1})), _context(tmp_path))
    assert record.status == "skip" and record.cpu_side == "passed" and record.note.startswith("no CUDA device")

    fine = Check("fine", 0, 10, lambda ctx: Outcome(True, {}))
    monkeypatch.setattr(gpu_acceptance, "CHECKS", (fine, Check("broken", 0, 10, _raises), fine))
    out = tmp_path / "report.json"
    assert gpu_acceptance.main(["--out", str(out), "--work-dir", str(tmp_path)]) == 1
    assert [r["status"] for r in json.loads(out.read_text())["checks"]] == ["pass", "fail", "pass"]
    assert "FAIL broken: raised ValueError" in capsys.readouterr().out


def test_a_check_over_its_budget_fails(tmp_path):
    def slow(ctx: Context) -> Outcome:
        time.sleep(5)
        return Outcome(True, {})

    started = time.monotonic()
    record = run_check(Check("slow", 0, 0.2, slow), _context(tmp_path))
    assert record.status == "fail" and "over its budget" in record.note
    assert time.monotonic() - started < 2


def test_a_process_still_running_when_the_budget_ends_is_killed(tmp_path):
    from benchmarks.acceptance.context import CheckTimeout, Job, descendants

    ctx = _context(tmp_path)
    ctx.deadline = time.monotonic() + 0.5
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(CheckTimeout):
        ctx.run(Job(sleeper, subprocess_env()))
    left = [pid for pid in descendants(os.getpid()) if "time.sleep(60)" in _command_line(pid)]
    assert left == []


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
