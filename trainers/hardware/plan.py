"""How this machine runs the run's steps: device, AMP dtype, micro-batch split, loader workers.

None of it changes the result beyond float rounding, so it may change between invocations and
machines. The "hardware" section of a checkpoint records what the last steps used, so a resume
on another machine can say what changed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainers.config.settings import TrainConfig
from trainers.data.sample_table import SampleTable
from trainers.faults import OomInjector
from trainers.log_lines import log_fitting
from trainers.hardware.batch_probe import ProbeCache, ProbeKey, largest_fitting, model_fits
from trainers.hardware.detect import (
    CPU_MICRO_BATCH, BatchSplit, Hardware, auto_workers, choose_split, configure_device, split_for,
)
from trainers.hardware.oom_recovery import OutOfMemoryStop, halved
from trainers.hardware.precision import AmpChoice, choose_amp
from trainers.model.gpt_model import UnifiedVoiceGPT

log = logging.getLogger("train")


@dataclass
class HardwarePlan:
    machine: Hardware  # the device and what it can do
    amp_dtype: torch.dtype | None
    split: BatchSplit  # the current split of a step; out-of-memory recovery makes it smaller
    num_workers: int
    workers_reason: str
    val_batch: int
    oom: OomInjector
    tf32: bool = False
    probe: tuple[ProbeCache, ProbeKey] | None = None  # where to record a micro-batch that proved too large
    world_size: int = 1  # processes under torchrun; the split above is then each process's
    amp_reason: str = ""  # why amp_dtype, for the start-up summary

    @property
    def device(self) -> torch.device:
        return self.machine.device

    def halve_micro_batch(self, effective_batch: int, where: str, error: str) -> BatchSplit:
        """The next split after an out-of-memory error; returns the old one (OutOfMemoryStop at 1)."""
        old = self.split
        self.split = split_for(effective_batch, halved(old.micro_batch, where, error),
                               "halved after running out of memory")
        if self.probe is not None:  # the next start on this machine begins at the size that worked
            cache, key = self.probe
            cache.store(key, self.split.micro_batch, f"halved after running out of memory at {where}",
                        out_of_memory_at=old.micro_batch)
        return old

    def record_out_of_memory(self, effective_batch: int, where: str, error: str) -> str:
        """After an out-of-memory error that stops the run (in the optimizer update, or in the gradient sum
        under torchrun): the next start on this machine begins at half the micro-batch. Returns what to tell
        the user."""
        try:
            self.halve_micro_batch(effective_batch, where, error)
        except OutOfMemoryStop:
            return "The micro-batch is already 1: use --grad-checkpointing or --amp, or free GPU memory"
        micro = self.split.micro_batch
        if self.probe is not None and self.probe[0].writable:
            return f"The next start on this machine uses micro-batch {micro} (recorded in {self.probe[0].path.name})"
        return f"Pass --batch-size {micro} to start with a smaller micro-batch"

    def halve_val_batch(self, error: str) -> None:
        self.val_batch = halved(self.val_batch, "validation", error)

    def state_dict(self) -> dict[str, Any]:
        return {"machine": self.machine.cache_key(), "micro_batch": self.split.micro_batch,
                "amp_dtype": str(self.amp_dtype), "tf32": self.tf32, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: says what differs from the machine that wrote the checkpoint."""
        if state["machine"] not in ("unknown", self.machine.cache_key()):
            written, now = state["machine"], self.machine.cache_key()
            log_fitting(log, f"hardware changed: the checkpoint was written on {written}, this run is on {now}",
                        f"hardware changed: the checkpoint was written on {written},", f"this run is on {now}")
            log.info("the split of each step into micro-batches may differ, the samples of each step do not")
        if state["amp_dtype"] != str(self.amp_dtype):
            log.info("mixed precision changed from %s to %s", state["amp_dtype"], self.amp_dtype)
        if state.get("world_size", 1) != self.world_size:
            log.info("the checkpoint was written by %d process(es), this run has %d:", state.get("world_size", 1),
                     self.world_size)
            log.info("each step keeps its samples, they are only divided differently")


def plan_hardware(cfg: TrainConfig, hardware: Hardware, model: UnifiedVoiceGPT, samples: SampleTable,
                  model_fingerprint: str, run_dir: Path, write_cache: bool = True, world_size: int = 1,
                  precision: AmpChoice | None = None) -> HardwarePlan:
    """The plan of one process (`cfg.effective_batch` is its share of a step); write_cache False: leave the
    probe cache to another process (torchrun's rank 0). `precision`: --amp's choice, when the caller made it
    already (to refuse a bad one before building the model)."""
    precision = precision or choose_amp(hardware, cfg.amp)
    amp = precision.dtype
    tf32 = configure_device(hardware, cfg.tf32)
    oom = OomInjector.from_env()
    split, probe = _batch_split(cfg, hardware, model, amp, samples, model_fingerprint, run_dir, oom, write_cache,
                                world_size)
    workers, why = (cfg.num_workers, "--num-workers") if cfg.num_workers else auto_workers(hardware)
    return HardwarePlan(hardware, amp, split, workers, why, cfg.val_batch_size or split.micro_batch, oom,
                        tf32, probe, world_size=world_size, amp_reason=precision.reason)


def _batch_split(cfg: TrainConfig, machine: Hardware, model: UnifiedVoiceGPT, amp: torch.dtype | None,
                 samples: SampleTable, model_fingerprint: str, run_dir: Path, oom: OomInjector,
                 write_cache: bool, world_size: int) -> tuple[BatchSplit, tuple[ProbeCache, ProbeKey] | None]:
    """The micro-batch split: as given (below a size that ran out of memory here), else probed on this GPU
    (cached per machine and settings), else the CPU size."""
    given = choose_split(cfg.effective_batch, cfg.batch_size, cfg.grad_accumulation)
    if not (machine.is_cuda or oom.active):
        return given or split_for(cfg.effective_batch, CPU_MICRO_BATCH, f"auto: CPU, at most {CPU_MICRO_BATCH}"), None
    key = ProbeKey(hardware=machine.cache_key(), model_config=model_fingerprint, amp_dtype=str(amp),
                   grad_checkpointing=cfg.grad_checkpointing, deterministic=cfg.deterministic, dropout=cfg.dropout,
                   dropout_masks=cfg.dropout_masks, world_size=world_size,
                   longest_text=int(samples.text_len.max()), longest_codes=int(samples.code_len.max()),
                   effective_batch=cfg.effective_batch)
    cache = ProbeCache(run_dir, writable=write_cache)
    if given is not None:
        return _below_known_failure(given, cfg.effective_batch, cache, key), (cache, key)
    cached = cache.lookup(key)
    if cached is not None:
        return split_for(cfg.effective_batch, cached, f"auto: probed earlier on this machine, {cache.path.name}"), \
            (cache, key)
    fits = model_fits(model, machine.device, amp, key.longest_text, key.longest_codes, oom, world_size,
                      cfg.effective_batch)
    micro = largest_fitting(fits, cfg.effective_batch)
    if micro == 0:
        log.warning("even a micro-batch of 1 of the longest samples (%d text, %d codes) does not fit in memory; "
                    "trying anyway. Use --grad-checkpointing, --amp, or drop the longest samples from the manifest",
                    key.longest_text, key.longest_codes)
        micro = 1
    detail = f"auto: probed on the longest samples ({key.longest_text} text, {key.longest_codes} codes)"
    cache.store(key, micro, detail)
    return split_for(cfg.effective_batch, micro, detail), (cache, key)


def _below_known_failure(given: BatchSplit, effective_batch: int, cache: ProbeCache, key: ProbeKey) -> BatchSplit:
    """A given micro-batch at or above one that ran out of memory on this machine with these settings (an
    error that stopped the run, or one recovered from) starts at the size that worked instead."""
    failed = cache.failed_size(key)
    smaller = cache.lookup(key)
    if failed is None or smaller is None or given.micro_batch < failed[0]:
        return given
    log.info("micro-batch %d ran out of memory on this machine with these settings: starting at %d", failed[0],
             smaller)
    log.info("(%s)", failed[1])
    log.info("delete %s to try %d again", cache.path, given.micro_batch)
    return split_for(effective_batch, smaller, f"{given.reason}, lowered after running out of memory")
