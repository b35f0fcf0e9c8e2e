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

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from trainers.checkpoint.snapshot import SnapshotBuffers, buffer_sizes, snapshot, to_host
from trainers.checkpoint.step_files import CheckpointManager
from trainers.errors import HostMemoryError

logger = logging.getLogger(__name__)

class CheckpointWriter:
    """Writes checkpoints through a ``CheckpointManager``, by default in the background.

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

    def __init__(self, manager: CheckpointManager, *, background: bool = True, reuse_buffers: bool = True,
                 pin_memory: bool | None = None, static: Iterable[torch.Tensor] = ()) -> None:
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

    @property
    def busy(self) -> bool:
        """A background write (or a ``reserve``) is in progress. Never waits: ``failed_write_step`` polls it at
        every step, and benchmarks/save_stall.py trains on while it is true to measure what a save costs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed_write_step(self) -> int | None:
        """The step of a write that has ended with an error not yet raised to the caller; None while a
        write is going or when none failed. Never waits (the training thread polls it at every step)."""
        if self.busy:
            return None
        return self._error_step if self._error is not None else None

    @property
    def buffer_bytes(self) -> int:
        """Host memory the reused snapshot buffers hold now (0 without them): what background saves cost in
        RAM, which benchmarks/save_stall.py reports next to the blocked time they save."""
        return self._buffers.nbytes if self._buffers is not None else 0

    def submit(self, state: Any, step: int, write: Callable[[Any], Path] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step``: wait for the previous save and re-raise its error, if any;
        then snapshot ``state`` (so training may change it as soon as this returns) and write the snapshot in a
        background thread. ``write(copy)``, if given, writes the host copy instead of ``manager.save`` (e.g. to
        assemble and checksum it off the training thread first) and returns the path written."""
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
        optimizer step (AdamW creates its moments there), or pass the final sizes to
        ``reserve_sizes``. Only sizes are read from ``state``; the next ``submit`` waits for
        the allocation to finish."""
        self.reserve_sizes(buffer_sizes(state, self.pin_memory, self.static))

    def reserve_sizes(self, sizes: list[tuple[int, bool]]) -> None:
        """``reserve`` for buffers of known sizes (byte count, pinned). When the host cannot give
        them, the writer falls back and says so in one line: pinned buffers that cannot be had
        become pageable ones (slower copies), pageable ones that cannot be had make the saves
        synchronous (no copy is kept between saves)."""
        if self._closed:
            raise RuntimeError("CheckpointWriter is closed")
        if not self.background or self._buffers is None:
            return
        self._join()  # a write in flight still uses the buffers; its error stays pending
        self._thread = threading.Thread(target=self._reserve, args=(list(sizes),), name="checkpoint-writer-reserve",
                                        daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the save in flight is complete; return the newest complete checkpoint."""
        self._join()
        self._raise_error()
        return self.last_path

    def close(self) -> Path | None:
        """``wait()``, then free the snapshot buffers; the writer refuses further submits. Safe to call more than
        once."""
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

    def _reserve(self, sizes: list[tuple[int, bool]]) -> None:
        """In the reserving thread; the training thread reads the mode it leaves only after joining it."""
        assert self._buffers is not None
        t0, refused = time.perf_counter(), []
        tries = [sizes, [(n, False) for n, _ in sizes]] if any(p for _, p in sizes) else [sizes]
        for wanted in tries:
            try:
                self._buffers.reserve(wanted)
            except HostMemoryError as exc:
                self._buffers.release()
                refused.append(str(exc))
                continue
            gib = self._buffers.allocated_bytes / 2 ** 30
            if not refused:
                logger.info("reserved %.2f GiB of %s host memory for checkpoint snapshots in %.1f s", gib,
                            "pinned" if any(p for _, p in wanted) else "pageable", time.perf_counter() - t0)
                return
            self.pin_memory = False
            logger.warning("could not pin host memory for checkpoint snapshots:")
            logger.warning("  %s", refused[0])
            logger.warning("background saves copy into %.2f GiB of pageable memory instead, which is slower;", gib)
            logger.warning("nothing to do unless the copies stall training (then free host memory)")
            return
        self.background = False
        logger.warning("could not reserve host memory for checkpoint snapshots:")
        for reason in refused:
            logger.warning("  %s", reason)
        logger.warning("checkpoint saves are synchronous from now on (the loop waits for each write,")
        logger.warning("and the host copy is made only while writing);")
        logger.warning("free host memory to have background saves at the next start")

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
