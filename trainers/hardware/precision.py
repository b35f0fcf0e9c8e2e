"""Which mixed-precision dtype a run computes in, from --amp and the machine.

auto (the default): bf16 autocast on GPUs with bf16 tensor cores (compute 8.0 and newer: no loss
scaling needed); fp16 autocast with a loss scaler on older GPUs (T4, V100), where fp32 runs on
CUDA cores at a fraction of the tensor cores' speed; fp32 on the CPU. bf16 and fp16 force that
dtype, on the CPU too (torch's CPU autocast supports both, so every path runs in the tests);
off is fp32. None of it changes the result beyond float rounding, so it may change on resume;
a resume keeps the run's saved choice unless --amp is given (trainers/run/resolve.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trainers.config.settings import AMP_MODES
from trainers.errors import UserError
from trainers.hardware.detect import Hardware

log = logging.getLogger("train")


@dataclass(frozen=True)
class AmpChoice:
    dtype: torch.dtype | None  # the autocast dtype; None: fp32
    reason: str  # why, for the start-up summary

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "off")  # type: ignore[arg-type]


def choose_amp(machine: Hardware, mode: str) -> AmpChoice:
    """The dtype for `--amp mode` on this machine; UserError where the GPU cannot run it."""
    if mode not in AMP_MODES:
        raise UserError(f"--amp {mode}: use one of {', '.join(AMP_MODES)}")
    gpu = machine.gpu
    if mode == "off":
        return AmpChoice(None, "--amp off")
    if mode == "bf16":
        if gpu is not None and not gpu.bf16:
            raise UserError(
                f"--amp bf16: {gpu.name} (compute {gpu.capability[0]}.{gpu.capability[1]}) has no bf16 tensor "
                "cores; torch would emulate bf16, slower than fp32. Pass --amp auto (fp16 with a loss scaler on this "
                "GPU) or --amp off (fp32); on a resume this replaces the choice saved with the run")
        return AmpChoice(torch.bfloat16, "--amp bf16" + ("" if gpu else ", CPU autocast"))
    if mode == "fp16":
        if gpu is None:
            log.warning("--amp fp16 on the CPU: most CPUs have no fp16 arithmetic, and a step at the official")
            log.warning("width took 52x as long as in fp32 here (benchmarks/amp_cost.py); use it to exercise the")
            log.warning("fp16 path, --amp off or bf16 to train on a CPU")
        return AmpChoice(torch.float16, "--amp fp16, with a loss scaler" + ("" if gpu else ", CPU autocast"))
    if gpu is None:
        return AmpChoice(None, "auto: fp32 on the CPU; --amp bf16 for bf16 autocast")
    if gpu.bf16:
        return AmpChoice(torch.bfloat16, f"auto: {gpu.name} has bf16, which needs no loss scaling")
    return AmpChoice(torch.float16, f"auto: {gpu.name} (compute {gpu.capability[0]}.{gpu.capability[1]}) has no bf16, "
                                    "so fp16 with a loss scaler; --amp off for fp32 (several times slower here)")


def amp_dtype(machine: Hardware, mode: str) -> torch.dtype | None:
    return choose_amp(machine, mode).dtype
