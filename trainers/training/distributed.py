"""Data-parallel training under torchrun: N processes train the single-process run's steps.

    torchrun --nproc_per_node N trainers/train_gpt_v2.py ...      (= python -m torch.distributed.run ...)

torchrun is recognised by the variables it sets (RANK, WORLD_SIZE, LOCAL_RANK). Without them, or
with a world of one process, `World()` is a single process: every method below is the identity or
does nothing, so the single-process trainer is unchanged.

How N processes make the single-process step, whatever N and the micro-batch size:

* Samples. Step k takes the samples the single-process run takes (trainers/data/data_order.py).
  Process r takes the r-th, (r+N)-th, ... of them (a strided slice of the step's list: in the
  grouped order a step is sorted longest first, so every process gets a similar share of the
  tokens) and cuts its share into micro-batches of its own size.
* Loss. Every process divides its summed cross-entropies by the token counts of the *whole* step,
  which it computes from the manifest lengths of the step's samples (no communication), and the
  processes' gradients are summed, not averaged (a DDP communication hook that sums). So the
  gradient is the single-process gradient up to float rounding.
* Dropout masks are keyed by (seed, step, sample), so a sample gets the same mask on any process.
* Communication. Every micro-batch runs under DDP's no_sync(): gradients only accumulate
  locally. Then one forward-backward pass through the DDP wrapper, whose loss is 0 x (the sum of
  every trained parameter), adds zeros to each gradient; that fires DDP's hooks, so DDP sums the
  accumulated gradients over the processes once per step, bucket by bucket. A process with no
  sample in a short last step takes part through the same pass (its gradients are zeros), and so
  does a process whose micro-batch ran out of memory: nobody waits for anybody.
* Agreements, each one small all-reduce on the CPU (gloo): after the gradients (out of memory or
  a bad sample anywhere, and the step's loss sums and token counts, for the log); at every step
  boundary (a stop signal reached any process, or rank 0's background write failed); at every
  checkpoint save and before the last exit (rank 0's write: trainers/training/rank_zero.py);
  after each validation (its sums).
* Waiting. A collective that does not end within --dist-timeout seconds (INDEXTTS_DDP_TIMEOUT_S
  without the flag; 1800 by default) or fails ends the process with exit 6: gloo raises in the
  calling thread; NCCL's gradient sum, asynchronous to the host, is awaited from Python
  (trainers/training/collective_wait.py) before NCCL's own watchdog would abort the process.

Rank 0 alone holds the run directory's lock and writes anything into it: checkpoints, logs,
TensorBoard, sample_ids.tsv, run_config.json, the micro-batch probe cache.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from trainers.data.data_order import StepPlan, StepPlans
from trainers.data.features import FeatureError
from trainers.errors import EXIT_OUT_OF_MEMORY, DistributedFailure, UserError
from trainers.hardware.detect import split_for
from trainers.hardware.oom_recovery import is_out_of_memory, oom_message
from trainers.stop_signals import STOP_SIGNALS, StopRequest, ignore_stop_signals
from trainers.training.collective_wait import await_works, lost_contact
from trainers.training.gradient_sum import wrap_for_gradient_sum
from trainers.training.rank_zero import MainRankCheckpoints
from trainers.training.step_failures import StepFailures
from trainers.training.train_log import StepMetrics
from trainers.training.torchrun_env import (
    DEFAULT_TIMEOUT_S, NCCL_WATCHDOG_MARGIN_S, delay_nccl_watchdog, label_log_lines, read_torchrun_env,
)

log = logging.getLogger("train")

@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    timeout_source: str = "the default"  # --dist-timeout, TIMEOUT_VAR or the default: named at start
    broken: bool = False  # a collective failed: the process group must not be used again
    stop: StopRequest | None = field(default=None, repr=False)  # a signal while waiting for NCCL: see collective_wait
    _started: bool = field(default=False, repr=False)
    _ddp: Any = field(default=None, repr=False)
    _pending: Any = field(default=None, repr=False)  # gradient_sum.PendingSums: the works of the gradient sum
    _checkpoints: Any = field(default=None, repr=False)  # rank_zero.MainRankCheckpoints, once attached

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, timeout_s: float | None = None) -> "World":
        """The process's place in a torchrun job, or a single process when not started by torchrun.
        `timeout_s`: --dist-timeout, which wins over the environment variable."""
        place = read_torchrun_env(dict(os.environ if env is None else env), timeout_s)
        return cls(**place) if place else cls()

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- joining and leaving ----------------------------------------------------------------

    def start(self, stop: StopRequest | None = None) -> "World":
        """Join the other processes (torchrun's env:// rendezvous); control values travel on gloo,
        CUDA gradients on NCCL."""
        self.stop = stop
        if not self.distributed:
            return self
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=self.timeout_s))
        self._started = True
        label_log_lines(self.rank)
        watchdog = delay_nccl_watchdog(self.timeout_s + NCCL_WATCHDOG_MARGIN_S) if "nccl" in backend else ""
        log.info("world: %d processes (torchrun), this is rank %d (local rank %d of %d); backend %s; a process "
                 "waits at most %g s for the others (%s), then exits 6%s", self.size, self.rank, self.local_rank,
                 self.local_size, backend, self.timeout_s, self.timeout_source, watchdog)
        return self

    def close(self) -> None:
        """Leave the process group. From here on the process only exits, with its own status: torchrun
        SIGTERMs the others as soon as one process exits non-zero (143 after a stop, too), and that
        signal must not turn a clean stop into a death by SIGTERM."""
        if self.distributed:
            ignore_stop_signals()
        if self._started and not self.broken:
            self._ddp = None
            dist.destroy_process_group()
        self._started = False

    def place(self, device: torch.device) -> torch.device:
        """Under torchrun each process uses the GPU of its local rank (choose GPUs with CUDA_VISIBLE_DEVICES)."""
        if not self.distributed or device.type != "cuda":
            return device
        if device.index not in (None, self.local_rank) and self.is_main:
            log.warning("--device %s is not used under torchrun: process r uses cuda:LOCAL_RANK; choose the GPUs "
                        "with CUDA_VISIBLE_DEVICES", device)
        if self.local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {self.local_rank} has no GPU: this machine has {torch.cuda.device_count()} "
                            f"CUDA device(s); start at most that many processes per node (--nproc_per_node)")
        return torch.device("cuda", self.local_rank)

    # --- dividing the work ------------------------------------------------------------------

    def rank_batch(self, effective_batch: int) -> int:
        """The most samples of a step one process gets."""
        return math.ceil(effective_batch / self.size)

    def own_items(self, items: Sequence[Any]) -> list[Any]:
        return list(items[self.rank::self.size]) if self.distributed else list(items)

    def own_part(self, plan: StepPlan, micro_batch: int) -> StepPlan:
        """This process's part of a step: its samples (possibly none), cut into micro-batches."""
        if not self.distributed:
            return plan
        mine = self.own_items(plan.samples)
        return StepPlan(plan.epoch, plan.step_in_epoch, [mine[i: i + micro_batch]
                                                         for i in range(0, len(mine), micro_batch)])

    def own_parts(self, plans: StepPlans, micro_batch: int) -> StepPlans:
        """This process's part of each step (what its data loader reads)."""
        return plans.each(lambda plan: self.own_part(plan, micro_batch)) if self.distributed else plans

    # --- start-up ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the body first, the others once it has finished: rank 0 alone changes the run
        directory during set-up (demo data, leftovers of a killed run, damaged checkpoints moved aside),
        so the others read what it left, never a directory in the middle of a change."""
        if not self.distributed:
            yield
            return
        if not self.is_main:
            if not self._main_ready(True):
                raise UserError("rank 0 could not start (see its message); nothing was trained")
            yield
            return
        try:
            yield
        except BaseException:
            with contextlib.suppress(DistributedFailure):
                self._main_ready(False)
            raise
        self._main_ready(True)

    def _main_ready(self, ready: bool) -> bool:
        flag = torch.tensor([int(ready)], dtype=torch.int64)
        self._collective(lambda: dist.broadcast(flag, src=0), "start-up")
        return bool(flag.item())

    def agree_to_start(self, run: Any | None) -> None:
        """After each process's set-up (`run` None: it failed): all start, from the same place, or none.

        A process that failed says so and re-raises its own error; the others stop with status 2.
        """
        if not self.distributed:
            return
        here = [0] * 7 if run is None else [1, run.progress.step, run.data.epoch, run.data.samples_in_epoch,
                                             run.cfg.settings.effective_batch, run.cfg.settings.seed,
                                             len(run.data.samples)]
        mine = torch.tensor(here, dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.size)]
        try:
            self._collective(lambda: dist.all_gather(everyone, mine), "start-up")
        except DistributedFailure:
            if run is None:
                return  # this process's own error is the one to report
            raise
        if run is None:
            return
        failed = [r for r, t in enumerate(everyone) if not t[0]]
        if failed:
            raise UserError(f"process(es) of rank {', '.join(map(str, failed))} could not start (see their "
                            "messages); nothing was trained")
        if any(not torch.equal(t, everyone[0]) for t in everyone):
            rows = "; ".join(f"rank {r}: step {t[1]}, epoch {t[2]} sample {t[3]}, effective batch {t[4]}, seed "
                             f"{t[5]}, {t[6]} samples" for r, t in enumerate(everyone))
            raise UserError("the processes would not continue the same run (" + rows + "). Every node must see the "
                            "same --output-dir and data at the same paths (shared storage); nothing was trained")

    def attach(self, run: Any) -> None:
        """One split for all processes (the smallest probed), DDP around the model, rank 0 as writer."""
        if not self.distributed:
            return
        plan = run.hardware
        smallest = self._reduce([plan.split.micro_batch, plan.val_batch], dist.ReduceOp.MIN, "start-up")
        micro, val_batch = int(smallest[0]), int(smallest[1])
        if micro != plan.split.micro_batch:
            plan.split = split_for(self.rank_batch(run.cfg.settings.effective_batch), micro,
                                   f"{plan.split.reason}; the smallest of the processes")
        plan.val_batch = val_batch
        effective = run.cfg.settings.effective_batch
        if self.size > effective and self.is_main:
            log.warning("%d processes for an effective batch of %d: processes %d to %d never get a sample and only "
                        "wait for the others; use at most %d processes", self.size, effective, effective,
                        self.size - 1, effective)
        self._ddp, self._pending = self._collective(lambda: wrap_for_gradient_sum(run.model, plan.device), "start-up")
        run.checkpoints = self._checkpoints = MainRankCheckpoints(run.checkpoints, self, run.model)  # rank_zero.py

    # --- a step -----------------------------------------------------------------------------

    def without_gradient_sum(self) -> contextlib.AbstractContextManager:
        """Around a step's micro-batches: gradients accumulate locally, nothing is communicated until
        `sum_gradients`."""
        return self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()

    def sum_gradients(self) -> None:
        """Sum the accumulated gradients over the processes (every process must call it once per step,
        also one with no samples and one that ran out of memory: the others wait for it)."""
        if self._ddp is None:
            return
        try:
            self._ddp().backward()
        except RuntimeError as exc:
            self.broken = True
            if is_out_of_memory(exc):
                raise DistributedFailure(
                    f"out of memory while summing the gradients of the processes ({oom_message(exc)}); this cannot "
                    "be redone with a smaller micro-batch, so every process stops. Free GPU memory or use "
                    "--grad-checkpointing", EXIT_OUT_OF_MEMORY) from None
            raise DistributedFailure(lost_contact("summing the gradients", exc)) from None
        try:  # NCCL's sums are still running: wait here, within --dist-timeout (gloo's are done)
            await_works(self._pending.take(), "the gradient sum", self.timeout_s, self.stop)
        except BaseException:  # also a second stop signal (StopNow): a sum may still be running, never destroy it
            self.broken = True
            raise

    def agree_on_step_outcome(self, failures: StepFailures, metrics: StepMetrics) -> tuple[str | None, StepMetrics]:
        """After the gradients: did any process run out of memory (all redo the step: returns the error) or
        meet a bad sample (all stop: raises it)? Also the step's loss sums and token counts over all processes."""
        oom, bad_sample = failures.oom, failures.bad_sample
        if not self.distributed:
            if bad_sample is not None:
                raise bad_sample
            return oom, metrics
        sums = self._reduce([float(oom is not None), float(bad_sample is not None),
                             *metrics.as_list()], None, "a step")
        if sums[1]:
            raise bad_sample or FeatureError("another process stopped at a bad sample (its message names it)")
        if sums[0]:
            return oom or f"out of memory in {int(sums[0])} of {self.size} processes", metrics
        return None, StepMetrics.from_list(sums[2:])

    def agree_to_stop(self, stop: StopRequest) -> bool:
        """At a step boundary: did a stop signal reach any process? Then every process stops here.

        Each process contributes what it had received when it got here; a signal arriving later
        counts at the next boundary, so all processes always decide alike.
        """
        if not self.distributed:
            return stop.requested
        failed = self._checkpoints.write_failed_step() if self._checkpoints is not None else None
        counts = self._reduce([float(stop.signum == s) for s in STOP_SIGNALS] + [float(failed + 1 if failed is not None else 0)], None,
                              "a step boundary")
        failed_write = int(counts.pop())  # 1 + the step of a background write of rank 0 that failed, or 0
        if failed_write:  # every process stops with exit 4, as one process does at its next save
            self._checkpoints.raise_write_failure(failed_write - 1)
        if not any(counts):
            return False
        # The signal most processes received (ties: the lowest number), so all exit with one status.
        stop.signum = max(STOP_SIGNALS, key=lambda s: (counts[STOP_SIGNALS.index(s)], -s))
        if self.is_main:
            log.warning("a stop signal reached %d of %d processes: every process stops at this step boundary",
                        int(sum(counts)), self.size)
        return True

    def sum_validation(self, metrics: dict[str, StepMetrics],
                       error: str | None) -> tuple[dict[str, StepMetrics], str | None]:
        """The validation sums of all processes (per language); out of memory anywhere: all redo it."""
        if not self.distributed:
            return metrics, error
        langs = sorted(metrics)
        flat = [float(error is not None)] + [value for lang in langs for value in metrics[lang].as_list()]
        sums = self._reduce(flat, None, "validation")
        if sums[0]:
            return metrics, error or f"out of memory in {int(sums[0])} of {self.size} processes"
        width = len(StepMetrics().as_list())
        return {lang: StepMetrics.from_list(sums[1 + i * width: 1 + (i + 1) * width]) for i, lang in enumerate(langs)}, None

    def combine_parts(self, table: torch.Tensor, what: str) -> torch.Tensor:
        """Each process filled its own rows of an int64 CPU `table` and left the others zero: the whole table,
        in every process (they wait here)."""
        if not self.distributed:
            return table
        whole = table.clone()
        self._collective(lambda: dist.all_reduce(whole, op=dist.ReduceOp.SUM), what)
        return whole

    # --- collectives ------------------------------------------------------------------------

    def _reduce(self, values: Sequence[float], op: Any, what: str) -> list[float]:
        """All-reduce a few numbers (float64, exact for counts up to 2**53) on the CPU; op None is a sum."""
        tensor = torch.tensor(list(values), dtype=torch.float64)
        self._collective(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op), what)
        return tensor.tolist()

    def _collective(self, call: Any, what: str) -> Any:
        try:
            return call()
        except RuntimeError as exc:  # gloo: "Connection closed by peer"; both backends: a timeout (DistBackendError)
            self.broken = True
            raise DistributedFailure(lost_contact(what, exc)) from None
