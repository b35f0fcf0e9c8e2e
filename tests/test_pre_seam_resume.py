"""A 2.0 run checkpointed by the trainer before the model-family seam (issue 30) resumes exactly after it.

tests/fixtures/pre_seam_run (made by its make_fixture.py with the last commit before the seam) holds a full
fine-tuning run and a LoRA run at step 4 of 10. Each is resumed here to step 10 twice: once straight through,
once killed with SIGKILL in step 7 (mid accumulation; the newest checkpoint is step 6's) and resumed again.
The two results must be bit-identical (floats are compared only between these two runs, made on this
machine), and both must match what the fixture recorded of the old trainer's continuation that does not
depend on the CPU: the samples of every step, the data position, the step counts, the saved settings and
fingerprints, the model section's keys and shapes, the optimizer's parameter groups, the history's steps.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, fields
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.demo_runs import assert_equal_nested, final_state, logged_metrics, train, train_here
from trainers.config.settings import TrainConfig
from tests.fixtures.pre_seam_run.make_fixture import FINAL_STEP, FLAGS, KEPT_STEP, data_flags, facts

DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            for f in fields(TrainConfig)}
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "pre_seam_run"
V1_DATA = Path(__file__).resolve().parent / "fixtures" / "v1_run" / "data"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The fixture's data and base, copied away from where they were made; the flags naming them."""
    root = tmp_path_factory.mktemp("pre_seam_inputs")
    shutil.copytree(V1_DATA, root / "data")
    shutil.copy(FIXTURE / "base_gpt.pth", root / "base_gpt.pth")
    return data_flags(root / "data", root / "base_gpt.pth")


def _from_fixture(run: str, out: Path) -> Path:
    out.mkdir()
    shutil.copy(FIXTURE / run / f"model_step{KEPT_STEP}.pth", out / "latest.pth")
    return out


@pytest.mark.parametrize("run", ["full", "lora"])
def test_a_run_checkpointed_before_the_seam_resumes_exactly_after_it(run, inputs, tmp_path):
    straight = _from_fixture(run, tmp_path / "straight")
    done = train_here(straight, "--resume", "auto", *inputs)
    assert done.returncode == 0, done.stderr
    assert f"(step {KEPT_STEP}," in done.stderr and "changes the result" not in done.stderr

    killed = _from_fixture(run, tmp_path / "killed")
    assert train(killed, "--resume", "auto", *inputs, kill_at="micro:7:1").returncode == -9
    assert final_state(killed).step == 6
    again = train_here(killed, "--resume", "auto", *inputs)
    assert again.returncode == 0, again.stderr

    a, b = final_state(straight), final_state(killed)
    assert a.verified and b.verified
    for name in ("model", "optim", "data", "rng"):
        assert_equal_nested(a.section(name), b.section(name), name)
    assert logged_metrics(a.history) == logged_metrics(b.history)
    assert (straight / "sample_ids.tsv").read_text() == (killed / "sample_ids.tsv").read_text()
    for path in sorted((straight / "samples").glob("step_*.npz")):
        with np.load(path) as x, np.load(killed / "samples" / path.name) as y:
            assert x.files == y.files, path.name
            for key in x.files:
                assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key]), f"{path.name}: {key}"

    recorded = json.loads((FIXTURE / "facts.json").read_text())[run]
    for out in (straight, killed):
        found = json.loads(json.dumps(facts(out)))  # tuples as JSON lists
        # Settings added since the fixture was made hold their defaults: the old run did not use them.
        added = {k: v for k, v in found["settings"].items() if k not in recorded["settings"]}
        assert added == json.loads(json.dumps({k: DEFAULTS[k] for k in added})), out.name
        found["settings"] = {k: v for k, v in found["settings"].items() if k in recorded["settings"]}
        assert found == recorded, out.name
    assert recorded["step"] == FINAL_STEP


def test_the_fixture_is_what_its_script_says():
    """The flags the test resumes with are those the fixture was made with, and it stays small."""
    from trainers.checkpoint import schema

    for run in ("full", "lora"):
        saved = schema.read(FIXTURE / run / f"model_step{KEPT_STEP}.pth")
        assert saved.step == KEPT_STEP and saved.format_version == (4 if run == "lora" else 3)
        assert saved.settings["max_steps"] == FINAL_STEP and saved.settings.get("lora_rank", 0) == (2 if run == "lora" else 0)
        assert "--max-steps" in FLAGS
    assert sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file()) < 500_000
