#!/usr/bin/env python3
"""Host memory of background checkpoint saves at the official size: computed, and measured on this machine.

    python benchmarks/snapshot_host_memory.py [--scale S] [--workers N] [--smoke]

Computed (no allocation; the official shapes from checkpoints/config.yaml on the meta device):
the snapshot buffers of the trained weights and AdamW's two moments, what torch's pinned
allocator would hold for one pinned buffer per tensor (each rounded up to a power of two), what
the packed pinned blocks of a reservation take (trainers/checkpoint/host_blocks.py), and the save
mode this machine's available host memory gives the official model with N data-loader processes.

Measured with --scale S > 0 (the first dimension of every trained tensor times S; pageable memory,
since pinning needs a GPU): a reservation of those buffers (time, growth of this process's resident
memory against the bytes reserved), then one snapshot into them (time, host memory allocated by it).
--smoke (for tests/test_benchmarks.py) measures at --scale 0.001: it checks the script runs, in seconds.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.save_stall import SMOKE_SCALE, official_shapes, scaled  # noqa: E402
from trainers.checkpoint.host_blocks import allocated_bytes, reserved_bytes  # noqa: E402
from trainers.checkpoint.save_mode import choose_save_mode  # noqa: E402
from trainers.checkpoint.snapshot import SnapshotBuffers, buffer_sizes, snapshot  # noqa: E402
from trainers.hardware.host_memory import GiB, host_memory  # noqa: E402


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def computed(workers: int) -> None:
    trained, _ = official_shapes()
    sizes = [4 * torch.Size(shape).numel() for _, shape in trained] * 3  # weights, exp_avg, exp_avg_sq
    print(f"computed: {len(sizes)} buffers, {sum(sizes) / GiB:.2f} GiB (trained weights + AdamW's two moments)")
    print(f"computed: one pinned buffer per tensor holds {sum(allocated_bytes(n, True) for n in sizes) / GiB:.2f} GiB")
    print(f"computed: packed pinned blocks take {reserved_bytes([(n, True) for n in sizes]) / GiB:.2f} GiB, "
          f"pageable {reserved_bytes([(n, False) for n in sizes]) / GiB:.2f} GiB")
    host = host_memory()
    mode = choose_save_mode([(n, True) for n in sizes], host, workers)
    where = "unknown host memory" if host is None else host.describe()
    choice = "pinned" if mode.pinned else "pageable" if mode.background else "synchronous"
    print(f"this machine ({where}), {workers} loader process(es): {choice} saves for the official model")


def measured(scale: float) -> None:
    trained, _ = official_shapes()
    state = {"model": {name: torch.ones(scaled(shape, scale)) for name, shape in trained}}
    state["optim"] = {name: [torch.ones_like(t), torch.ones_like(t)] for name, t in state["model"].items()}
    sizes = buffer_sizes(state, pin_memory=False)
    buffers = SnapshotBuffers()
    before, t0 = resident_bytes(), time.perf_counter()
    buffers.reserve(sizes)
    reserve_s, grown = time.perf_counter() - t0, resident_bytes() - before
    print(f"measured (--scale {scale}): reserved {buffers.allocated_bytes / GiB:.2f} GiB for {len(sizes)} buffers "
          f"({buffers.nbytes / GiB:.2f} GiB) in {reserve_s:.2f} s; resident memory grew {grown / GiB:.2f} GiB")
    held, t0 = buffers.allocated_bytes, time.perf_counter()
    snapshot(state, buffers=buffers)
    print(f"measured: snapshot into them in {time.perf_counter() - t0:.2f} s, allocating "
          f"{(buffers.allocated_bytes - held) / GiB:.2f} GiB more")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.0, help="measure a reservation at this fraction of the "
                   "official size (0: computed figures only) [0]")
    p.add_argument("--workers", type=int, default=4, help="data-loader processes for the save-mode choice [4]")
    p.add_argument("--smoke", action="store_true", help=f"measure at --scale {SMOKE_SCALE}: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.scale = SMOKE_SCALE
    if not 0 <= args.scale <= 1:
        p.error("--scale must be in [0, 1]")
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.2f}; torch "
          f"{torch.__version__}")
    computed(args.workers)
    if args.scale:
        measured(args.scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
