"""Where the snapshot buffers of a reservation sit: slices of a few large blocks of host memory.

torch's pinned (page-locked) host allocator rounds every allocation up to a power of two and keeps
the rounded block: one pinned buffer per tensor of the official model's weights and AdamW moments
(5.89 GiB) holds about 8.1 GiB. Blocks whose sizes are powers of two lose nothing to that rounding,
so a reservation packs its buffers into blocks of BLOCK_BYTES (first fit, largest first) and each
buffer is a slice of a block: an UntypedStorage of exactly its size sharing the block's memory,
which torch.save writes as if it had been allocated alone. Pageable blocks are not rounded; they
are packed the same way so that both kinds take one code path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

BLOCK_BYTES = 256 * 2 ** 20
ALIGN = 4096  # each buffer starts on a page: copies into it run at full speed


@dataclass(frozen=True)
class BlockPlan:
    block_sizes: list[int]  # bytes to allocate for each block
    slots: list[tuple[int, int]]  # for each requested size, in the order given: (block index, byte offset)


def pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def allocated_bytes(nbytes: int, pinned: bool) -> int:
    """What the host allocator holds for one allocation of `nbytes`."""
    return pow2_ceil(nbytes) if pinned else nbytes


def plan_blocks(sizes: Sequence[int], pinned: bool) -> BlockPlan:
    """Pack buffers of `sizes` bytes into blocks: first fit, largest first. A buffer larger than
    BLOCK_BYTES opens a block of its own (a power of two when pinned, the rest filled by others)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    capacity: list[int] = []
    used: list[int] = []
    slots: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in order:
        need = -(-sizes[i] // ALIGN) * ALIGN  # whole pages: the next buffer starts on one too
        block = next((b for b in range(len(used)) if used[b] + need <= capacity[b]), None)
        if block is None:
            capacity.append(max(BLOCK_BYTES, pow2_ceil(need) if pinned else need))
            used.append(0)
            block = len(used) - 1
        slots[i] = (block, used[block])
        used[block] += need
    return BlockPlan([allocated_bytes(u, pinned) for u in used], slots)


def reserved_bytes(sizes: Iterable[tuple[int, bool]]) -> int:
    """Host memory a reservation of buffers of `sizes` (bytes, pinned) takes."""
    sizes = list(sizes)
    return sum(sum(plan_blocks([n for n, p in sizes if p == pinned], pinned).block_sizes) for pinned in (False, True))
