"""The installable package: its commands name functions that exist, every script in tools/ has a
command and calls the same main(), and a script run where the package is missing, or where another
copy of it is installed, says so instead of a traceback or a silent run of other code."""
from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.slowness import scaled

REPO = Path(__file__).resolve().parents[1]
TRAINER_SCRIPT = REPO / "trainers" / "train_gpt_v2.py"


def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]


def tool_scripts() -> dict[Path, str]:
    """Each script in tools/ -> the module whose main() it runs."""
    found = {}
    for path in sorted((REPO / "tools").rglob("*.py")):
        imports = [node for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                   if isinstance(node, ast.ImportFrom) and [a.name for a in node.names] == ["main"]]
        assert len(imports) == 1, f"{path} should import one main() from the trainers package"
        found[path] = imports[0].module
    return found


def test_every_command_names_a_function_that_exists():
    for name, target in console_scripts().items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function, None)), f"{name} = {target}"


def test_every_tool_script_has_a_command_running_the_same_main():
    commands = {target: name for name, target in console_scripts().items()}
    scripts = tool_scripts()
    assert len(scripts) == 9  # tools/*.py and tools/tokenizer/*.py, indextts-prepare's tools/prepare.py the ninth
    for path, module in scripts.items():
        assert f"{module}:main" in commands, f"{path.relative_to(REPO)} runs {module}.main, which no command runs"
    assert set(commands) == {f"{m}:main" for m in scripts.values()} | {"trainers.cli:train_command"}


def _without_the_package(script: Path, *args: str) -> subprocess.CompletedProcess:
    # -S: no site-packages (where an install would be), -E: no PYTHONPATH (the suite points it at this checkout).
    return subprocess.run([sys.executable, "-S", "-E", str(script), *args], capture_output=True, text=True,
                          timeout=scaled(60), cwd=REPO)


def test_a_script_without_the_package_says_how_to_install_it():
    for script in (TRAINER_SCRIPT, REPO / "tools" / "export_checkpoint.py"):
        done = _without_the_package(script, "--help")
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: this Python") and "no trainers package" in done.stderr
        assert "pip install -e" in done.stderr and "Traceback" not in done.stderr


def test_the_trainer_script_warns_when_it_runs_another_copy_of_the_package(tmp_path):
    """A script of one copy running the package of another (say `pip install .` of an older clone) would
    train with code the user did not edit: the script says which copy runs, and how to run its own."""
    copy = tmp_path / "clone" / "trainers" / "train_gpt_v2.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(TRAINER_SCRIPT, copy)
    done = subprocess.run([sys.executable, str(copy), "--help"], capture_output=True, text=True, timeout=scaled(60))
    assert done.returncode == 0 and "usage: train_gpt_v2.py" in done.stdout, done.stderr
    assert done.stderr.startswith(f"warning: train_gpt_v2.py runs the trainers package installed at "
                                  f"{REPO / 'trainers'}, not the code beside it in {copy.parent}")
    assert f"pip install -e {copy.parent.parent}" in done.stderr
    same = subprocess.run([sys.executable, str(TRAINER_SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=scaled(60))
    assert same.returncode == 0 and same.stderr == ""


def test_an_installed_copy_without_checkpoints_says_how_to_get_the_default_configs(tmp_path):
    """`pip install .` copies the package, not checkpoints/ of the clone: --demo and the default --config
    name what to pass or install, not a site-packages file that never existed."""
    shutil.copytree(REPO / "trainers", tmp_path / "site" / "trainers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    for flags in (["--demo"], ["--train-manifest", "t.jsonl", "--val-manifest", "v.jsonl", "--tokenizer", "b.model",
                               "--base-checkpoint", "gpt.pth"]):
        done = subprocess.run([sys.executable, "-c", "from trainers.cli import train_command; train_command()",
                               *flags, "--output-dir", str(tmp_path / "run")], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env=env)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "this installed copy of the trainer has no checkpoints/ folder" in done.stderr, done.stderr
        assert "pip install -e ." in done.stderr


def test_ci_runs_exactly_the_readmes_set_up_and_test_command():
    """CI must prove what a new user types: the README's test line, word for word."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    test_line = next(line for line in readme.splitlines()
                     if line.startswith("pip install") and line.endswith("python -m pytest"))
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert test_line in ci_lines, f".ci/run should run the README's test command: {test_line}"


def _gone_reader() -> int:
    """The write end of a pipe whose reader has already gone: `| head` without head's race (the first write fails
    with EPIPE, however short the output)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def test_each_commands_report_into_a_reader_that_stopped_is_dropped_quietly(demo_assets, tmp_path):
    """`indextts-inspect run/latest.pth | head -3` ended in a BrokenPipeError traceback and status 1. Each command
    that prints a report, run as the user runs it: quiet, and its own status (0: its work is done)."""
    from tests.demo_runs import full_config, train_here

    run = tmp_path / "run"
    assert train_here(run, *demo_assets, "--max-steps", "1", "--val-interval", "0").returncode == 0
    flag = {name: value for name, value in zip(demo_assets, demo_assets[1:])}
    tools = REPO / "tools"
    commands = [[tools / "inspect_checkpoint.py", run / "latest.pth"],
                [tools / "inspect_checkpoint.py", run / "latest.pth", "--json"],
                [tools / "inspect_checkpoint.py", run / "latest.pth", "--verify"],
                [tools / "export_checkpoint.py", run, "--out", tmp_path / "export", "--config",
                 full_config(tmp_path / "full.yaml")],
                [tools / "plot_runs.py", run, "--out", tmp_path / "runs.png"],
                [tools / "tokenizer" / "retokenize_manifest.py", "--tokenizer", flag["--tokenizer"],
                 "--manifests", flag["--train-manifest"], "--output-dir", tmp_path / "ids"],
                [tools / "pack_run.py", run]]
    for command in commands:
        stdout = _gone_reader()
        try:
            done = subprocess.run([sys.executable, *map(str, command)], stdout=stdout, stderr=subprocess.PIPE,
                                  text=True, cwd=REPO, timeout=scaled(120))
        finally:
            os.close(stdout)
        assert (done.returncode, done.stderr) == (0, ""), f"{command}: {done.stderr}"
