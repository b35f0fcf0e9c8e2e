"""Checkpoint saves that do not stall the training loop.

A save has two parts with very different costs:

1. ``snapshot(state)`` -- at an optimizer-step boundary, copy every tensor of the
   checkpoint into host memory that training does not touch. This is a memory copy
   (about 0.1 s per GB on a CPU once the buffers exist; on CUDA a pinned, non-blocking
   device-to-host copy followed by one synchronize).
2. Writing that copy with ``CheckpointManager.save`` -- serialisation, fsync, rename,
   link and rotation, seconds to minutes for a multi-GB checkpoint on a cloud disk.

``CheckpointWriter`` runs part 1 in the calling (training) thread and part 2 in a
background thread, so training continues while the bytes go to disk. The write uses the
manager unchanged: the same temp file + fsync + ``os.replace`` + directory fsync, the same
``latest.pth`` link that moves only once the file is complete, the same rotation and the
same ``on_event`` hooks (they are called from the writer thread; a SIGKILL sent from one
kills the whole process, as with a synchronous save).

Why a thread and not a process: the snapshot already lives in this process's memory, so a
thread writes it without another copy or a shared-memory handoff, the fault-injection
hooks keep killing the training process itself, and the slow parts (file writes, fsync)
release the GIL. A child process would have to receive GBs through shared memory and
would die alone when a hook killed it.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from trainers.checkpoint.files import CheckpointManager

logger = logging.getLogger(__name__)

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

    @property
    def nbytes(self) -> int:
        """Host memory held, in bytes."""
        held = sum(s.nbytes() for _, s in self._in_use)
        return held + sum(s.nbytes() for group in self._free.values() for s in group)

    def recycle(self) -> None:
        """Make every buffer available again; earlier snapshots must no longer be used."""
        for key, storage in self._in_use:
            self._free.setdefault(key, []).append(storage)
        self._in_use.clear()

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        key = (nbytes, pinned)
        free = self._free.get(key)
        storage = free.pop() if free else _new_host_storage(nbytes, pinned)
        self._in_use.append((key, storage))
        return storage

    def reserve(self, sizes: Iterable[tuple[int, bool]]) -> None:
        """Allocate and touch free buffers so that a snapshot needing ``sizes`` (byte count,
        pinned) allocates nothing: page faults and pinning happen here, not in the training
        loop. Buffers already held count towards the need."""
        self.recycle()
        need: dict[tuple[int, bool], int] = {}
        for key in sizes:
            need[key] = need.get(key, 0) + 1
        for key, count in need.items():
            free = self._free.setdefault(key, [])
            while len(free) < count:
                storage = _new_host_storage(*key)
                _bytes_view(storage).zero_()  # fault the pages in now
                free.append(storage)

    def release(self) -> None:
        """Drop all buffers (the memory is freed once no snapshot refers to it)."""
        self._free.clear()
        self._in_use.clear()


def _new_host_storage(nbytes: int, pinned: bool) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage, whatever the dtypes of its tensors."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Copier:
    """One traversal of a checkpoint's nested state."""

    def __init__(
        self,
        *,
        copy_cpu: bool,
        buffers: SnapshotBuffers | None,
        pin_memory: bool | None,
        static: Iterable[torch.Tensor] = (),
    ) -> None:
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
        on_cpu = src.device.type == "cpu"
        if on_cpu and not self.copy_cpu:
            dst = src
        else:
            cuda = src.device.type == "cuda"
            pinned = cuda if self.pin_memory is None else self.pin_memory
            if self.buffers is not None:
                dst = self.buffers.take(nbytes, pinned)
            else:
                dst = _new_host_storage(nbytes, pinned)
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


def snapshot(
    state: Any,
    *,
    buffers: SnapshotBuffers | None = None,
    pin_memory: bool | None = None,
    static: Iterable[torch.Tensor] = (),
) -> Any:
    """Copy a checkpoint's nested state into host memory, independent of the original.

    Dicts, lists and tuples are rebuilt; strings, numbers and other immutable values are
    shared; every tensor's data is copied to CPU memory (``.cpu()`` alone would return the
    same storage for a CPU tensor, which training keeps updating in place). Tensors that
    share a storage keep sharing one copy. Other objects are deep-copied.

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
    copier = _Copier(copy_cpu=False, buffers=None, pin_memory=False)
    return copier.value(state)


class CheckpointWriter:
    """Writes checkpoints through a ``CheckpointManager``, by default in the background.

    ``submit(state, step)``: waits for the previous save and re-raises its error, if any;
    then snapshots ``state`` (so training may change it as soon as this returns) and starts
    writing the snapshot in a background thread. ``wait()``: blocks until the write in
    flight is complete and re-raises its error. ``close()``: ``wait()``, then frees the
    snapshot buffers; the writer refuses further submits.

    An exception of a background write (``OSError`` for a full disk, the ``RuntimeError``
    torch's serializer raises, an exception from an ``on_event`` hook) is raised, as the
    same object and so of the same type and with the same cause, by the next ``submit``,
    ``wait`` or ``close`` in the calling thread, once; ``failed_step`` then names the
    step whose save failed. The submit that raises it saves nothing.

    ``background=False`` performs the same ``CheckpointManager.save`` inline in ``submit``
    (errors are raised there directly) without a snapshot copy, for users who prefer the
    blocking behaviour or lack the host memory for a second copy of the state.

    ``static``: CPU tensors training never changes (e.g. ``run.carried``); they are not
    copied at each snapshot, which saves their time and host memory.

    The writer thread is not a daemon: if the process ends normally without ``wait()``,
    the interpreter still lets a started write finish.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        background: bool = True,
        reuse_buffers: bool = True,
        pin_memory: bool | None = None,
        static: Iterable[torch.Tensor] = (),
    ) -> None:
        self.manager = manager
        self.background = background
        self.pin_memory = pin_memory
        self.static = list(static)  # also keeps them alive, so their addresses stay theirs
        self._buffers = SnapshotBuffers() if reuse_buffers else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._closed = False
        self.last_path: Path | None = None  # newest checkpoint known to be complete
        self.last_step: int | None = None
        self.failed_step: int | None = None  # step of the last error raised to the caller
        self.last_snapshot_s = 0.0  # time the caller was blocked by the last snapshot
        self.last_wait_s = 0.0  # time the caller waited for the previous write

    # -- public API --------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A background write (or a ``reserve``) is in progress."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def buffer_bytes(self) -> int:
        return self._buffers.nbytes if self._buffers is not None else 0

    def submit(self, state: Any, step: int, write: Callable[[Any], Path] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step``; see the class docstring. ``write(copy)``, if
        given, writes the host copy instead of ``manager.save`` (e.g. to assemble and checksum it
        off the training thread first) and returns the path written."""
        if self._closed:
            raise RuntimeError("CheckpointWriter is closed")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        t0 = time.perf_counter()
        self._join()
        self.last_wait_s = time.perf_counter() - t0
        self._raise_error()
        if not self.background:
            self.last_snapshot_s = 0.0
            self._write(to_host(state), step, write)
            self._raise_error()
            return
        t1 = time.perf_counter()
        snap = snapshot(state, buffers=self._buffers, pin_memory=self.pin_memory, static=self.static)
        self.last_snapshot_s = time.perf_counter() - t1
        thread = threading.Thread(
            target=self._write, args=(snap, step, write), name=f"checkpoint-writer-step{step}", daemon=False
        )
        del snap  # the thread holds the only reference, so the snapshot is freed when it ends
        self._thread = thread
        thread.start()

    def reserve(self, state: Any) -> None:
        """Optional: allocate the snapshot buffers for states shaped like ``state`` in the
        background, so that the first background save does not allocate (page-fault or pin)
        GBs of host memory inside the training loop; on a VM that can take longer than the
        write itself. Call it once the state has its final shapes, e.g. after the first
        optimizer step (AdamW creates its moments there). Only sizes are read from
        ``state``; the next ``submit`` waits for the allocation to finish. An allocation
        failure is logged, and the snapshot then allocates as usual."""
        if self._closed:
            raise RuntimeError("CheckpointWriter is closed")
        if not self.background or self._buffers is None:
            return
        self._join()  # a write in flight still uses the buffers; its error stays pending
        copier = _Copier(copy_cpu=True, buffers=None, pin_memory=self.pin_memory, static=self.static)
        sizes = copier.sizes(state)
        buffers = self._buffers

        def allocate() -> None:
            t0 = time.perf_counter()
            try:
                buffers.reserve(sizes)
            except Exception as exc:  # e.g. out of (pinnable) memory
                buffers.release()
                logger.warning("could not reserve %.1f GB for checkpoint snapshots (%s: %s); each save will "
                               "allocate its snapshot", sum(n for n, _ in sizes) / 1e9, type(exc).__name__, exc)
                return
            logger.info("reserved %.1f GB of host memory for checkpoint snapshots in %.1f s",
                        buffers.nbytes / 1e9, time.perf_counter() - t0)

        self._thread = threading.Thread(target=allocate, name="checkpoint-writer-reserve", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the save in flight is complete; return the newest complete checkpoint."""
        self._join()
        self._raise_error()
        return self.last_path

    def close(self) -> Path | None:
        """``wait()``, then free the snapshot buffers. Safe to call more than once."""
        try:
            return self.wait()
        finally:
            self._closed = True
            if self._buffers is not None:
                self._buffers.release()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()  # still let the save in flight complete
        except BaseException as err:  # do not hide the exception already on its way out
            logger.error("the background checkpoint write also failed: %s: %s", type(err).__name__, err)

    # -- internals ---------------------------------------------------------

    def _join(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            self.failed_step, self._error_step = self._error_step, None
            raise error

    def _write(self, state: Any, step: int, write: Callable[[Any], Path] | None = None) -> None:
        t0 = time.perf_counter()
        try:
            path = write(state) if write is not None else self.manager.save(state, step)
        except BaseException as exc:  # kept for the caller's thread, whatever it is
            if self.background:
                exc.add_note(f"(while writing the checkpoint of step {step} in the background)")
                logger.error("writing the checkpoint of step %d failed: %s: %s; the error is raised at the "
                             "next save or wait", step, type(exc).__name__, exc)
            self._error, self._error_step = exc, step
            return
        self.last_path, self.last_step = path, step
        if self.background:
            logger.info("checkpoint %s (step %d) written in %.1f s in the background", path, step,
                        time.perf_counter() - t0)


__all__ = ["CheckpointWriter", "SnapshotBuffers", "snapshot", "to_host"]
