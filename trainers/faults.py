"""Fault injection for tests: signal this process at a named point of training.

The training loop reaches every injection below through one seam, `Faults.at(POINT, ...)` (the
points are listed on `Faults`); the variables are read once, at start.

Set INDEXTTS_TRAIN_KILL_AT to one or more (comma-separated) of
  setup               when start-up has finished, before the first step
  micro:STEP:J        after micro-batch J (0-based) of optimizer step STEP (1-based): mid accumulation
  step:STEP           after optimizer step STEP and any checkpoint it saves
  save:STEP:EVENT     during the checkpoint save of STEP, at a checkpoint file event
                      (tmp_written, renamed or linked: model_step{STEP}.pth; best_tmp_written or
                      best_renamed: best.pth, written at a validation before the step's own save)
  validation:STEP     when the validation after STEP optimizer steps begins
  generate:STEP:J     after batch J (0-based) of the samples generated at the validation of STEP
                      (--sample-interval), before their set is written
  exit                at interpreter shutdown (an atexit handler), where gloo's threads can abort a
                      process that lost a torchrun peer: e.g. rank0/SIGABRT@exit. Subprocesses only
each optionally prefixed with a signal name, e.g. SIGTERM@micro:7:1 (default SIGKILL). SIGKILL is
real: nothing gets to clean up, as when a cloud machine is preempted.

Under torchrun (several processes) a point may name the process it applies to:
  rankN/POINT         only the process of rank N (RANK; a single process is rank 0), e.g.
                      rank1/SIGTERM@step:9 signals rank 1 alone
  machine/POINT       SIGKILL to torchrun (the parent) and to the process's own process group (torchrun
                      starts every worker in a session of its own), by every process reaching the point:
                      the whole job dies there, as when the machine is lost. Refused without torchrun
Under torchrun every injected signal is announced on stderr first, with the time, for the tests.

Out-of-memory errors are injected the same way, so the recovery path runs on a CPU:
  INDEXTTS_TRAIN_OOM_ABOVE=N  every forward pass of more than N samples (training, validation
                              and the micro-batch probe) raises torch.OutOfMemoryError
  INDEXTTS_TRAIN_OOM_AT=STEP:J  once, at micro-batch J of optimizer step STEP, after the earlier
                              micro-batches of that step have accumulated their gradients; J may
                              also be "clip" (before unscaling and clipping, no weight changed yet)
                              or "update" (in the optimizer update itself), or "generate" (the first
                              batch generated at the validation of STEP, --sample-interval). A third part ":cublas"
                              raises the RuntimeError cuBLAS gives when it cannot allocate instead
                              (rankN/STEP:J: in the process of rank N only)
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

ENV_VAR = "INDEXTTS_TRAIN_KILL_AT"


MACHINE = "machine/"
KILL_POINTS = ("setup", "micro", "step", "validation", "generate")  # the loop's points a kill may name (and save:, exit)


def for_this_process(spec: str) -> str | None:
    """`rankN/SPEC` is SPEC in the process of rank N (torchrun's RANK) and None elsewhere; other specs apply to all."""
    head, sep, rest = spec.partition("/")
    if sep and head.startswith("rank") and head[4:].isdigit():
        return rest if int(head[4:]) == int(os.environ.get("RANK", "0")) else None
    return spec


@dataclass(frozen=True)
class KillPoint:
    points: tuple[tuple[str, int, bool], ...] = ()  # (point, signal number, the whole machine)
    launcher: int | None = None  # torchrun's pid, read at start: once it is gone the parent is someone else

    @classmethod
    def from_env(cls, var: str = ENV_VAR) -> "KillPoint":
        """The points armed by `var` (another tool names its own variable: indextts-prepare's
        INDEXTTS_PREPARE_KILL_AT, trainers/tools/prepare/store.py)."""
        points = []
        for spec in filter(None, map(for_this_process, (os.environ.get(var) or "").split(","))):
            machine = spec.startswith(MACHINE)
            if machine and "RANK" not in os.environ:
                raise ValueError(f"{var}={spec}: {MACHINE} kills torchrun and its worker's process group; "
                                 "without torchrun that would be the caller's own")
            name, _, point = spec.removeprefix(MACHINE).rpartition("@")
            points.append((point, signal.Signals[name].value if name else signal.SIGKILL, machine))
        kill = cls(tuple(points), os.getppid() if any(m for _, _, m in points) else None)
        if kill.armed("exit"):
            atexit.register(kill.check, "exit")
        return kill

    def armed(self, *parts: object) -> bool:
        here = ":".join(str(p) for p in parts)
        return any(point == here for point, _, _ in self.points)

    def check(self, *parts: object) -> None:
        here = ":".join(str(p) for p in parts)
        for point, signum, machine in self.points:
            if point == here:
                if "RANK" in os.environ:
                    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} fault injection: rank "
                                     f"{os.environ['RANK']} sends {signal.Signals(signum).name} at {here}"
                                     f"{' to torchrun and itself' if machine else ''}\n")
                    sys.stderr.flush()
                if machine:
                    if os.getppid() == self.launcher:  # not yet killed by another worker
                        os.kill(self.launcher, signal.SIGKILL)
                    os.killpg(0, signal.SIGKILL)
                os.kill(os.getpid(), signum)

    def on_checkpoint_event(self, event: str, step: int) -> None:
        self.check("save", step, event)


OOM_ABOVE_VAR = "INDEXTTS_TRAIN_OOM_ABOVE"
OOM_AT_VAR = "INDEXTTS_TRAIN_OOM_AT"


@dataclass
class OomInjector:
    above: int | None = None
    at: str | None = None

    @classmethod
    def from_env(cls) -> "OomInjector":
        above = os.environ.get(OOM_ABOVE_VAR)
        return cls(int(above) if above else None, for_this_process(os.environ.get(OOM_AT_VAR) or "") or None)

    @property
    def active(self) -> bool:
        return self.above is not None or self.at is not None

    def check(self, size: int, step: int | None = None, micro: int | str | None = None) -> None:
        """Raise the error CUDA raises, as if this forward pass of `size` samples ran out of memory."""
        if self.above is not None and size > self.above:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {size} samples > {OOM_ABOVE_VAR}={self.above})")
        if self.at is not None and self.at.split(":")[:2] == [str(step), str(micro)]:
            spec, self.at = self.at, None  # once: the redone step must succeed
            if spec.endswith(":cublas"):
                # cuBLAS's own text, marked: as long as a log line allows (tests/demo_runs.py checks the lines)
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)` (injected)")
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {OOM_AT_VAR}={spec})")


NAN_FROM_VAR = "INDEXTTS_TRAIN_NAN_FROM"
NAN_WEIGHTS_VAR = "INDEXTTS_TRAIN_NAN_WEIGHTS_AT"


@dataclass(frozen=True)
class NanInjector:
    """Divergence on demand, for the tests of what the trainer does when training goes non-finite.

    INDEXTTS_TRAIN_NAN_FROM=STEP        the loss of every optimizer step from STEP (1-based) on is NaN (its
                                        gradients are made NaN after each backward, as that loss makes them)
    INDEXTTS_TRAIN_NAN_WEIGHTS_AT=STEP  after the update of step STEP, one weight becomes NaN (as a
                                        finite gradient times an infinite learning rate would make it)
    """

    loss_from: int | None = None
    weights_at: int | None = None

    @classmethod
    def from_env(cls) -> "NanInjector":
        loss, weights = os.environ.get(NAN_FROM_VAR), os.environ.get(NAN_WEIGHTS_VAR)
        return cls(int(loss) if loss else None, int(weights) if weights else None)

    @staticmethod
    @torch.no_grad()
    def corrupt_gradients(params: list[torch.nn.Parameter]) -> None:
        """Every gradient NaN, as a NaN loss makes them (its backward multiplies each one by NaN)."""
        for p in params:
            if p.grad is not None:
                p.grad.mul_(float("nan"))

    def after_update(self, step: int, params: list[torch.nn.Parameter]) -> None:
        if self.weights_at == step and params:
            with torch.no_grad():
                params[0].view(-1)[0] = float("nan")


@dataclass
class Faults:
    """The one seam between the training loop and the fault injections above: the loop names its points
    with `at(...)`; whatever the environment armed acts there (all inactive unless their variable is set).

    Points, in the order a step passes them (STEP 1-based, J the micro-batch):
      setup                       start-up finished
      forward STEP J size=N       before the forward pass of micro-batch J (out of memory: OOM_ABOVE, OOM_AT)
      micro STEP J                after its backward (NaN gradients from NAN_FROM on, as a NaN loss makes them;
                                  KILL_AT micro:STEP:J)
      clip STEP / update STEP     before the clipping / the optimizer update (OOM_AT STEP:clip, STEP:update)
      updated STEP                after the update (NAN_WEIGHTS_AT)
      step STEP                   after the step and any checkpoint it saves (KILL_AT step:STEP, which first
                                  waits for this process's own write)
      validation STEP             a validation begins (KILL_AT validation:STEP)
      validation-batch size=N     before a validation batch's forward pass (OOM_ABOVE)
      generation-batch STEP size=N  before a batch of the samples generated at that validation (OOM_ABOVE,
                                  OOM_AT STEP:generate)
      generate STEP J             after its J-th batch (KILL_AT generate:STEP:J)
    and checkpoint file events (KILL_AT save:STEP:EVENT) through the subscription `attach` makes.
    """

    kill: KillPoint
    nan: NanInjector
    oom: OomInjector | None = None  # the hardware plan's, once attached: the micro-batch probe uses it too
    checkpoints: Any = field(default=None, repr=False)  # the run's Checkpointer, once attached
    params: list[torch.nn.Parameter] = field(default_factory=list, repr=False)  # the trained weights

    @classmethod
    def from_env(cls) -> "Faults":
        return cls(KillPoint.from_env(), NanInjector.from_env())

    def attach(self, checkpoints: Any, oom: OomInjector, params: list[torch.nn.Parameter]) -> None:
        """Subscribe to the run's components: its checkpoint file events, its out-of-memory injector, its weights."""
        checkpoints.on_file_event(self.kill.on_checkpoint_event)
        self.checkpoints, self.oom, self.params = checkpoints, oom, params

    def at(self, point: str, step: int | None = None, part: int | None = None, size: int = 0) -> None:
        """The loop is at `point` (see the class docstring): act on what is armed there."""
        if point in ("forward", "validation-batch", "clip", "update", "generation-batch") and self.oom is not None:
            which = {"forward": part, "validation-batch": None, "generation-batch": "generate"}.get(point, point)
            self.oom.check(size, step, which)
        if point == "micro" and self.nan.loss_from is not None and step >= self.nan.loss_from:
            self.nan.corrupt_gradients(self.params)
        if point == "updated":
            self.nan.after_update(step, self.params)
        if point == "step" and self.checkpoints is not None and self.kill.armed("step", step):
            self.checkpoints.wait_own()  # "after step N and any checkpoint it saves"
        if point in KILL_POINTS:
            self.kill.check(*(p for p in (point, step, part) if p is not None))
