"""benchmarks/gpu_acceptance.py: its dry run (what a machine without a GPU runs) reports every check and writes
the results folder the GPU machine sends back; a check that breaks or overruns fails alone; the budgets fit the
GPU's time; and the trainer processes start where the package is not installed (the GPU machine runs a copy of
the working tree). The GPU parts themselves need a GPU to run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import gpu_acceptance
from benchmarks.acceptance.context import Context
from benchmarks.acceptance.runner import GPU_RUN_BUDGET_S, Check, Outcome, run_check
from tests.benchmark_smokes import run_smokes
from tests.demo_runs import REPO, subprocess_env
from tests.slowness import scaled

RESULT_FILES = {"gpu_acceptance.json", "console.log", "logs.tar.gz", "env.json"}


@pytest.mark.benchmark_smokes("gpu_acceptance.py")
def test_the_dry_run_reports_every_check_and_writes_the_results_folder(tmp_path_factory):
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
        else:  # skipped with why, after its CPU side passed, well within its budget
            assert record["status"] == "skip" and record["cpu_side"] == "passed", record
            assert record["note"].startswith(("--dry-run", "no CUDA device", "needs 2 GPUs")), record
        assert record["seconds"] <= record["budget_s"], record
    lines = [line for line in done.output.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert [line.split(" ")[1].rstrip(":") for line in lines] == gpu_acceptance.NAMES
    # What comes back from the GPU machine: at most 8 files, the console and every process's log among them.
    assert {p.name for p in done.folder.iterdir()} - {"output.log"} == RESULT_FILES
    console = (done.folder / "console.log").read_text()
    assert all(line in console for line in lines)
    with tarfile.open(done.folder / "logs.tar.gz") as archive:
        names = archive.getnames()
        commands = archive.extractfile("logs/commands.txt").read().decode()
    assert "logs/profile.txt" in names and sum(n.endswith(".log") for n in names) >= 8, names
    assert "train_gpt_v2.py" in commands and "capped_trainer.py" in commands
    env = json.loads((done.folder / "env.json").read_text())
    assert {"gpus", "torch", "cuda", "dev_shm", "host_memory", "nvidia_smi"} <= set(env)
    # The CPU side of the step check ran the before/after variants and found where the time goes.
    step = records["official_step"]["figures"]
    assert set(step["variants"]) == {"now", "foreach_adamw", "no_dropout"} and step["micro_batch"] == 2
    assert step["kernels"]["gemm_share"] > 0


def test_the_budgets_of_a_one_gpu_run_fit_five_minutes_and_the_order_puts_the_machine_first():
    one_gpu = [c for c in gpu_acceptance.CHECKS if c.needs_gpus <= 1]
    assert sum(c.budget_s for c in one_gpu) <= GPU_RUN_BUDGET_S == 300
    assert gpu_acceptance.CHECKS[0].name == gpu_acceptance.ALWAYS == "machine"
    # A rerun of any failed checks fits in what the first run's budgets leave of the same loan.
    assert all(c.budget_s <= GPU_RUN_BUDGET_S / 4 for c in one_gpu)


def _context(tmp_path) -> Context:
    return Context(tmp_path, gpus=0, gpu_name=None, dry_run=True)


def _raises(ctx: Context) -> Outcome:
    raise ValueError("broken")


def test_a_check_that_raises_fails_alone_and_the_run_exits_1_naming_the_rerun(tmp_path, monkeypatch, capsys):
    record = run_check(Check("cpu", 0, 10, _raises), _context(tmp_path))
    assert record.status == "fail" and "ValueError" in record.note and "broken" in record.note
    record = run_check(Check("gpu", 1, 10, _raises, _raises), _context(tmp_path))
    assert record.status == "fail" and record.cpu_side == "failed", record
    record = run_check(Check("gpu", 1, 10, _raises, lambda ctx: Outcome(True, {"x": 1})), _context(tmp_path))
    assert record.status == "skip" and record.cpu_side == "passed" and record.note.startswith("no CUDA device")

    fine = Check("fine", 0, 10, lambda ctx: Outcome(True, {}))
    monkeypatch.setattr(gpu_acceptance, "CHECKS", (fine, Check("broken", 0, 10, _raises), fine))
    out = tmp_path / "results"
    assert gpu_acceptance.main(["--out-dir", str(out), "--work-dir", str(tmp_path)]) == 1
    assert [r["status"] for r in json.loads((out / "gpu_acceptance.json").read_text())["checks"]] == ["pass", "fail",
                                                                                                       "pass"]
    printed = capsys.readouterr().out
    assert "FAIL broken: raised ValueError" in printed
    assert "rerun the failed checks (10 s of budgets) with: python benchmarks/gpu_acceptance.py --only broken" in printed
    assert (out / "console.log").read_text() == printed


def test_results_go_to_OUT_when_it_is_set(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_acceptance, "CHECKS", (Check("machine", 0, 10, lambda ctx: Outcome(True, {})),
                                                   Check("other", 0, 10, _raises)))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert gpu_acceptance.main(["--only", "other", "--work-dir", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "out" / "gpu_acceptance.json").read_text())
    assert [r["name"] for r in report["checks"]] == ["machine", "other"]  # machine always runs
    assert {p.name for p in (tmp_path / "out").iterdir()} == RESULT_FILES


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


def _python_without_the_package(folder: Path) -> Path:
    """A virtual environment that sees this Python's packages (torch, numpy, ...) but not an install of this
    project: its site-packages names theirs in a .pth file, whose own .pth files (an editable install's finder)
    are then never run."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=scaled(120))
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import site as host_site
    Path(site, "host_packages.pth").write_text("\n".join(host_site.getsitepackages()) + "\n", encoding="utf-8")
    return python


def test_the_trainer_checks_start_where_the_package_is_not_installed(tmp_path):
    """The GPU machine runs a copy of the working tree, not pip-installed: every process a check starts must get
    the checkout on its path (without it the trainer exits 2, "no trainers package")."""
    python = _python_without_the_package(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the suite points it at this checkout
    hidden = subprocess.run([str(python), "-c", "import trainers"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=scaled(120))
    assert hidden.returncode == 1 and "No module named 'trainers'" in hidden.stderr
    assert subprocess.run([str(python), "-c", "import torch, numpy, yaml"], env=env, cwd=tmp_path,
                          timeout=scaled(120)).returncode == 0
    out = tmp_path / "results"
    done = subprocess.run([str(python), str(REPO / "benchmarks" / "gpu_acceptance.py"), "--smoke", "--only",
                           "official_trainer", "--out-dir", str(out), "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=scaled(600))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = {r["name"]: r for r in json.loads((out / "gpu_acceptance.json").read_text())["checks"]}["official_trainer"]
    assert record["cpu_side"] == "passed" and record["figures"]["micro_batch"] == 2, record
