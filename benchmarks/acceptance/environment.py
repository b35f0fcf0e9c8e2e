"""What ran the checks: the GPUs, the driver, torch and CUDA, free GPU memory, /dev/shm, host memory and cores.
gpu_acceptance.py writes it as env.json beside the report; the `machine` check prints its summary."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.acceptance.context import Context
from benchmarks.acceptance.runner import Outcome
from trainers.hardware.host_memory import host_memory

GiB = 2 ** 30
NVIDIA_SMI_QUERY = ("name,driver_version,memory.total,memory.used,memory.free,temperature.gpu,power.draw,power.limit,"
                    "clocks.sm,clocks.max.sm,pstate,compute_mode")
VARIABLES = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG",
             "NCCL_DEBUG", "OUT")


def _command(*args: str) -> str | None:
    """A command's output (None where it is missing or fails)."""
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{args[0]} failed: {exc}"
    return (done.stdout + done.stderr).strip()


def _disk(path: Path) -> dict[str, float] | None:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return {"total_gib": round(usage.total / GiB, 2), "free_gib": round(usage.free / GiB, 2)}


def _gpus() -> list[dict[str, Any]]:
    found = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        found.append({"name": props.name, "capability": f"{props.major}.{props.minor}",
                      "sms": props.multi_processor_count, "total_gib": round(total / GiB, 2),
                      "free_gib": round(free / GiB, 2)})
    return found


def dump(ctx: Context) -> dict[str, Any]:
    """Everything about the machine that a figure of the run may depend on."""
    host = host_memory()
    cuda = torch.cuda.is_available()
    return {
        "gpus": _gpus(),
        "nvidia_smi": _command("nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv"),
        "nvidia_smi_full": _command("nvidia-smi"),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "sdp_backends": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                         "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                         "math": torch.backends.cuda.math_sdp_enabled()},
        "python": sys.version.split()[0], "platform": platform.platform(), "cpu_cores": os.cpu_count(),
        "host_memory": host.describe() if host else "unknown",
        "dev_shm": _disk(Path("/dev/shm")), "work_dir": str(ctx.work), "work_dir_disk": _disk(ctx.work),
        "variables": {k: os.environ[k] for k in VARIABLES if k in os.environ},
    }


def machine(ctx: Context) -> Outcome:
    """The machine in one line (always passes); the whole dump is env.json."""
    env = ctx.shared("environment", lambda: dump(ctx))
    gpus = env["gpus"]
    driver = None
    if env["nvidia_smi"] and "," in env["nvidia_smi"]:
        rows = env["nvidia_smi"].splitlines()
        driver = rows[1].split(",")[1].strip() if len(rows) > 1 and len(rows[1].split(",")) > 1 else None
    shm = env["dev_shm"]
    words = [f"{len(gpus)} x {gpus[0]['name']}, {gpus[0]['free_gib']} of {gpus[0]['total_gib']} GiB free"
             if gpus else "no CUDA device",
             f"driver {driver or 'unknown'}, torch {env['torch']}, CUDA {env['cuda'] or 'none'}",
             f"/dev/shm {shm['free_gib']} GiB free" if shm else "no /dev/shm",
             f"{env['cpu_cores']} cores, host memory {env['host_memory']}"]
    return Outcome(True, {}, "; ".join(words))
