"""The process tests' launcher (tests/trainer_process.py) gives a real process of its own, as a fresh
`python ...` would be: its own pid and session, the environment, working directory and argv it was given,
a SIGKILL's status, a file-size limit that does not cut its output, and a bounded wait that leaves nothing
running; and the timeouts scale with the slowness set for the machine (tests/slowness.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests import slowness
from tests.demo_runs import subprocess_env
from tests.trainer_process import TrainerProcess, run_python_code

REPORT = ("import os, sys, time\n"
          "sys.stderr.write(f'ready pid={os.getpid()} sid={os.getsid(0)} cwd={os.getcwd()} argv={sys.argv} '\n"
          "                 f'x={os.environ.get(\"X\")} threads={len(os.listdir(\"/proc/self/task\"))}\\n')\n"
          "time.sleep(float(sys.argv[1]))\n")


def test_a_forked_process_is_its_own_and_a_sigkill_is_its_status(tmp_path):
    proc = TrainerProcess([REPORT, "60", "more"], {**subprocess_env(), "X": "given"}, cwd=tmp_path, new_session=True,
                          command="-c")
    line = proc.wait_for("ready", timeout=60)
    assert proc.pid != os.getpid() and f"pid={proc.pid} sid={proc.pid} " in line  # a session of its own
    assert f"cwd={tmp_path} argv=['-c', '60', 'more'] x=given threads=1" in line  # no thread forked along
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_a_wait_past_its_timeout_kills_the_process_and_raises(tmp_path):
    proc = TrainerProcess([REPORT, "60"], subprocess_env(), command="-c")
    proc.wait_for("ready", timeout=60)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(f"/proc/{proc.pid}/stat")


def test_a_file_size_limit_stops_writes_to_files_but_not_the_output(tmp_path):
    code = ("import errno, sys\nwith open(sys.argv[1], 'wb', buffering=0) as f:\n    try:\n"
            "        for _ in range(3):\n            f.write(b'x' * 5000)  # the first write stops at the limit\n"
            "    except OSError as e:\n"
            "        print('write failed:', errno.errorcode[e.errno], 'y' * 5000, file=sys.stderr)\n        sys.exit(4)\n")
    proc = TrainerProcess([code, str(tmp_path / "big")], subprocess_env(), command="-c", file_size_limit=1000)
    assert proc.wait(timeout=60) == 4
    assert "write failed: EFBIG " + "y" * 5000 in proc.stderr_text()


def test_the_trainer_command_exits_with_its_own_status_and_message():
    done = TrainerProcess(["--max-steps", "-3"], subprocess_env())
    assert done.wait(timeout=60) == 2
    assert "--max-steps" in done.result().stderr and "Traceback" not in done.result().stderr


def test_python_code_reports_like_subprocess_run():
    done = run_python_code("import sys; print('out'); sys.exit(5)", env=subprocess_env(), timeout=60)
    assert (done.returncode, done.stdout, done.args[:2]) == (5, "out\n", [sys.executable, "-c"])


def test_timeouts_scale_with_the_slowness_given(monkeypatch):
    monkeypatch.setenv(slowness.ENV_VAR, "3")
    slowness.factor.cache_clear()
    try:
        assert slowness.scaled(10) == 30
        monkeypatch.setenv(slowness.ENV_VAR, "0.5")  # never below the idle machine's bound
        slowness.factor.cache_clear()
        assert slowness.scaled(10) == 10
    finally:
        monkeypatch.delenv(slowness.ENV_VAR)
        slowness.factor.cache_clear()
    assert slowness.factor() >= 1.0
