"""Whether background saves fit in host memory, and in pinned or pageable buffers.

A background save keeps a host copy of the state training changes (the trained weights and AdamW's
two moments: 5.89 GiB at the official size) for the whole run, so the loop waits only for the copy.
Pinned (page-locked) buffers make that copy from the GPU several times faster, but the kernel can
neither swap nor reclaim them. Taking more than the host has does not fail cleanly: the kernel's
out-of-memory killer ends the trainer when the pages are touched, or a pinned allocation fails.
So the copy is compared with the host memory available at start (trainers/hardware/host_memory.py)
less what the run still takes after start-up:

* HEADROOM_BYTES for the process itself: CUDA libraries loaded at their first use (cuBLAS, cuDNN,
  kernels), the checkpoint writer's own buffers and the page cache its writes fill, Python's heap;
* WORKER_BYTES for each data-loader process, started after this check (the training and the
  validation loader keep theirs for the whole run): a forked interpreter with torch, the dataset's
  sample list and prefetched batches.

Under torchrun rank 0 alone keeps the copy, but the other processes on its machine share the host:
each of them is counted as one more trainer (HEADROOM_BYTES) with its own data-loader processes.

Pinned when the packed pinned blocks fit, else pageable buffers when those fit, else synchronous
saves, which need the copy only while they write.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainers.checkpoint.host_blocks import reserved_bytes
from trainers.hardware.host_memory import GiB, HostMemory

HEADROOM_BYTES = 2 * GiB
WORKER_BYTES = GiB // 2


@dataclass(frozen=True)
class SaveMode:
    background: bool
    pinned: bool
    message: str = ""  # why the mode differs from the one asked for, a log line a line; "" when it does not


def choose_save_mode(sizes: list[tuple[int, bool]], host: HostMemory | None, loader_workers: int,
                     trainers: int = 1) -> SaveMode:
    """The save mode for background saves of buffers of `sizes` (bytes, pinned); `host` None: unknown, kept.
    `loader_workers`: those of every trainer process on this machine; `trainers`: how many (torchrun)."""
    pinned = any(p for _, p in sizes)
    if host is None:
        return SaveMode(True, pinned)
    keep = trainers * HEADROOM_BYTES + loader_workers * WORKER_BYTES
    room = host.available - keep
    copy = reserved_bytes([(n, False) for n, _ in sizes])
    kept = (f"{host.describe()},\nless {keep / GiB:.1f} GiB kept for torch"
            f"{f' in {trainers} trainer processes' if trainers > 1 else ''} and {loader_workers} data-loader "
            f"process(es)")
    if reserved_bytes(sizes) <= room:
        return SaveMode(True, pinned)
    if pinned and copy <= room:
        return SaveMode(True, False, f"background saves copy into pageable host memory: pinned buffers would take "
                                     f"{reserved_bytes(sizes) / GiB:.2f} GiB\nand the host has {kept}\nthe "
                                     "copies are slower, nothing else changes")
    return SaveMode(False, False, f"checkpoint saves are synchronous (the loop waits for each write): a background save "
                                  f"keeps\na {copy / GiB:.2f} GiB copy of the state in host memory for the whole run and "
                                  f"the host has\n{kept}\na synchronous save holds that copy only while it writes; for "
                                  "background saves,\nfree host memory or use a machine with more RAM")
