"""Copies of a checkpoint's state in host memory that training does not touch (part 1 of a background save).

``snapshot(state)`` copies every tensor of a nested state into host storage taken from
``SnapshotBuffers``, a pool reused from save to save (allocating, and on CUDA pinning, GBs
each time would cost more than the copy); other values are deep-copied unless immutable.
See trainers/checkpoint/writer.py for how the copy is written.
"""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from typing import Any, Iterable

import torch

from trainers.checkpoint.host_blocks import allocated_bytes, plan_blocks
from trainers.errors import HostMemoryError

# Values that are immutable, so a snapshot may share them with the live state.
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class SnapshotBuffers:
    """Host memory kept between snapshots so that a save does not allocate (and, for
    pinned memory, register) GBs each time.

    Storages are matched by byte size and pinning, not by name: the same model gives
    the same sizes at every save. Taking buffers for a new snapshot recycles those of
    the previous one, so a snapshot made with these buffers is valid only until the
    next ``snapshot(..., buffers=...)`` call with the same object.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._in_use: list[tuple[tuple[int, bool], torch.UntypedStorage]] = []
        self._allocated = 0  # what the allocator holds for them: reserved blocks, pinned rounding

    @property
    def nbytes(self) -> int:
        held = sum(s.nbytes() for _, s in self._in_use)
        return held + sum(s.nbytes() for group in self._free.values() for s in group)

    @property
    def allocated_bytes(self) -> int:
        """Host memory held for the buffers, as the allocators hold it (pinned allocations are
        rounded up to a power of two; a reservation's blocks are not, see host_blocks.py)."""
        return self._allocated

    def recycle(self) -> None:
        """Make every buffer available again; earlier snapshots must no longer be used."""
        for key, storage in self._in_use:
            self._free.setdefault(key, []).append(storage)
        self._in_use.clear()

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        key = (nbytes, pinned)
        free = self._free.get(key)
        if free:
            storage = free.pop()
        else:
            storage = allocate_host(nbytes, pinned)
            self._allocated += allocated_bytes(nbytes, pinned)
        self._in_use.append((key, storage))
        return storage

    def reserve(self, sizes: Iterable[tuple[int, bool]]) -> None:
        """Allocate and touch free buffers so that a snapshot needing ``sizes`` (byte count,
        pinned) allocates nothing: page faults and pinning happen here, not in the training
        loop. Buffers already held count towards the need. The new buffers are slices of a few
        large blocks (trainers/checkpoint/host_blocks.py). HostMemoryError if the memory cannot
        be had; the buffers reserved before stay."""
        self.recycle()
        missing = Counter(sizes) - Counter({key: len(group) for key, group in self._free.items()})
        for pinned in (False, True):
            wanted = [n for (n, p), count in missing.items() if p == pinned for _ in range(count)]
            plan = plan_blocks(wanted, pinned)
            blocks = _allocate_blocks(plan.block_sizes, pinned)
            for block in blocks:
                _bytes_view(block).zero_()  # fault the pages in now
            self._allocated += sum(plan.block_sizes)
            for n, (b, offset) in zip(wanted, plan.slots):
                self._free.setdefault((n, pinned), []).append(blocks[b][offset:offset + n])

    def release(self) -> None:
        """Drop all buffers (the memory is freed once no snapshot refers to it). Pinned memory goes back to
        the system too: torch's pinned allocator keeps freed blocks for its own reuse, which would leave
        a refused reservation's blocks pinned for the rest of the run."""
        pinned = any(key[1] for key in self._free) or any(key[1] for key, _ in self._in_use)
        self._free.clear()
        self._in_use.clear()
        self._allocated = 0
        if pinned:
            _empty_pinned_cache()


def _allocate_blocks(sizes: list[int], pinned: bool) -> list[torch.UntypedStorage]:
    """All the blocks, or none: those taken before a refusal are given back (pinned ones to the system)."""
    blocks = []
    try:
        for size in sizes:
            blocks.append(allocate_host(size, pinned))
    except HostMemoryError:
        blocks.clear()
        if pinned:
            _empty_pinned_cache()
        raise
    return blocks


def _empty_pinned_cache() -> None:
    empty_cache = getattr(torch._C, "_host_emptyCache", None)  # torch.accelerator.empty_host_cache in newer torch
    if empty_cache is not None and torch.cuda.is_available():
        empty_cache()


def _new_host_storage(nbytes: int, pinned: bool) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()


def allocate_host(nbytes: int, pinned: bool) -> torch.UntypedStorage:
    """Host memory for a copy; HostMemoryError when the allocator refuses."""
    try:
        return _new_host_storage(nbytes, pinned)
    except RuntimeError as exc:  # pinned: "CUDA error: out of memory"; pageable: "DefaultCPUAllocator: can't ..."
        cause = (str(exc).strip().splitlines() or ["refused"])[0]
        size = f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.1f} MiB"
        raise HostMemoryError(f"could not allocate {size} of {'pinned' if pinned else 'pageable'} host memory "
                              f"({cause})") from None


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage, whatever the dtypes of its tensors."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Copier:
    """One traversal of a checkpoint's nested state."""

    def __init__(self, *, copy_cpu: bool, buffers: SnapshotBuffers | None, pin_memory: bool | None,
                 static: Iterable[torch.Tensor] = ()) -> None:
        self.copy_cpu = copy_cpu
        self.buffers = buffers
        self.pin_memory = pin_memory
        self.storages: dict[tuple[Any, int, int], torch.UntypedStorage] = {}
        for t in static:  # shared as they are: the caller promises they never change
            storage = t.untyped_storage()
            if storage.device.type != "cpu":
                raise ValueError(f"static tensors must be on the CPU, got one on {storage.device}")
            self.storages[(storage.device, storage.data_ptr(), storage.nbytes())] = storage
        self.tensors: dict[int, torch.Tensor] = {}
        self.devices_to_sync: set[torch.device] = set()

    def value(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, _ATOMIC):
            return obj
        if type(obj) in (dict, OrderedDict):
            return type(obj)((key, self.value(item)) for key, item in obj.items())
        if type(obj) is list:
            return [self.value(item) for item in obj]
        if type(obj) is tuple:
            return tuple(self.value(item) for item in obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*(self.value(item) for item in obj))
        # Anything else (numpy arrays, custom objects): an independent deep copy.
        return copy.deepcopy(obj)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        seen = self.tensors.get(id(t))
        if seen is not None:
            return seen
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"cannot snapshot a {type(t).__name__} (a tensor subclass); convert it to a "
                f"plain tensor before saving"
            )
        if t.device.type == "meta":
            raise ValueError("cannot snapshot a tensor on the meta device: it has no data")
        if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
            # No plain storage to copy; an ordinary copy (sharing is not kept for these).
            out = t.detach().resolve_conj().resolve_neg().to("cpu", copy=self.copy_cpu or t.device.type != "cpu")
        else:
            storage = self.storage(t.untyped_storage())
            # Same storage, offset, sizes and strides as the source: views and tensors that
            # share memory stay shared, exactly as torch.save would store them.
            out = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        elif t.requires_grad:
            out.requires_grad_(True)
        self.tensors[id(t)] = out
        return out

    def storage(self, src: torch.UntypedStorage) -> torch.UntypedStorage:
        nbytes = src.nbytes()
        key = (src.device, src.data_ptr(), nbytes)
        seen = self.storages.get(key) if nbytes else None
        if seen is not None:
            return seen
        if src.device.type == "cpu" and not self.copy_cpu:
            dst = src
        else:
            cuda = src.device.type == "cuda"
            pinned = cuda if self.pin_memory is None else self.pin_memory
            take = self.buffers.take if self.buffers is not None else allocate_host
            dst = take(nbytes, pinned)
            non_blocking = cuda and pinned
            _bytes_view(dst).copy_(_bytes_view(src), non_blocking=non_blocking)
            if non_blocking:
                self.devices_to_sync.add(src.device)
        if nbytes:
            self.storages[key] = dst
        return dst

    def sizes(self, obj: Any) -> list[tuple[int, bool]]:
        """(byte count, pinned) of each storage ``snapshot`` would copy into a buffer."""
        found: dict[tuple[Any, int, int], tuple[int, bool]] = {}
        stack = [obj]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                if item.layout != torch.strided or item.is_quantized or item.device.type == "meta":
                    continue
                storage = item.untyped_storage()
                key = (storage.device, storage.data_ptr(), storage.nbytes())
                if storage.nbytes() and key not in self.storages:
                    cuda = storage.device.type == "cuda"
                    found[key] = (storage.nbytes(), cuda if self.pin_memory is None else self.pin_memory)
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
        return list(found.values())

    def finish(self) -> None:
        # The non-blocking copies were queued on each device's current stream after the
        # step's kernels; one synchronize per device makes the host copies complete.
        for device in self.devices_to_sync:
            torch.cuda.synchronize(device)


def snapshot(state: Any, *, buffers: SnapshotBuffers | None = None, pin_memory: bool | None = None,
             static: Iterable[torch.Tensor] = ()) -> Any:
    """Copy a checkpoint's nested state into host memory, independent of the original.

    Every tensor's data is copied (``.cpu()`` alone would return the same storage for a CPU
    tensor, which training keeps updating in place); tensors that share a storage keep
    sharing one copy.

    CUDA tensors go to pinned memory (``pin_memory`` overrides) with non-blocking copies,
    then one synchronize per device. With ``buffers``, host memory of the previous snapshot
    made with the same object is reused when sizes match; that snapshot must not be in use
    any more (``CheckpointWriter`` guarantees this by waiting for its write first).

    ``static``: CPU tensors that training never changes (the carried conditioning-encoder
    weights); tensors on their storages are shared with the snapshot instead of copied.
    A tensor wrongly declared static is saved as it is when the write reads it.
    """
    if buffers is not None:
        buffers.recycle()
    copier = _Copier(copy_cpu=True, buffers=buffers, pin_memory=pin_memory, static=static)
    out = copier.value(state)
    copier.finish()
    return out


def to_host(state: Any) -> Any:
    """Like ``snapshot`` but CPU tensors are shared, not copied: what a synchronous save
    writes. Device tensors are copied to (pageable) CPU memory."""
    return _Copier(copy_cpu=False, buffers=None, pin_memory=False).value(state)


def buffer_sizes(state: Any, pin_memory: bool, static: Iterable[torch.Tensor] = ()) -> list[tuple[int, bool]]:
    """The host storages (sizes, pinning) a snapshot of ``state`` takes, for ``SnapshotBuffers.reserve``."""
    return _Copier(copy_cpu=True, buffers=None, pin_memory=pin_memory, static=static).sizes(state)
