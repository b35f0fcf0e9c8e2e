"""Plot the training history of one or more runs into a PNG: losses, mel top-1 and LR against step.

    python tools/plot_runs.py runs/my_voice [runs/other ...] --out runs.png

Four panels (text loss, mel loss, mel top-1 accuracy, learning rate), two more where a run generated
at validation (--sample-interval: the share of samples that stopped, generated / reference length), and
one per validation language where a run validated several languages or ran the forgetting guard
(--forgetting-limit): that language's validation mel loss against its base model's, in percent (the
forgetting measure; a base language's limit as a dotted horizontal line); one colour per run:
training values solid, validation values dashed with dots, a dotted vertical line at each step
where the run was resumed and a dash-dot one at the step of its best.pth (if it has one).

Each run's history is read from its newest checkpoint (the one `--resume auto` would pick),
with tensors mapped rather than read, so a multi-GB checkpoint costs a few kilobytes of I/O.
A run without a checkpoint yet is reported and skipped; with none to plot the exit status is 2.

matplotlib is needed by this tool only (requirements.txt); it draws with the Agg backend, so no
display is needed. The trainer never imports it.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from trainers.checkpoint import schema  # noqa: E402
from trainers.errors import UserError  # noqa: E402
from trainers.files import write_atomically  # noqa: E402
from trainers.tools import tool_main  # noqa: E402
from trainers.tools.run_files import BEST_NAME, newest_checkpoint  # noqa: E402
from trainers.torch_files import CheckpointError  # noqa: E402

# (history key, panel title, has validation values)
PANELS = (
    ("text_loss", "text loss", True),
    ("mel_loss", "mel loss", True),
    ("mel_top1", "mel top-1 accuracy", True),
    ("lr", "learning rate", False),
)
# Shown only when a run generated at validation (--sample-interval): what the model does when it speaks alone.
GEN_PANELS = (
    ("gen/stop_rate", "generation: stop rate", True),
    ("gen/length_ratio_median", "generation: length / reference, median", True),
)
TRAIN_STYLE = {"linestyle": "-", "linewidth": 1.4}
VAL_STYLE = {"linestyle": "--", "linewidth": 1.4, "marker": "o", "markersize": 3.5}
RESUME_STYLE = {"linestyle": ":", "linewidth": 1.2, "alpha": 0.9}
BEST_STYLE = {"linestyle": "-.", "linewidth": 1.6, "alpha": 0.9}

Points = list[tuple[int, float]]


@dataclass
class RunHistory:
    """What is plotted of one run."""

    run_dir: Path
    checkpoint: Path
    step: int
    train: dict[str, Points] = field(default_factory=dict)
    val: dict[str, Points] = field(default_factory=dict)
    resumes: list[int] = field(default_factory=list)
    best: int | None = None
    label: str = ""
    notes: list[str] = field(default_factory=list)
    # The forgetting measure: per validation language, its mel loss against the base's (%) at each validation;
    # the guard's limit (%) per base language, from the last validation it judged.
    forgetting: dict[str, Points] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)


def _value(x: Any) -> float | None:
    """A plottable number: non-finite values (a diverged step) become NaN, a gap in the line."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else math.nan


def history_series(history: list[Any]) -> tuple[dict[str, Points], dict[str, Points], list[int]]:
    """Train and validation points per metric, and the resume steps; a step logged twice (say, validated again
    after a resume) keeps its newest value."""
    by_kind: dict[str, dict[str, dict[int, float]]] = {"train": {}, "val": {}}
    resumes: list[int] = []
    for entry in history:
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
            continue
        kind, step = entry.get("kind"), entry["step"]
        if kind == "resume":
            resumes.append(step)
        elif kind in by_kind:
            for key, _, has_val in PANELS + GEN_PANELS:
                value = _value(entry.get(key))
                if value is not None and (kind == "train" or has_val):
                    by_kind[kind].setdefault(key, {})[step] = value
    train, val = ({k: sorted(points.items()) for k, points in by_kind[kind].items()} for kind in ("train", "val"))
    return train, val, sorted(set(resumes))


def forgetting_series(history: list[Any]) -> tuple[dict[str, Points], dict[str, float]]:
    """Each validation language's mel loss change from its base (%), per step, and the guard's limits (%)."""
    series: dict[str, dict[int, float]] = {}
    limits: dict[str, float] = {}
    for entry in history:
        if not isinstance(entry, dict) or entry.get("kind") != "val" or not isinstance(entry.get("step"), int):
            continue
        for lang, change in (entry.get("forgetting") or {}).items():
            value = _value(change.get("mel_loss_rel")) if isinstance(change, dict) else None
            if value is not None:
                series.setdefault(str(lang), {})[entry["step"]] = 100 * value
        guard = entry.get("forgetting_guard")
        if isinstance(guard, dict) and guard.get("metric") == "mel_loss" and _value(guard.get("limit")) is not None:
            limits = {str(lang): 100 * guard["limit"] for lang in guard.get("languages", [])}
    return {lang: sorted(points.items()) for lang, points in series.items()}, limits


def load_run(run_dir: Path) -> RunHistory:
    """The run's history from its newest checkpoint; UserError says why a run cannot be plotted."""
    if not run_dir.is_dir():
        raise UserError("no such directory")
    for attempt in (1, 2):  # a run still training may rotate the file away between finding and reading it
        path = newest_checkpoint(run_dir)
        if path is None:
            raise UserError("no checkpoint yet (no latest.pth or model_step*.pth): the run has not saved one")
        try:
            ckpt = schema.read(path, mmap=True)
            break
        except CheckpointError as exc:
            if attempt == 2 or path.exists():
                raise UserError(f"{path.name}: {exc.reason}") from None
    train, val, resumes = history_series(ckpt.history)
    run = RunHistory(run_dir, path, ckpt.step, train, val, resumes)
    run.forgetting, run.limits = forgetting_series(ckpt.history)
    best = run_dir / BEST_NAME
    if best.is_file():
        try:
            run.best = schema.read(best, mmap=True).step
        except CheckpointError as exc:
            run.notes.append(f"{BEST_NAME} not marked: {exc.reason}")
    if not train and not val:
        run.notes.append("no training or validation values logged yet")
    return run


def label_runs(runs: list[RunHistory]) -> None:
    """Each run is named by its directory, or by its path where two directories share a name."""
    names = [r.run_dir.name or str(r.run_dir) for r in runs]
    for run, name in zip(runs, names):
        run.label = name if names.count(name) == 1 else str(run.run_dir)


def run_colours(n: int) -> list[Any]:
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "turbo"]
    return [cmap(i) if n <= 10 else cmap(i / max(n - 1, 1)) for i in range(n)]


def build_figure(runs: list[RunHistory]) -> Figure:
    """The figure for `runs`: one axes per panel; data lines and marker lines carry a gid naming
    what they show ("train:LABEL", "val:LABEL", "resume:LABEL", "best:LABEL"), for tests and readers."""
    generated = any(run.val.get(key) for run in runs for key, _, _ in GEN_PANELS)
    panels = PANELS + GEN_PANELS if generated else PANELS
    languages = forgetting_languages(runs)
    rows = math.ceil((len(panels) + len(languages)) / 2)
    fig = Figure(figsize=(13, 4.25 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 2, sharex=True).flatten()
    colours = run_colours(len(runs))
    for ax, lang in zip(axes[len(panels):], languages):
        forgetting_panel(ax, lang, runs, colours)
    for ax in axes[len(panels) + len(languages):]:
        ax.set_visible(False)
    for ax, (key, title, _) in zip(axes, panels):
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        drawn = False
        for run, colour in zip(runs, colours):
            for kind, style in (("train", TRAIN_STYLE), ("val", VAL_STYLE)):
                points = getattr(run, kind).get(key)  # kind: "train" or "val"
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, color=colour, gid=f"{kind}:{run.label}", **style)
                    drawn = True
            for step in run.resumes:
                ax.axvline(step, color=colour, gid=f"resume:{run.label}", **RESUME_STYLE)
            if run.best is not None:
                ax.axvline(run.best, color=colour, gid=f"best:{run.label}", **BEST_STYLE)
        if not drawn:
            ax.text(0.5, 0.5, "no values logged", transform=ax.transAxes, ha="center", va="center", color="grey")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in [a for a in axes if a.get_visible()][-2:]:
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles = [Line2D([], [], color=c, linewidth=3, label=r.label) for r, c in zip(runs, colours)]
    lines = [("train", TRAIN_STYLE), ("validation", VAL_STYLE), ("resumed", RESUME_STYLE), ("best.pth", BEST_STYLE)]
    if any(run.limits for run in runs):
        lines.append(("--forgetting-limit", RESUME_STYLE))
    handles += [Line2D([], [], color="black", label=label, **style) for label, style in lines]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), frameon=False)
    return fig


def forgetting_languages(runs: list[RunHistory]) -> list[str]:
    """The languages that get a forgetting panel: all of them where a run validated several or ran the guard."""
    languages = sorted({lang for run in runs for lang in run.forgetting})
    return languages if len(languages) > 1 or any(run.limits for run in runs) else []


def forgetting_panel(ax: Any, lang: str, runs: list[RunHistory], colours: list[Any]) -> None:
    """One language's validation mel loss against its base model's, in percent, per run (gid "forgetting:LABEL"),
    with the guard's limit where it watches this language (gid "limit:LABEL")."""
    ax.set_title(f"forgetting: {lang} (validation mel loss vs base, %)")
    ax.grid(True, alpha=0.3)
    ax.axhline(0, color="grey", linewidth=0.8)
    for run, colour in zip(runs, colours):
        points = run.forgetting.get(lang)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, color=colour, gid=f"forgetting:{run.label}", **VAL_STYLE)
        if lang in run.limits:
            ax.axhline(run.limits[lang], color=colour, gid=f"limit:{run.label}", **RESUME_STYLE)


def describe(run: RunHistory) -> str:
    counts = {kind: max((len(p) for p in getattr(run, kind).values()), default=0) for kind in ("train", "val")}
    parts = [f"{run.label}: {run.checkpoint.name} at step {run.step}, {counts['train']} train and "
             f"{counts['val']} validation points"]
    if run.resumes:
        parts.append("resumed at step " + ", ".join(str(s) for s in run.resumes))
    if run.best is not None:
        parts.append(f"best.pth at step {run.best}")
    return "; ".join(parts + run.notes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Plot train/validation losses, mel top-1 and LR of runs into a PNG.")
    parser.add_argument("runs", type=Path, nargs="+", help="run directories (each holding latest.pth)")
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write, e.g. runs.png")
    return parser.parse_args(argv)


@tool_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.out.is_dir():
        raise UserError(f"--out {args.out} is a directory; name the PNG file to write")
    if args.out.suffix.lower() != ".png":
        raise UserError(f"--out {args.out}: the plot is a PNG; name it *.png")
    runs = []
    for run_dir in args.runs:
        try:
            runs.append(load_run(run_dir))
        except UserError as exc:
            print(f"skipped {run_dir}: {exc}", file=sys.stderr)
    if not runs:
        raise UserError("none of the runs can be plotted (see above); nothing was written")
    label_runs(runs)
    figure = build_figure(runs)
    try:  # under a temporary name, then renamed: a reader never sees half an image
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(args.out, lambda f: figure.savefig(f, format="png", dpi=110))
    except OSError as exc:
        raise UserError(f"could not write {args.out}: {exc.strerror or exc}") from None
    for run in runs:
        print(describe(run))
    print(f"wrote {args.out}")
    return 0
