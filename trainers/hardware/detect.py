"""What machine this is, and the hardware-only choices made from it.

The effective batch (samples per optimizer step) is a hyperparameter of the run and never
changes with the hardware. The hardware decides only how a step's samples are split into
micro-batches, how many loader processes feed them, and (trainers/hardware/precision.py) which
mixed-precision dtype --amp uses.
"""
from __future__ import annotations

import logging
import math
import os
import platform
from dataclasses import dataclass

import torch

from trainers.errors import UserError
from trainers.hardware.host_memory import GiB, total_ram_bytes

log = logging.getLogger("train")

# CPU runs have no memory probe: system RAM is rarely what limits them, and beyond this size a
# larger micro-batch no longer makes a CPU step faster.
CPU_MICRO_BATCH = 16


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]
    bf16: bool
    tf32: bool  # Ampere (8.0) and newer


@dataclass(frozen=True)
class Hardware:
    device: torch.device
    gpu: GpuInfo | None
    gpu_count: int
    cpu_cores: int
    ram_bytes: int

    @property
    def is_cuda(self) -> bool:
        return self.gpu is not None

    def cache_key(self) -> str:
        """Same key, same memory behaviour: the probe result may be reused."""
        if self.gpu is None:
            return "cpu"
        return f"cuda|{self.gpu.name}|{self.gpu.total_bytes // 2 ** 20}MiB|sm{self.gpu.capability[0]}{self.gpu.capability[1]}"

    def describe(self) -> str:
        cpu = f"{self.cpu_cores} CPU cores, {self.ram_bytes / GiB:.0f} GiB RAM"
        if self.gpu is None:
            return f"CPU only ({cpu})"
        g = self.gpu
        return (f"CUDA {self.device} {g.name} ({g.total_bytes / GiB:.1f} GiB, {g.free_bytes / GiB:.1f} GiB free, "
                f"compute {g.capability[0]}.{g.capability[1]}, bf16 {'yes' if g.bf16 else 'no'}, "
                f"TF32 {'yes' if g.tf32 else 'no'}; {self.gpu_count} GPU(s) visible); {cpu}")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name}: not a device name; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: only cpu and cuda are supported")
    return device


def configure_device(machine: "Hardware", tf32: bool) -> bool:
    """Make the chosen GPU the current one and set matmul precision; returns whether TF32 is on.

    TF32 (Ampere and newer) runs fp32 matrix products on tensor cores with a 10-bit mantissa:
    several times faster, and what the reference trainers use; --no-tf32 keeps full fp32.
    """
    if machine.gpu is None:
        return False
    torch.cuda.set_device(machine.device)
    allow = tf32 and machine.gpu.tf32
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    return allow


def detect_hardware(device: torch.device) -> Hardware:
    gpu = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        capability = (props.major, props.minor)
        # From the chosen device's compute capability: is_bf16_supported() also counts emulated bf16
        # (T4, V100), which is slow, and asks about the current device, not this one.
        gpu = GpuInfo(index=index, name=props.name, total_bytes=total, free_bytes=free, capability=capability,
                      bf16=capability >= (8, 0), tf32=capability >= (8, 0))
    return Hardware(device=device, gpu=gpu, gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                    cpu_cores=_cpu_cores(), ram_bytes=total_ram_bytes())


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use (containers, taskset)
    except AttributeError:
        return os.cpu_count() or 1


def busy_cpu_note(machine: Hardware, threads: int) -> list[str]:
    """On a CPU other work keeps busy (the 1-minute load average above the machine's cores), torch's intra-op
    threads wait for each other at every operation: a user reported the demo taking 221 s with the default
    threads and 34 s with one on a loaded 2-core VM. There is no --threads flag: OMP_NUM_THREADS, read when torch
    starts, sets it. Returns the lines to warn with (none on a GPU, with one thread, or an idle CPU)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return []
    cores = os.cpu_count() or 1
    if machine.is_cuda or threads <= 1 or load <= cores:
        return []
    return [f"the CPU is busy: load average {load:.1f} on {cores} cores, and torch computes on {threads} threads,",
            "which wait for each other: set OMP_NUM_THREADS=1 before starting, often several times faster"]


def auto_workers(machine: Hardware) -> tuple[int, str]:
    """Loader processes for --num-workers 0 (auto)."""
    if machine.gpu is None:
        # The model's own threads use every core; loading the small .npy features in the
        # training process costs less than competing with it.
        return 0, "CPU training: features are loaded in the training process"
    workers = max(1, min(4, machine.cpu_cores // 2))
    return workers, f"half of {machine.cpu_cores} CPU cores, at most 4"


@dataclass(frozen=True)
class BatchSplit:
    micro_batch: int
    accumulation: int
    reason: str


def split_for(effective_batch: int, micro_batch: int, reason: str) -> BatchSplit:
    """The split of an effective batch into micro-batches of at most `micro_batch` samples."""
    micro = max(1, min(micro_batch, effective_batch))
    return BatchSplit(micro, math.ceil(effective_batch / micro), reason)


def choose_split(effective_batch: int, batch_size: int, grad_accumulation: int) -> BatchSplit | None:
    """The split the user asked for; None when the micro-batch is auto and must be proposed."""
    if batch_size > effective_batch:
        log.info("--batch-size %d is larger than the effective batch %d: using micro-batches of %d",
                 batch_size, effective_batch, effective_batch)
    if batch_size:
        return split_for(effective_batch, batch_size, "--batch-size")
    if grad_accumulation:
        return split_for(effective_batch, math.ceil(effective_batch / grad_accumulation), "--grad-accumulation")
    return None


def library_versions() -> dict[str, str]:
    """Versions that can change float results: recorded with every checkpoint."""
    import numpy as np
    import sentencepiece

    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "numpy": np.__version__,
        "sentencepiece": sentencepiece.__version__,
        "cuda": str(torch.version.cuda or "none"),
    }
