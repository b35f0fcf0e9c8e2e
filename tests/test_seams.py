"""The seams of the trainer's code (docs/architecture.md, code map): one restore path, and a loop that
reaches fault injection only through `faults.at(...)` and the run's components one attribute deep.

The restore test runs the real set-up of a resume in this process; the loop tests read the source.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.demo_runs import train_here
from trainers.checkpoint import schema
from trainers.faults import KILL_POINTS

REPO = Path(__file__).resolve().parents[1]
LOOP_FILES = (REPO / "trainers" / "loop.py", REPO / "trainers" / "main.py")
# Where fault points are marked: the loop, and the validation listeners whose work has points of its own.
FAULT_FILES = (*LOOP_FILES, REPO / "trainers" / "run" / "validation_generation.py")
FLAGS = ["--batch-size", "8", "--max-steps", "2", "--save-interval", "2", "--val-interval", "0",
         "--max-val-batches", "1", "--log-interval", "100"]


def test_a_resume_restores_every_section_once_in_the_owners_order_after_every_refusal(demo_assets, tmp_path,
                                                                                      monkeypatch):
    """Each owner's load_state_dict runs once, in schema.RESTORE_ORDER (the model before the optimizer,
    whose frozen rows are the restored model's), all after the model is built; the optimizer is given the
    planned schedule instead of building one to be replaced."""
    from trainers.config.flags import parse_command_line
    from trainers.data.train_data import TrainData
    from trainers.hardware.plan import HardwarePlan
    from trainers.model.gpt_model import UnifiedVoiceGPT
    from trainers.model.weights import GPTWeights
    from trainers.run import setup
    from trainers.training import optimization
    from trainers.training.progress import TrainingProgress
    from trainers.training.rng import ProcessRNG

    out = tmp_path / "run"
    assert train_here(out, *demo_assets, *FLAGS).returncode == 0
    events: list[str] = []
    for name, owner in (("model", GPTWeights), ("optim", optimization.Optimization), ("data", TrainData),
                        ("progress", TrainingProgress), ("rng", ProcessRNG), ("hardware", HardwarePlan)):
        def load(self, *args, _name=name, _load=owner.load_state_dict, **kwargs):
            events.append(_name)
            return _load(self, *args, **kwargs)
        monkeypatch.setattr(owner, "load_state_dict", load)
    build_model = UnifiedVoiceGPT.__init__
    monkeypatch.setattr(UnifiedVoiceGPT, "__init__",
                        lambda self, *a, **k: (events.append("model built"), build_model(self, *a, **k))[1])
    configured = optimization.configured_schedule
    monkeypatch.setattr(optimization, "configured_schedule",
                        lambda cfg: (events.append("optimizer built a schedule"), configured(cfg))[1])
    planned = []
    plan_schedule = setup.plan_schedule
    monkeypatch.setattr(setup, "plan_schedule", lambda *a: planned.append(plan_schedule(*a)) or planned[-1])

    run = setup.setup_run(parse_command_line(["--output-dir", str(out), "--resume", "auto", "--max-steps", "4"]))
    try:
        assert events == ["model built", "model", "optim", "data", "progress", "rng", "hardware"]
        assert tuple(events[1:]) == schema.RESTORE_ORDER
        assert set(schema.RESTORE_ORDER) == set(schema.SECTIONS) - {"run"}  # "run" is read before anything is built
        assert run.optim.schedule is planned[0] and run.progress.step == 2
        # The restored model's carried tensors, which a background save never copies.
        carried = run.weights.carried.values()
        assert carried and {id(t) for t in run.checkpoints.writer.static} == {id(t) for t in carried}
    finally:
        run.close()


def _sources(files: tuple[Path, ...] = LOOP_FILES) -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in files]


def _chain(node: ast.Attribute) -> list[str]:
    """run.a.b -> ["run", "a", "b"]; [] when the chain does not start at a name."""
    names = [node.attr]
    while isinstance(node.value, ast.Attribute):
        node = node.value
        names.append(node.attr)
    return [node.value.id, *reversed(names)] if isinstance(node.value, ast.Name) else []


def test_the_loop_reaches_fault_injection_only_through_faults_at():
    named = set()
    for path, tree in _sources(FAULT_FILES):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _chain(node)[:1] == ["faults"]:
                assert _chain(node)[1] in ("at", "attach"), f"{path.name}:{node.lineno}: faults.{_chain(node)[1]}"
            if isinstance(node, ast.Attribute) and node.attr == "check" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr in ("oom", "kill"):
                raise AssertionError(f"{path.name}:{node.lineno}: an injection checked outside faults.at")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _chain(node.func) == \
                    ["faults", "at"]:
                named.add(node.args[0].value)
    assert set(KILL_POINTS) <= named, f"kill points the loop never names: {set(KILL_POINTS) - named}"


def test_the_loop_reaches_the_run_record_one_attribute_deep():
    """run.component.method(...), never run.component.part.field: what the loop needs is a name on Run
    or on the component."""
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain = _chain(node)
                assert not (chain[:1] == ["run"] and len(chain) > 3), f"{path.name}:{node.lineno}: {'.'.join(chain)}"
