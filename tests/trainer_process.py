"""Trainer processes forked from a server that imported torch and the trainer once per test session.

A test about a process (a real SIGKILL, a signal to its process group, a file-size limit, its exit
status) needs the trainer in a process of its own; a fresh `python trainers/train_gpt_v2.py` spends 2-3 s
importing torch before it trains for a second. Here multiprocessing's forkserver imports the trainer once
(this module, preloaded) and forks each trainer from it: a real process with its own pid, session, signal
handlers, environment, working directory and exit status (-N when signal N killed it), running the
script's own command function (trainers.cli.train_command) with the script's argv. The server never trains,
so no OpenMP pool or other thread is forked along. Its stdout and stderr are pipes read as they come.
torchrun is forked the same way (its main() with its argv); the workers it starts are the script itself,
`python -u trainers/train_gpt_v2.py ...`, as for a user.

Tests whose point is the command line itself (--help before torch is imported, the demo command, a signal
during the imports, the cloud scripts) start the real script instead.
"""
from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from pathlib import Path
from typing import Any, Callable

from tests.slowness import scaled
import torch
import torch._dynamo  # noqa: F401  (the optimizer's first call imports it: 1.5 s of CPU in every fork otherwise)
import torch.distributed.run

import trainers.cli
import trainers.main  # noqa: F401  (imported once, in the server: every fork has torch and the trainer)
import trainers.tools.prepare.cli
import trainers.tools.prepare.demo_backend  # noqa: F401  (indextts-prepare's processes: its backend and steps too)
import trainers.tools.prepare.run  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "trainers" / "train_gpt_v2.py"
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload([__name__])


# What a launch runs: the program path its argv[0] names, and the function that program's __main__ calls.
COMMANDS: dict[str, tuple[str, Callable[[], object]]] = {
    "trainer": (str(SCRIPT), trainers.cli.train_command),  # python trainers/train_gpt_v2.py ...
    "torchrun": (torch.distributed.run.__file__, torch.distributed.run.main),  # python -m torch.distributed.run ...
    "prepare": (str(REPO / "tools" / "prepare.py"), lambda: sys.exit(trainers.tools.prepare.cli.main())),
}


@dataclass(frozen=True)
class _Launch:
    command: str  # a key of COMMANDS, or "-c": `python -c CODE ARGS` with CODE as the first of argv
    argv: list[str]
    env: dict[str, str]
    cwd: str
    outputs: tuple[Any, Any]  # the write ends of the stdout and stderr pipes (multiprocessing DupFd)
    new_session: bool
    file_size_limit: int | None


def _child(launch: _Launch) -> None:
    """In the forked process: become `python PROGRAM ARGV` started with `launch`'s settings."""
    if launch.new_session:
        os.setsid()
    if launch.file_size_limit is not None:  # pipes, not files, carry its output: they are not limited
        resource.setrlimit(resource.RLIMIT_FSIZE, (launch.file_size_limit, launch.file_size_limit))
    os.chdir(launch.cwd)
    os.environ.clear()
    os.environ.update(launch.env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, output in zip((1, 2), launch.outputs):
        opened = output.detach()
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    if launch.command == "-c":  # python -c CODE ARGS: argv[0] is "-c", as for the interpreter
        code, sys.argv = launch.argv[0], ["-c", *launch.argv[1:]]
        run = functools.partial(exec, compile(code, "<string>", "exec"), {"__name__": "__main__"})
    else:
        program, run = COMMANDS[launch.command]
        sys.argv = [program, *launch.argv]
    torch.set_num_threads(int(launch.env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    try:
        run()
    except Exception:  # as the interpreter ends on an uncaught exception: its traceback, exit status 1
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    finally:  # as the interpreter ends: non-daemon threads, then the atexit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()


class _Collected(threading.Thread):
    """Everything written to a pipe, read as it comes (so the writer never blocks on a full pipe)."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self._fd, self._chunks, self._lock = fd, [], threading.Lock()
        self.start()

    def run(self) -> None:
        with open(self._fd, "rb") as pipe:
            while chunk := pipe.read1(65536):
                with self._lock:
                    self._chunks.append(chunk)

    def text(self) -> str:
        with self._lock:
            return b"".join(self._chunks).decode("utf-8", errors="replace")


class TrainerProcess:
    """A running trainer (or torchrun): `pid`, `wait()` for its exit status, `stderr_text()` so far,
    `wait_for(text)`."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path = REPO, new_session: bool = False,
                 file_size_limit: int | None = None, command: str = "trainer") -> None:
        pipes = [os.pipe(), os.pipe()]
        launch = _Launch(command, argv, env, str(cwd), tuple(DupFd(w) for _, w in pipes), new_session,
                         file_size_limit)
        self._process = _context.Process(target=_child, args=(launch,), daemon=False)
        try:
            self._process.start()
        finally:
            for _, w in pipes:
                os.close(w)
        self._stdout, self._stderr = (_Collected(r) for r, _ in pipes)
        self.pid: int = self._process.pid  # type: ignore[assignment]
        self.argv = [sys.executable, "-c" if command == "-c" else COMMANDS[command][0], *argv]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def stderr_text(self) -> str:
        return self._stderr.text()

    def wait(self, timeout: float) -> int:
        """Its exit status, once it ended and closed its output; after `timeout` seconds (on an idle machine:
        tests/slowness.py) it and everything it started are killed and this raises subprocess.TimeoutExpired."""
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        self._process.join(timeout)
        for reader in (self._stdout, self._stderr):
            reader.join(max(0.0, deadline - time.monotonic()))
        if self._process.exitcode is None or self._stdout.is_alive() or self._stderr.is_alive():
            self.kill_tree()
            raise subprocess.TimeoutExpired(self.argv, timeout, self._stdout.text(), self.stderr_text())
        return self._process.exitcode

    def wait_for(self, text: str, timeout: float) -> str:
        """Its stderr up to and including the first line that contains `text` (`timeout`: as for `wait`)."""
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            err = self.stderr_text()
            at = err.find(text)
            if at >= 0 and "\n" in err[at:]:
                return err[: err.index("\n", at) + 1]
            if self._process.exitcode is not None:
                raise AssertionError(f"the trainer exited {self._process.exitcode} before logging {text!r}:\n{err}")
            time.sleep(0.05)
        self.kill_tree()
        raise AssertionError(f"{text!r} not logged within {timeout:.0f} s:\n{self.stderr_text()}")

    def kill_tree(self) -> None:
        """SIGKILL to it and every process below it (data workers), then reap it."""
        from benchmarks.acceptance.context import descendants

        if self._process.exitcode is None:
            for pid in [*descendants(self.pid), self.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._process.join()

    def result(self) -> subprocess.CompletedProcess:
        """What subprocess.run would have returned (after `wait`)."""
        return subprocess.CompletedProcess(self.argv, self.returncode, self._stdout.text(), self.stderr_text())


def run_python_code(code: str, *args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` forked from the server (torch already imported), as subprocess.run would report it
    (`timeout`: as for TrainerProcess.wait)."""
    proc = TrainerProcess([code, *args], env, command="-c")
    proc.wait(timeout)
    return proc.result()
