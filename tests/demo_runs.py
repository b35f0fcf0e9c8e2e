"""Running the real entry point on the demo config, in a process of its own or in this process, and comparing
results.

Processes of their own are for tests about processes (a real SIGKILL, a terminal's Ctrl-C): `train` forks
them from a server that imported torch once (tests/trainer_process.py); everything else runs `main()` in this
process, which skips torch's import and start-up. Both run with one intra-op thread (the conftest fixture here,
OMP_NUM_THREADS there), so their float results are bit-identical and a run may be continued by either;
`assert_same_training` is the one check that two runs trained exactly alike.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch
import yaml

from trainers.checkpoint import schema
from trainers.data.demo_data import DemoCorpusSpec, ensure_demo_assets
from trainers.log_lines import LINE_LIMIT
from trainers.model.demo_base import ensure_demo_base
from trainers.model.gpt_model import GPTConfig

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "trainers" / "train_gpt_v2.py"
V1_RUN = REPO / "tests" / "fixtures" / "v1_run"
INFERENCE_SECTIONS = REPO / "tests" / "fixtures" / "inference_sections.yaml"
FAULT_VARS = ("INDEXTTS_TRAIN_KILL_AT", "INDEXTTS_TRAIN_OOM_ABOVE", "INDEXTTS_TRAIN_OOM_AT")


def demo_flags(root: Path) -> list[str]:
    """Flags naming a generated demo corpus, tokenizer and base checkpoint under `root`."""
    gpt = yaml.safe_load((REPO / "checkpoints" / "demo.yaml").read_text())["gpt"]
    corpus = ensure_demo_assets(root, DemoCorpusSpec(model_dim=gpt["model_dim"], vocab_size=gpt["number_text_tokens"],
                                                     num_codes=gpt["start_mel_token"]))
    base = ensure_demo_base(root, GPTConfig.from_yaml_section(gpt))
    return ["--demo", "--train-manifest", str(corpus.train_manifest), "--val-manifest", str(corpus.val_manifest),
            "--tokenizer", str(corpus.tokenizer), "--base-checkpoint", str(base)]


DEMO25_CONFIG = REPO / "checkpoints" / "demo25.yaml"


def demo25_flags(root: Path) -> list[str]:
    """Flags naming the IndexTTS-2.5 demo's corpus, tokenizer and base under `root`, and its config."""
    from trainers.families import FAMILIES

    family = FAMILIES["indextts25"]
    gpt = family.read_config(yaml.safe_load(DEMO25_CONFIG.read_text())["gpt"])
    family.make_demo(root, gpt)
    return ["--demo", "--config", str(DEMO25_CONFIG), "--train-manifest", str(root / "train.jsonl"),
            "--val-manifest", str(root / "val.jsonl"), "--tokenizer", str(root / family.demo_tokenizer_name),
            "--base-checkpoint", str(root / "base_gpt.pth")]


def small_corpus_flags(folder: Path) -> list[str]:
    """A copy of the small corpus of tests/fixtures/v1_run (24 + 8 samples, a 1-layer config) in
    `folder`, and the flags naming it: for runs of a few seconds that need no demo assets."""
    shutil.copytree(V1_RUN / "data", folder)
    return ["--train-manifest", str(folder / "train.jsonl"), "--val-manifest", str(folder / "val.jsonl"),
            "--tokenizer", str(folder / "bpe.model"), "--config", str(folder / "tiny.yaml")]


def full_config(path: Path, gpt_config: Path = REPO / "checkpoints" / "demo.yaml") -> Path:
    """A full IndexTTS2 config at `path`, as the official config.yaml is: the gpt section of the trimmed
    `gpt_config` (the demo's by default) among the other keys inference reads."""
    sections = yaml.safe_load(INFERENCE_SECTIONS.read_text(encoding="utf-8"))
    gpt = yaml.safe_load(gpt_config.read_text(encoding="utf-8"))["gpt"]
    data = {"dataset": sections.pop("dataset"), "gpt": gpt, **sections}
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def subprocess_env(kill_at: str | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items() if k not in FAULT_VARS}
    full.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if kill_at:
        full["INDEXTTS_TRAIN_KILL_AT"] = kill_at
    full.update(env or {})
    return full


def train(out: Path, *args: str, kill_at: str | None = None, env: dict[str, str] | None = None,
          ) -> subprocess.CompletedProcess:
    """The trainer in a process of its own (for real kills and signals), forked from a server that imported
    torch once (tests/trainer_process.py)."""
    from tests.trainer_process import TrainerProcess

    proc = TrainerProcess(["--output-dir", str(out), *args], subprocess_env(kill_at, env))
    proc.wait(timeout=300)
    result = proc.result()
    assert_lines_fit(result.stderr)
    return result


def train_here(out: Path, *args: str, kill_at: str | None = None, env: dict[str, str] | None = None,
               ) -> subprocess.CompletedProcess:
    """The trainer's main() in this process; same result object as `train`.

    Kill points must name a signal the trainer handles (SIGTERM@..., SIGINT@...): a SIGKILL here
    would end the test run.
    """
    from trainers.main import main

    assert not kill_at or kill_at.startswith(("SIGTERM@", "SIGINT@", "SIGHUP@")), kill_at
    err = io.StringIO()
    argv = ["--output-dir", str(out), *args]
    with environment({**dict.fromkeys(FAULT_VARS), "INDEXTTS_TRAIN_KILL_AT": kill_at, **(env or {})}), \
            contextlib.redirect_stderr(err):
        status = main(argv)
    assert_lines_fit(err.getvalue())
    return subprocess.CompletedProcess(argv, status, "", err.getvalue())


@contextlib.contextmanager
def environment(variables: dict[str, str | None]):
    """These environment variables set (None: unset) for the block, and restored after it."""
    saved = {k: os.environ.get(k) for k in variables}
    for k, v in variables.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def family_run(family_assets: list[str], request, fixture: str, tmp_path_factory, *flags: str) -> Path:
    """A module's run for the family of `family_assets` (tests/conftest.py): for IndexTTS2 the module's own
    fixture `fixture` (not trained twice), for another family its demo trained here with `flags`."""
    family = getattr(family_assets, "family", "indextts2")
    if family == "indextts2":
        return request.getfixturevalue(fixture)
    out = tmp_path_factory.mktemp(f"{fixture}_{family}") / "run"
    result = train_here(out, *family_assets, *flags)
    assert result.returncode == 0, result.stderr
    return out


_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (\w+) ")  # a log record's first line: its time and level
_FOLDERS = re.compile(r"(?<![\w.~/-])(?:/[^\s/'\"(),;]+)+/")  # the folders of an absolute path


def long_lines(text: str) -> list[str]:
    """The lines of a trainer's INFO and WARNING records (the first line and any continued ones) over LINE_LIMIT
    characters once the folders of every absolute path are taken out (the user's paths are what they are; the
    file or directory named keeps its name). ERROR records are not held to it: one lists every problem at once.
    tqdm's bar is not drawn without a terminal, so no line is the terminal's width."""
    long, level = [], None
    for line in text.splitlines():
        record = _RECORD.match(line)
        if record:
            level = record.group(1)
        elif line.startswith(("Traceback", "Exception in thread")):
            level = None  # not a record's text
        short = _FOLDERS.sub("", line)
        if level in ("INFO", "WARNING") and len(short) > LINE_LIMIT:
            long.append(short)
    return long


def assert_lines_fit(text: str) -> None:
    """Every INFO and WARNING line of a trainer's log fits (`long_lines`): checked on every run of train and
    train_here; docs/cloud.md promises it."""
    long = long_lines(text)
    assert not long, f"{len(long)} log line(s) over {LINE_LIMIT} characters:\n" + "\n".join(long)


def assert_output_fits(text: str, *places: Path) -> None:
    """Every line a tool printed (indextts-prepare's output has no log levels) at most 120 characters, a path under
    one of `places` counted as RUN (the user's paths are what they are). tqdm's bar is not drawn without a terminal,
    so no line is the terminal's width."""
    for place in places:
        text = text.replace(str(place), "RUN")
    for line in text.splitlines():
        assert len(line) <= LINE_LIMIT, line


def final_state(out: Path) -> schema.Checkpoint:
    return schema.read(out / "latest.pth")


def assert_same_training(a: Path, b: Path, steps: int, from_step: int = 0) -> None:
    """Bit-identical training, for runs that must not differ at all (a resume against an uninterrupted run):
    both final checkpoints verified and at `steps`, at the same place in the data; every model tensor and every
    optimizer value (AdamW moments, step counts, param groups) torch.equal; the same saved states of the global
    random generators (torch, CUDA, numpy, Python); the same samples at every step; the
    same logged train and validation metrics, in the saved history and in TensorBoard as a reader sees it.
    `from_step`: branches of a checkpoint of that step, which log the samples of their own steps only."""
    sa, sb = final_state(a), final_state(b)
    assert sa.verified and sb.verified, "checksums not verified"
    assert sa.step == sb.step == steps, f"steps {sa.step}, {sb.step}, expected {steps}"
    where = [(s.epoch, s.step_in_epoch, s.samples_in_epoch, s.samples_seen) for s in (sa, sb)]
    assert where[0] == where[1], f"(epoch, step in epoch, samples in epoch, samples seen) differ: {where}"
    assert_equal_nested(sa.model, sb.model, "model")
    assert_equal_nested(sa.optimizer, sb.optimizer, "optimizer")
    assert_equal_nested(sa.sections["rng"], sb.sections["rng"], "rng")  # the global generators: the run's, restored
    ids = (a / "sample_ids.tsv").read_text()
    assert ids == (b / "sample_ids.tsv").read_text(), "sample_ids.tsv differs"
    assert len(ids.splitlines()) == steps - from_step, f"sample_ids.tsv has {len(ids.splitlines())} steps"
    assert logged_metrics(sa.history) == logged_metrics(sb.history), "the logged train/val history differs"
    assert train_scalars(a) == train_scalars(b), "TensorBoard's train scalars differ"


def assert_equal_nested(x: object, y: object, where: str) -> None:
    """Equal structure and values; tensors torch.equal (same shape, dtype and bits)."""
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and torch.equal(x, y), f"{where} differs"
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), f"{where} keys differ"
        for k in x:
            assert_equal_nested(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), f"{where} length differs"
        for i, (u, v) in enumerate(zip(x, y)):
            assert_equal_nested(u, v, f"{where}[{i}]")
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"


def logged_metrics(history: list[dict]) -> list[dict]:
    """The history's train and validation entries: exactly equal after a resume (start/resume events aside)."""
    entries = [e for e in history if e["kind"] not in ("start", "resume")]
    assert any(e["kind"] == "train" for e in entries)
    return entries


def train_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's per-step train scalars as a reader sees them (a resume purges a killed run's later steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if tag.startswith("train/") and tag != "train/samples_per_second"}  # a rate of wall time


def assert_close_weights(a: Path, b: Path) -> None:
    """Equal within float rounding: for runs whose steps were split into other micro-batches.

    Different micro-batches change only float summation order; Adam turns those rounding
    differences into update differences of a fraction of the learning rate (3e-3 on the demo).
    Measured: max abs 7.9e-6 after 40 steps (1.5e-5 for a 2 x 8 split).
    """
    sa, sb = final_state(a), final_state(b)
    assert sa.step == sb.step
    for key in sa.model:
        torch.testing.assert_close(sb.model[key], sa.model[key], rtol=1e-4, atol=5e-5, msg=key)
