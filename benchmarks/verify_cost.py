#!/usr/bin/env python3
"""What do checkpoint checksums cost: load alone vs load + verify, and the extra work at save time?

    python benchmarks/verify_cost.py [--scale 1.0] [--repeats 3] [--work-dir DIR] [--workers N] [--device cpu|cuda]
                                     [--smoke]

What it does:

1. Builds, in memory, the sections of a trainer checkpoint of the official model's size (the
   shapes of benchmarks/save_stall.py: the official IndexTTS2 GPT's 527M trained and 866M total
   parameters, AdamW moments for the trained ones, about 7.7 GB in float32; --scale S multiplies
   every tensor's first dimension by S), plus RNG states, settings and a 1000-entry history.
   With --device cuda the model and optimizer tensors live on the GPU, as in a GPU run: hashing
   them then includes their copy to the host.
2. Refuses (exit 2), before building anything, unless the work directory's disk has room for
   two checkpoints plus 10% (rotation deletes the old file after the new one is complete) and
   the machine has memory for the state plus 10% and 1 GB (the state is freed before the files
   are loaded, one copy at a time).
3. Saves it --repeats times through the real path, `Checkpointer.save` (schema.assemble, which
   computes the checksums, then the atomic write, link and rotation; keep=1), and times, on the
   same content, `integrity.compute` alone: the work checksums add to a save.
4. Frees the state, then --repeats times, alternating, times `load_checkpoint` (torch.load with
   weights_only=True, what resume did before) and `schema.read` (the same load, then the
   schema's checks and the checksums: what resume does now). The file was just written, so
   both read from the page cache: the difference is the verification's CPU time; a cold read
   from disk makes the load slower and the verification's share smaller.
   It also times the mapped read export uses (`schema.read(mmap=True)`: the tensors are mapped, not read) with
   and without verification: what verifying adds to an export.
5. Prints every figure, the medians, the machine, the hash's speed on one core, the load
   average before and after, and deletes everything it wrote. Exit 0, or 2 when it could not run.

On a shared 2-core VM the full size took about 3 minutes (most of it the three 7.7 GB writes). --smoke (for
tests/test_benchmarks.py) runs one round at 1/1000 of the size: it checks the script runs, in seconds.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.save_stall import (  # noqa: E402
    SMOKE_SCALE, BenchError, Filler, check_room, filesystem_of, load_average, machine, official_shapes, scaled, state_bytes,
)
from trainers.checkpoint import integrity, schema  # noqa: E402
from trainers.checkpoint.checkpointer import Checkpointer  # noqa: E402
from trainers.torch_files import load_checkpoint  # noqa: E402
from trainers.training.rng import ProcessRNG  # noqa: E402


class Fixed:
    """A component whose state_dict() is a prepared section."""

    def __init__(self, state: object) -> None:
        self.state = state

    def state_dict(self) -> object:
        return self.state


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the official size [1.0: about 7.7 GB]")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of each measurement, at least 3 [3]")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="directory on the disk to use; a fresh subdirectory is used and deleted [system temp]")
    p.add_argument("--workers", type=int, default=None,
                   help=f"hashing threads [min({integrity.MAX_WORKERS}, cores), as the trainer uses]")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model and optimizer tensors live while saving [cpu]")
    p.add_argument("--smoke", action="store_true",
                   help=f"one round at --scale {SMOKE_SCALE}: checks the script runs, measures nothing")
    args = p.parse_args()
    if not 0 < args.scale <= 1 or args.repeats < 3 or (args.workers is not None and args.workers < 1):
        p.error("--scale must be in (0, 1], --repeats at least 3, --workers at least 1")
    if args.smoke:
        args.scale, args.repeats = SMOKE_SCALE, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    return args


def build_sections(scale: float, device: torch.device) -> tuple[dict, int, int]:
    """The checkpoint's sections, their tensor bytes and tensor count."""
    trained, carried = official_shapes()
    fill = Filler(device)
    params = {name: fill.tensor(scaled(shape, scale), device) for name, shape in trained}
    model = dict(params)
    model.update({name: fill.tensor(scaled(shape, scale), torch.device("cpu")) for name, shape in carried})
    state = {i: {"step": torch.tensor(1000.0), "exp_avg": fill.tensor(p.shape, device),
                 "exp_avg_sq": fill.tensor(p.shape, device).abs_()} for i, p in enumerate(params.values())}
    group = {"lr": 2e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "params": list(range(len(params)))}
    sections = {
        "model": model,
        "optim": {"optimizer": {"state": state, "param_groups": [group]},
                  "param_shapes": [[n, list(p.shape)] for n, p in params.items()],
                  "lr_schedule": {"kind": "warmup_cosine", "base_lr": 2e-5, "warmup_steps": 100, "decay_steps": 10000,
                                  "min_lr_ratio": 0.0},
                  "scaler": {}, "frozen_rows": None},
        "data": {"epoch": 1, "step_in_epoch": 10, "samples_in_epoch": 320, "order_batch": 32, "order": "random"},
        "progress": {"step": 1000, "samples_seen": 32000,
                     "history": [{"kind": "train", "step": s, "mel_loss": 1.0 / s, "text_loss": 2.0 / s, "lr": 2e-5}
                                 for s in range(1, 1001)]},
        "rng": ProcessRNG().state_dict(),
        "run": {"run_id": "benchmark", "config": {"effective_batch": 32, "learning_rate": 2e-5},
                "model_config": {"model_dim": 1280, "layers": 24}, "fingerprints": {"data": "0" * 64},
                "vocab": {"text_tokens": 12000, "base_text_tokens": 12000},
                "versions": {"torch": str(torch.__version__)}},
        "hardware": {"machine": "benchmark", "micro_batch": 8, "amp_dtype": "None", "tf32": False},
    }
    tensors = list(model.values()) + [t for s in state.values() for t in s.values()]
    return sections, sum(t.numel() * t.element_size() for t in tensors), len(tensors)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_saves(sections: dict, work: Path, repeats: int) -> tuple[list[float], list[float]]:
    """Times of Checkpointer.save and of integrity.compute alone on the same content."""
    checkpointer = Checkpointer(work, keep=1, components={k: Fixed(v) for k, v in sections.items()})
    content = {"format": schema.FORMAT, **sections}
    saves, hashes = [], []
    for i in range(repeats):
        saves.append(timed(partial(checkpointer.save, 1000 + i)))
        hashes.append(timed(partial(integrity.compute, content)))
        print(f"  round {i + 1}: save {saves[-1]:.2f} s, checksums alone {hashes[-1]:.2f} s", flush=True)
    return saves, hashes


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def run(args: argparse.Namespace) -> None:
    base = (args.work_dir or Path(tempfile.gettempdir())).resolve()
    if not base.is_dir():
        raise BenchError(f"--work-dir {base} is not an existing directory")
    device = torch.device(args.device)
    workers = args.workers or min(integrity.MAX_WORKERS, os.cpu_count() or 1)
    integrity_workers = integrity.MAX_WORKERS
    integrity.MAX_WORKERS = workers  # the default the schema's assemble and parse use
    print(f"machine: {machine()}")
    print(f"before: {load_average()}")
    print(f"disk: {base} on {filesystem_of(base)}, {shutil.disk_usage(base).free / 1e9:.1f} GB free")
    probe = torch.randint(0, 256, ((16 if args.smoke else 256) * 2**20,), dtype=torch.uint8).numpy()
    seconds = timed(partial(hashlib.sha256, probe))
    print(f"{integrity.ALGORITHM} on one core: {len(probe) / 1e9 / seconds:.2f} GB/s ({len(probe) // 2**20} MB)")
    del probe
    # The state, then one loaded copy at a time.
    check_room(base, state_bytes(*official_shapes(), args.scale), 1, "the state")
    t0 = time.perf_counter()
    sections, nbytes, count = build_sections(args.scale, device)
    print(f"state: scale {args.scale}, {count} tensors, {nbytes / 1e9:.2f} GB of tensor data on {device}, "
          f"built in {time.perf_counter() - t0:.1f} s; {integrity.ALGORITHM} in {workers} thread(s)")
    work = Path(tempfile.mkdtemp(prefix="verify_cost-", dir=base))
    try:
        saves, hashes = measure_saves(sections, work, args.repeats)
        sections = {}  # freed: the loads below hold one copy at a time
        path = work / "latest.pth"
        size = path.stat().st_size
        loads, reads, maps, mapped_reads = [], [], [], []
        for i in range(args.repeats):
            loads.append(timed(partial(load_checkpoint, path)))
            reads.append(timed(partial(schema.read, path)))
            maps.append(timed(partial(schema.read, path, mmap=True, verify=False)))
            mapped_reads.append(timed(partial(schema.read, path, mmap=True, verify=True)))
            print(f"  round {i + 1}: load {loads[-1]:.2f} s, load + verify {reads[-1]:.2f} s; mapped {maps[-1]:.2f} s, "
                  f"mapped + verify {mapped_reads[-1]:.2f} s", flush=True)
        assert schema.read(path).verified
    finally:
        shutil.rmtree(work, ignore_errors=True)
        integrity.MAX_WORKERS = integrity_workers
    med = statistics.median
    print(f"file: {size / 1e9:.2f} GB ({count} tensors)")
    print(f"save (Checkpointer.save, checksums included): {fmt(saves)} s; median {med(saves):.2f} s")
    print(f"checksums at save (integrity.compute): {fmt(hashes)} s; median {med(hashes):.2f} s "
          f"= {100 * med(hashes) / med(saves):.0f}% of the save, {nbytes / 1e9 / med(hashes):.2f} GB/s")
    print(f"load alone (torch.load weights_only): {fmt(loads)} s; median {med(loads):.2f} s")
    print(f"load + verify (schema.read): {fmt(reads)} s; median {med(reads):.2f} s")
    extra = med(reads) - med(loads)
    print(f"verification adds {extra:.2f} s to a warm-cache load (+{100 * extra / med(loads):.0f}%)")
    print(f"mapped read (schema.read mmap, what export did): {fmt(maps)} s; median {med(maps):.2f} s")
    print(f"mapped read + verify (what export does): {fmt(mapped_reads)} s; median {med(mapped_reads):.2f} s; "
          f"export's verification adds {med(mapped_reads) - med(maps):.2f} s")
    print(f"after: {load_average()}")


def main() -> int:
    args = parse_args()
    try:
        run(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
