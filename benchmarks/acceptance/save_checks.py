"""A background save at the official size through the trainer's Checkpointer: the pinned host memory its
snapshot buffers take, measured; how long it blocks the loop against a synchronous save of the same state;
and an in-place update of every tensor right after the snapshot, which must not reach the file (the
snapshot's copies from the GPU are complete when the save call returns). Both files are deleted once read.

The state measured is IndexTTS2's (benchmarks/save_stall.py's shapes: 7.7 GB). IndexTTS-2.5's goes through the
same Checkpointer, whose cost is its bytes, not which model they belong to: its figures are this measurement
scaled by the bytes of a 2.5 state, and said to be computed (the 5 minutes of GPU time go to what 2.5 changes)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from benchmarks.acceptance.context import Context
from benchmarks.acceptance.corpus import IDX25, build_model
from benchmarks.acceptance.runner import Outcome
from benchmarks.snapshot_host_memory import resident_bytes
from benchmarks.verify_cost import Fixed, build_sections
from trainers.checkpoint import schema
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.host_blocks import reserved_bytes
from trainers.hardware.host_memory import GiB

LOADER_WORKERS = 4  # what a GPU run's auto setting starts on 8+ cores: the save mode keeps room for them
SAMPLES = 1024  # values compared per tensor (evenly spaced, first and last included)
DRY_RUN_SCALE = 0.01  # the CPU side: 1% of the official size
# Pinned blocks are powers of two (host_blocks.py), which the host allocator keeps unrounded: measured and
# planned bytes should agree exactly; 1% leaves room for small pinned buffers torch takes by itself.
PINNED_RTOL = 0.01
# IndexTTS-2.5's campplus state dict holds 812.3M parameters (shared/reference/indextts25-gpt.md, section 2): the
# model's, which train, and the emotion branch, which is carried.
TOTAL_PARAMS_25 = 812_300_000


def bytes_25(ctx: Context) -> int:
    """Bytes of an IndexTTS-2.5 trainer checkpoint's tensors at the official size, laid out as build_sections lays
    out 2.0's: every parameter in fp32 and AdamW's two fp32 moments of the trained ones."""
    trained = sum(p.numel() for p in build_model(ctx.gpt(IDX25), "meta").parameters())
    return 4 * max(TOTAL_PARAMS_25, trained) + 8 * trained


def tensors(state: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) of every floating-point tensor of a nested state."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() and state.numel():
            yield path, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from tensors(value, (*path, key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from tensors(value, (*path, i))


def _samples(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    index = torch.linspace(0, flat.numel() - 1, min(SAMPLES, flat.numel()), device=flat.device).round().long()
    return flat[index].cpu()


def _host_allocated() -> int | None:
    """Bytes of pinned host memory torch's host allocator holds (None where it keeps no statistics: no CUDA, or a
    torch that names them otherwise; the resident memory's growth is reported beside it in every case)."""
    stats = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    return next((stats[k] for k in ("allocated_bytes.current", "reserved_bytes.current") if k in stats), None)


def _save_and_update(ctx: Context, scale: float) -> dict:
    """Reserve, save in the background, change every tensor in place at once, wait, and read the file back."""
    device = torch.device(ctx.device)
    sections, nbytes, count = build_sections(scale, device)
    out = ctx.folder("background_save")
    checkpointer = Checkpointer(out, keep=1, components={k: Fixed(v) for k, v in sections.items()}, background=True)
    pinned_before, rss_before, t0 = _host_allocated(), resident_bytes(), time.perf_counter()
    checkpointer.fit_to_host_memory(LOADER_WORKERS)  # reserves the snapshot buffers in a thread
    checkpointer.writer.wait()
    reserve_s = time.perf_counter() - t0
    sizes = checkpointer.snapshot_sizes()
    pinned_after = _host_allocated()
    figures = {"model": "2.0", "state_gb": round(nbytes / 1e9, 2), "tensors": count,
               "background": checkpointer.writer.background,
               "pinned_planned_gib": round(reserved_bytes([(n, True) for n, p in sizes if p]) / GiB, 3),
               "reserved_planned_gib": round(reserved_bytes(sizes) / GiB, 3),
               "pinned_measured_gib": round((pinned_after - pinned_before) / GiB, 3)
               if pinned_after is not None and pinned_before is not None else None,
               "rss_growth_gib": round((resident_bytes() - rss_before) / GiB, 2), "reserve_s": round(reserve_s, 1)}
    before = {path: _samples(t) for path, t in tensors(sections)}
    t1 = time.perf_counter()
    checkpointer.save(1)
    figures["loop_blocked_s"] = round(time.perf_counter() - t1, 2)
    with torch.no_grad():
        for _, t in tensors(sections):
            t.add_(1.0)  # right after the snapshot, while the write is in flight
    checkpointer.wait()
    figures["write_s"] = round(time.perf_counter() - t1, 1)
    checkpointer.close()
    saved = schema.read(Path(out) / "latest.pth", mmap=True)
    found = {p: t for p, t in tensors(dict(saved.sections)) if p in before}
    changed = [".".join(map(str, p)) for p, t in found.items() if not torch.equal(_samples(t), before[p])]
    missing = [".".join(map(str, p)) for p in before if p not in found]
    figures.update(compared=len(found), reached_the_file=changed[:5] or 0, missing_from_the_file=missing[:5] or 0)
    del saved, found
    shutil.rmtree(out)
    figures["sync_blocked_s"] = _synchronous_save(ctx, sections)
    ratio = bytes_25(ctx) * scale / nbytes
    figures["2.5_computed"] = {"state_gb": round(figures["state_gb"] * ratio, 2), "bytes_ratio": round(ratio, 3),
                               **{k: round(figures[k] * ratio, 2) for k in ("loop_blocked_s", "sync_blocked_s")}}
    return figures


def _synchronous_save(ctx: Context, sections: dict) -> float:
    """Seconds a synchronous save of the same state blocks the loop (the whole write, checksums and fsync)."""
    out = ctx.folder("synchronous_save")
    checkpointer = Checkpointer(out, keep=1, components={k: Fixed(v) for k, v in sections.items()}, background=False)
    started = time.perf_counter()
    checkpointer.save(2)
    blocked = time.perf_counter() - started
    checkpointer.close()
    shutil.rmtree(out)
    return round(blocked, 2)


def _unchanged(figures: dict) -> bool:
    """Every tensor saved was found in the file with its values from before the update."""
    return figures["reached_the_file"] == 0 and figures["missing_from_the_file"] == 0 and figures["compared"] > 0


def background_save(ctx: Context) -> Outcome:
    figures = _save_and_update(ctx, 1.0)
    planned = figures["pinned_planned_gib"]
    measured = figures["pinned_measured_gib"]
    if measured is None:  # no allocator statistics: every reserved page is touched, so it is resident
        measured, planned = figures["rss_growth_gib"], figures["reserved_planned_gib"]
    ok = figures["background"] and planned > 0 and abs(measured - planned) <= PINNED_RTOL * planned
    ok = ok and _unchanged(figures)
    return Outcome(ok, figures, "", _lines(figures, measured, planned))


def _lines(figures: dict, measured: float | None, planned: float | None) -> tuple[str, ...]:
    lines = [f"2.0: state {figures['state_gb']} GB ({figures['tensors']} tensors): the loop blocked "
             f"{figures['loop_blocked_s']} s by a background save (written in {figures['write_s']} s meanwhile) "
             f"against {figures['sync_blocked_s']} s by a synchronous save",
             f"an update of every tensor right after the snapshot reached the file: "
             f"{figures['reached_the_file'] or 'none'} ({figures['compared']} tensors compared)"]
    if measured is not None:
        lines.append(f"host memory of the snapshot buffers: {measured} GiB measured, {planned} GiB planned "
                     f"(limit {PINNED_RTOL:.0%}); reserved in {figures['reserve_s']} s")
    c = figures.get("2.5_computed")
    if c:
        lines.append(f"2.5: state {c['state_gb']} GB (x{c['bytes_ratio']}): {c['loop_blocked_s']} s blocked by a "
                     f"background save against {c['sync_blocked_s']} s synchronous (computed: 2.0's scaled by bytes)")
    return tuple(lines)


def background_save_cpu_side(ctx: Context) -> Outcome:
    """1% of the official size on the CPU (pageable buffers): the update must not reach the file here either."""
    figures = _save_and_update(ctx, DRY_RUN_SCALE)
    return Outcome(figures["background"] and _unchanged(figures), figures, "", _lines(figures, None, None))
