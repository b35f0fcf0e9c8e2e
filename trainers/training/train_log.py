"""Where training reports go: log lines, TensorBoard, the metrics history, sample-id records."""
from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from tqdm import tqdm

from trainers.errors import LogWriteError
from trainers.files import os_error_in_chain, write_text_atomically

log = logging.getLogger("train")


class _TqdmHandler(logging.StreamHandler):
    """Log lines that do not tear the progress bar apart."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging must never kill training
            self.handleError(record)


def setup_logging() -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


# The sums a step's metrics keep, by the names the model's loss_sums gives them. Their order lays out the tensor
# that holds them and the lists the processes of a torchrun job sum (all run the same code); a checkpoint saves
# them by name (LogInterval), so a version that adds one resumes the open interval of an earlier version.
SUMS = ("text_ce", "mel_ce", "text_tokens", "mel_tokens", "mel_correct")
# The positional form every checkpoint held before the sums were saved by name ("sums": these, then the sample
# count). Still written beside the named form, for earlier releases that read only it: never change it.
POSITIONAL_SUMS = ("text_ce", "mel_ce", "text_tokens", "mel_tokens", "mel_correct")


@dataclass
class StepMetrics:
    """Sums over a step (or an interval, or a validation); per-token means when logged.

    The sums stay a tensor on the device they were computed on, so adding a micro-batch's or a
    step's costs no host-device synchronisation; they are read once, by `means()`.
    """

    sums: Any = None  # float64 tensor of the SUMS, on the device of the first add
    samples: int = 0

    def add(self, sums: dict[str, Any], samples: int) -> None:
        values = torch.stack([torch.as_tensor(sums[k]).to(torch.float64) for k in SUMS])
        self.merge(StepMetrics(values, samples))

    def as_list(self) -> list[float]:
        """The sums and the sample count as plain numbers (one synchronisation), e.g. to all-reduce."""
        return [*(self.sums.tolist() if self.sums is not None else [0.0] * len(SUMS)), float(self.samples)]

    @classmethod
    def from_list(cls, values: list[float]) -> "StepMetrics":
        """The inverse of `as_list`."""
        return cls(torch.tensor(values[: len(SUMS)], dtype=torch.float64), int(round(values[len(SUMS)])))

    def merge(self, other: "StepMetrics") -> None:
        if other.sums is not None:
            self.sums = other.sums if self.sums is None else self.sums + other.sums.to(self.sums.device)
        self.samples += other.samples

    @classmethod
    def total(cls, parts: Iterable["StepMetrics"]) -> "StepMetrics":
        total = cls()
        for part in parts:
            total.merge(part)
        return total

    def named(self) -> dict[str, float]:
        """The sums by name (one synchronisation)."""
        return dict(zip(SUMS, self.as_list()))

    def means(self) -> dict[str, float]:
        s = self.named()
        return {
            "text_loss": s["text_ce"] / max(1.0, s["text_tokens"]),
            "mel_loss": s["mel_ce"] / max(1.0, s["mel_tokens"]),
            "mel_top1": s["mel_correct"] / max(1.0, s["mel_tokens"]),
        }


@dataclass
class LogInterval:
    """The open log interval: the steps since the last "train" entry of the history, summed.

    Owned by TrainingProgress and saved with it, so a run resumed mid-interval logs the entry the
    uninterrupted run logs (the sums are float64 and travel as plain floats: bit-exact). Under
    torchrun rank 0 alone adds to it, the steps' metrics over all processes: what it logs and saves.
    """

    metrics: StepMetrics = field(default_factory=StepMetrics)
    steps: int = 0
    seconds: float = 0.0  # wall time of the steps, for samples/s
    lr: float = 0.0  # of the interval's last step: the values its log line shows
    grad_norm: float = 0.0

    def add(self, metrics: StepMetrics, lr: float, grad_norm: float, seconds: float) -> None:
        self.metrics.merge(metrics)  # on the device: no synchronisation
        self.steps += 1
        self.seconds += seconds
        self.lr, self.grad_norm = lr, grad_norm

    def clear(self) -> None:
        """In place: TrainLog and TrainingProgress hold the same object."""
        self.metrics, self.steps, self.seconds = StepMetrics(), 0, 0.0

    def state_dict(self) -> dict[str, Any]:
        named = self.metrics.named()
        return {"named_sums": named, "samples": self.metrics.samples,
                "sums": [named.get(k, 0.0) for k in POSITIONAL_SUMS] + [float(self.metrics.samples)],
                "steps": self.steps, "seconds": float(self.seconds), "lr": float(self.lr),
                "grad_norm": float(self.grad_norm)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        named = state.get("named_sums")
        if named is None:  # saved by a release that kept the sums by position only
            named, samples = dict(zip(POSITIONAL_SUMS, state["sums"])), state["sums"][len(POSITIONAL_SUMS)]
        else:
            samples = state["samples"]
        self.steps, self.seconds = int(state["steps"]), float(state["seconds"])
        self.lr, self.grad_norm = float(state["lr"]), float(state["grad_norm"])
        saved = [float(named.get(k, 0.0)) for k in SUMS] + [samples]  # a sum it lacks: 0
        self.metrics = StepMetrics.from_list(saved) if self.steps else StepMetrics()
        missing = [k for k in SUMS if k not in named]
        if self.steps and missing:
            log.info("the saved log interval lacks %s (an older version): counted from this resume", ", ".join(missing))


def _io_errors_stop_the_run(method: Callable) -> Callable:
    """A failed log write (full disk, file-size limit) ends the run cleanly (exit 4) instead of a traceback.
    TensorBoard writes in a thread and re-raises the thread's error at the next call, so it lands here too."""
    @functools.wraps(method)
    def guarded(self: "TrainLog", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (OSError, RuntimeError) as exc:
            cause = os_error_in_chain(exc)
            if cause is None:
                raise
            raise LogWriteError(f"could not write the training log in {self.run_dir}: {cause}; free disk space, then "
                                f"continue with --resume auto --output-dir {self.run_dir}") from None
    return guarded


class _QuietTensorBoardThread:
    """While the log is open, an I/O error in TensorBoard's writer thread is one log line, not a traceback
    (the error itself surfaces at the next write and stops the run)."""

    def __init__(self) -> None:
        self.previous = threading.excepthook
        threading.excepthook = self._hook

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            log.error("TensorBoard could not write its event file: %s", args.exc_value)
            return
        self.previous(args)

    def restore(self) -> None:
        # A writer thread that failed may not have reached the hook yet (the error is stored before it is raised):
        # it ends at once, so let it pass the hook first.
        for thread in threading.enumerate():
            if type(thread).__name__ == "_AsyncWriterThread" and getattr(thread, "exception", None) is not None:
                thread.join(timeout=5)
        threading.excepthook = self.previous


@dataclass
class TrainLog:
    run_dir: Path
    start_step: int
    history: list[dict[str, Any]] = field(default_factory=list)
    record_sample_ids: bool = False
    interval: LogInterval = field(default_factory=LogInterval)  # the run's (TrainingProgress): added to in place

    @_io_errors_stop_the_run
    def __post_init__(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a killed run wrote after the checkpoint we resume from.
        _after_the_newest_event_file(self.run_dir / "logs")
        self._quiet = _QuietTensorBoardThread()  # first: the writer's constructor already writes, in its thread
        try:
            self.writer = SummaryWriter(str(self.run_dir / "logs"), purge_step=self.start_step + 1)
        except BaseException:
            self._quiet.restore()  # close() is never called on a log that did not open
            raise
        self.sample_ids_path = self.run_dir / "sample_ids.tsv"
        if self.record_sample_ids:
            _truncate_sample_ids(self.sample_ids_path, self.start_step)
        self._pending: list[tuple[int, StepMetrics, float, float, float]] = []  # steps not yet in TensorBoard
        self.started = time.monotonic()  # this invocation's training: its elapsed time and pace

    def train_step(self, step: int, metrics: StepMetrics, lr: float, grad_norm: float, seconds: float) -> None:
        """Keep a step's metrics (on the device) until they are written: no synchronisation per step.
        The interval has every step done at once, so any checkpoint saves the whole open interval."""
        self._pending.append((step, metrics, lr, grad_norm, seconds))
        self.interval.add(metrics, lr, grad_norm, seconds)

    @_io_errors_stop_the_run
    def write_steps(self) -> None:
        """Write the kept steps' scalars to TensorBoard (called before each save, so a resume leaves no gap)."""
        for at, metrics, lr, grad_norm, seconds in self._pending:
            for name, value in metrics.means().items():
                self.writer.add_scalar(f"train/{name}", value, at)
            self.writer.add_scalar("train/lr", lr, at)
            self.writer.add_scalar("train/grad_norm", grad_norm, at)
            self.writer.add_scalar("train/samples_per_second", metrics.samples / max(seconds, 1e-9), at)
        self._pending = []
        self.writer.flush()

    @_io_errors_stop_the_run
    def flush_interval(self, step: int, epoch: int, total_steps: int) -> dict[str, float] | None:
        """Write the kept steps and the interval's two log lines (its losses; its pace, elapsed time and an
        estimate of the time left, which a log without a terminal has no progress bar for); returns the
        interval's means."""
        self.write_steps()
        interval = self.interval
        if not interval.steps:
            return None
        means = interval.metrics.means()
        lr, grad_norm = interval.lr, interval.grad_norm
        rate = interval.metrics.samples / max(interval.seconds, 1e-9)
        log.info("step %d/%d epoch %d text_loss %.4f mel_loss %.4f mel_top1 %.4f lr %.3e", step, total_steps, epoch,
                 means["text_loss"], means["mel_loss"], means["mel_top1"], lr)
        elapsed = time.monotonic() - self.started
        done = step - self.start_step  # this invocation's steps: their pace, validations and saves included
        left = elapsed / done * (total_steps - step) if done > 0 else math.nan
        log.info("step %d/%d grad_norm %.3f samples/s %.1f elapsed %s eta %s", step, total_steps, grad_norm, rate,
                 clock_text(elapsed), clock_text(left))
        self.history.append({"kind": "train", "step": step, "epoch": epoch, **means, "lr": lr, "grad_norm": grad_norm})
        interval.clear()
        return means

    @_io_errors_stop_the_run
    def validation(self, step: int, by_lang: dict[str, StepMetrics], model: str = "") -> dict[str, float]:
        """Log a validation; with several languages (--val-manifest F::LANG or the lines' "language"), also each
        language's losses, as val/LANG/... in TensorBoard and "langs" in the history. `model`: the figures of other
        weights at this validation (a listener's, validated with Validation.again): val/MODEL/..., "validation step
        S MODEL ..." and the step's history entry's MODEL/... fields."""
        prefix, metrics = f"{model}/" if model else "", StepMetrics.total(by_lang.values())
        means = metrics.means()
        fields: dict[str, Any] = {prefix + k: v for k, v in means.items()}
        lines, scalars = [_validation_line(step, model, means, metrics.samples)], {}
        if len(by_lang) > 1:
            langs = fields[f"{prefix}langs"] = {}
            for lang, lang_metrics in sorted(by_lang.items()):
                name = lang or "unknown"
                langs[name] = lang_metrics.means()
                scalars.update({f"val/{prefix}{name}/{k}": v for k, v in langs[name].items()})
                lines.append(_validation_line(step, f"{model} language {name}".strip(), langs[name],
                                              lang_metrics.samples))
        if not model:
            self.history.append({"kind": "val", "step": step})
        self.report(step, {**{f"val/{prefix}{k}": v for k, v in means.items()}, **scalars}, lines, fields=fields)
        return means

    @_io_errors_stop_the_run
    def report(self, step: int, scalars: dict[str, float], lines: Sequence[str] = (), warnings: Sequence[str] = (),
               fields: dict[str, Any] | None = None) -> None:
        """A validation listener's part of the validation of `step`: TensorBoard scalars, log lines and warnings,
        and the fields its history entry gains."""
        for line in lines:
            log.info("%s", line)
        for line in warnings:
            log.warning("%s", line)
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        if fields:
            self._validation_entry(step).update(fields)
        self.writer.flush()

    def _validation_entry(self, step: int) -> dict[str, Any]:
        """The history entry of this step's validation (appended if there is none)."""
        entry = self.history[-1] if self.history and self.history[-1].get("kind") == "val" else None
        if entry is None or entry["step"] != step:
            entry = {"kind": "val", "step": step}
            self.history.append(entry)
        return entry

    def scalar(self, name: str, value: float, step: int) -> None:
        self.report(step, {name: value})

    @_io_errors_stop_the_run
    def sample_ids(self, step: int, epoch: int, ids: list[str]) -> None:
        if self.record_sample_ids:
            with open(self.sample_ids_path, "a", encoding="utf-8") as f:
                f.write(f"{step}\t{epoch}\t{','.join(ids)}\n")

    def close(self) -> None:
        try:
            self.writer.close()
        except (OSError, RuntimeError) as exc:  # closing after a failure: the failure was already reported
            log.debug("closing the TensorBoard writer: %s", exc)
        finally:
            self._quiet.restore()


def _validation_line(step: int, what: str, means: dict[str, float], samples: int) -> str:
    return (f"validation step {step} {what + ' ' if what else ''}text_loss {means['text_loss']:.4f} mel_loss "
            f"{means['mel_loss']:.4f} mel_top1 {means['mel_top1']:.4f} samples {samples}")


def clock_text(seconds: float) -> str:
    """H:MM:SS (hours not bounded), or ? when not known."""
    if not math.isfinite(seconds):
        return "?"
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _after_the_newest_event_file(logs: Path) -> None:
    """TensorBoard reads a run's event files in name order, and a name starts with its creation second
    (then host and pid): a file created in the same second as the previous invocation's (one that was
    killed within a second of opening it) could sort before it, and that file's purge would then hide
    every step written after the resume. Waiting for the next second (at most 1 s) keeps the order."""
    seconds = [int(p.name.split(".")[3]) for p in logs.glob("events.out.tfevents.*")
               if len(p.name.split(".")) > 3 and p.name.split(".")[3].isdigit()]
    wait = max(seconds, default=0) + 1 - time.time()
    if 0 < wait <= 1:  # more: a file from the future (the clock was set back), which waiting would not fix
        time.sleep(wait)


def _truncate_sample_ids(path: Path, keep_up_to_step: int) -> None:
    """Forget steps a killed run recorded after the checkpoint being resumed."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    # A line without its newline was cut off by a kill; the step it began is redone.
    kept = [ln for ln in lines if ln.endswith("\n") and int(ln.split("\t", 1)[0]) <= keep_up_to_step]
    if len(kept) != len(lines):
        write_text_atomically(path, "".join(kept))
