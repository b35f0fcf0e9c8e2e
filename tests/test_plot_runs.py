"""tools/plot_runs.py: curves and markers of real demo runs, the PNG, skipped runs and refusals."""
from __future__ import annotations

import math
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # needed by this tool only (requirements.txt)

from matplotlib.image import imread  # noqa: E402

from tests.demo_runs import train_here  # noqa: E402
from trainers.checkpoint import schema  # noqa: E402
from trainers.tools import plot_runs  # noqa: E402
from trainers.tools.plot_runs import build_figure, history_series, label_runs, load_run, main  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOSS_PANELS = ("text loss", "mel loss", "mel top-1 accuracy")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, demo_assets: list[str]) -> dict[str, Path]:
    """"a": 6 steps, resumed to 10, best.pth = step 8; "b": 4 steps, never resumed; "empty": no checkpoint."""
    root = tmp_path_factory.mktemp("plot")
    a, b = root / "a", root / "b"
    common = ("--val-interval", "2", "--save-interval", "2", "--log-interval", "2")
    for out, args in ((a, (*demo_assets, "--max-steps", "6")), (a, ("--resume", "auto", "--max-steps", "10")),
                      (b, (*demo_assets, "--max-steps", "4", "--learning-rate", "1e-3"))):
        done = train_here(out, *args, *common)
        assert done.returncode == 0, done.stderr[-3000:]
    shutil.copy(a / "model_step8.pth", a / "best.pth")  # replaces the trainer's own, to place a's marker at 8
    (root / "empty").mkdir()
    return {"a": a, "b": b, "empty": root / "empty"}


def lines_by_gid(ax) -> dict[str, list]:
    found = defaultdict(list)
    for line in ax.lines:
        found[line.get_gid()].append(line)
    return found


def test_figure_has_a_curve_per_run_and_metric_and_the_markers(runs: dict[str, Path]):
    loaded = [load_run(runs["a"]), load_run(runs["b"])]
    label_runs(loaded)
    fig = build_figure(loaded)
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert set(panels) == {*LOSS_PANELS, "learning rate"}
    history = {name: schema.read(runs[name] / "latest.pth").history for name in ("a", "b")}
    for title, ax in panels.items():
        found = lines_by_gid(ax)
        kinds = ("train", "val") if title in LOSS_PANELS else ("train",)
        expected = {f"{kind}:{name}" for kind in kinds for name in ("a", "b")} | {"resume:a", "best:a", "best:b"}
        assert set(found) == expected, title
        assert all(len(lines) == 1 for lines in found.values()), title
        # Data lines hold the history's steps; the markers sit at the resume step and best.pth's step.
        for name in ("a", "b"):
            for kind in kinds:
                steps = sorted({e["step"] for e in history[name] if e.get("kind") == kind})
                assert list(found[f"{kind}:{name}"][0].get_xdata()) == steps, (title, kind, name)
        assert list(found["resume:a"][0].get_xdata()) == [6, 6]
        assert list(found["best:a"][0].get_xdata()) == [8, 8]
        b_best = schema.read(runs["b"] / "best.pth").step  # written by the trainer
        assert list(found["best:b"][0].get_xdata()) == [b_best, b_best]
        # One colour per run: every line of a run has it, and the two runs differ.
        colours = {name: {tuple(line.get_color()) for gid, lines in found.items() if gid.endswith(f":{name}")
                          for line in lines} for name in ("a", "b")}
        assert len(colours["a"]) == 1 and len(colours["b"]) == 1 and colours["a"] != colours["b"], title
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_labels[:2] == ["a", "b"] and "resumed" in legend_labels and "best.pth" in legend_labels


def test_writes_a_png_and_reports_each_run(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "plots" / "runs.png"
    assert main([str(runs["a"]), str(runs["b"]), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(out)
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 600
    printed = capsys.readouterr().out
    assert "a: latest.pth at step 10" in printed and "resumed at step 6" in printed and "best.pth at step 8" in printed
    assert "b: latest.pth at step 4" in printed and f"wrote {out}" in printed
    assert [p.name for p in out.parent.iterdir()] == ["runs.png"]  # no temporary left


def test_checkpoints_are_read_through_the_schema_with_mmap(runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch):
    calls = []
    real_read = schema.read

    def recording_read(path, mmap=False):
        calls.append((Path(path).name, mmap))
        return real_read(path, mmap=mmap)

    monkeypatch.setattr(plot_runs.schema, "read", recording_read)
    load_run(runs["a"])
    assert calls == [("latest.pth", True), ("best.pth", True)]


def test_a_run_without_checkpoint_is_reported_and_skipped(runs: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture):
    out = tmp_path / "runs.png"
    assert main([str(runs["empty"]), str(runs["b"]), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"skipped {runs['empty']}: no checkpoint yet" in captured.err
    assert "b: latest.pth" in captured.out and out.is_file()


def test_refusals(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture):
    cases = [
        ([str(runs["empty"]), str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")],
         ["skipped", "no such directory", "error: none of the runs can be plotted"]),
        ([str(runs["a"]), "--out", str(tmp_path / "x.jpg")], ["error: --out", "*.png"]),
        ([str(runs["a"]), "--out", str(tmp_path)], ["error: --out", "is a directory"]),
    ]
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err
        for word in words:
            assert word in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_history_series_keeps_the_newest_value_per_step_and_gaps_for_non_finite():
    history = [
        {"kind": "start", "step": 0},
        {"kind": "val", "step": 0, "text_loss": 5.0, "mel_loss": 4.0, "mel_top1": 0.1},
        {"kind": "train", "step": 2, "text_loss": 4.9, "mel_loss": float("inf"), "mel_top1": 0.2, "lr": 1e-4},
        {"kind": "resume", "step": 2},
        {"kind": "train", "step": 2, "text_loss": 4.8, "mel_loss": 3.9, "mel_top1": 0.2, "lr": 1e-4},
        {"kind": "resume", "step": 4},
        {"step": 6, "val_mel_loss": 1.0},       # not a known kind: ignored
        {"kind": "val", "step": "x"},           # malformed: ignored
    ]
    train, val, resumes = history_series(history)
    assert train["text_loss"] == [(2, 4.8)] and train["mel_loss"] == [(2, 3.9)] and train["lr"] == [(2, 1e-4)]
    assert val["mel_loss"] == [(0, 4.0)] and "lr" not in val
    assert resumes == [2, 4]
    nan_train, _, _ = history_series(history[:3])
    assert math.isnan(nan_train["mel_loss"][0][1])


def test_the_trainer_does_not_import_matplotlib():
    root = Path(__file__).resolve().parents[1] / "trainers"  # the tools' code, trainers/tools, may
    users = [str(p) for p in root.rglob("*.py") if "matplotlib" in p.read_text(encoding="utf-8")
             and (root / "tools") not in p.parents]
    assert users == []


def test_a_run_that_generated_at_validation_gets_the_generation_panels(family_assets: list[str], tmp_path: Path):
    """Each model family."""
    out = tmp_path / "gen"
    done = train_here(out, *family_assets, "--max-steps", "4", "--val-interval", "2", "--sample-interval", "2",
                      "--save-interval", "4", "--log-interval", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    run = load_run(out)
    label_runs([run])
    panels = {ax.get_title(): ax for ax in build_figure([run]).axes}
    gen = {"generation: stop rate": "gen/stop_rate", "generation: length / reference, median": "gen/length_ratio_median"}
    assert set(panels) == {*LOSS_PANELS, "learning rate", *gen}
    history = schema.read(out / "latest.pth").history
    for title, key in gen.items():
        logged = [(e["step"], e[key]) for e in history if e.get("kind") == "val" and key in e]
        line = lines_by_gid(panels[title])["val:gen"][0]
        assert logged and list(zip(line.get_xdata(), line.get_ydata())) == logged, title
