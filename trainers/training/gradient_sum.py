"""How N torchrun processes sum a step's gradients once: DDP around a zero loss, with a summing hook.

The gradients are accumulated locally under DDP's no_sync() (see trainers/training/distributed.py);
one backward of `_ZeroLoss` then fires DDP's hooks on every parameter, and the communication hook
sums (not averages) the buckets, since the loss is already normalised by the whole step's tokens.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class _ZeroLoss(torch.nn.Module):
    """What DDP wraps: a loss of 0 x every trained parameter. Its backward adds zeros to each
    gradient accumulated under no_sync(), which fires DDP's hooks on every parameter, so DDP sums
    the accumulated gradients over the processes (its documented no_sync behaviour: they are
    synchronised in the first forward-backward pass after the context)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self) -> torch.Tensor:
        trained = [p for p in self.model.parameters() if p.requires_grad]
        return torch.stack([p.sum() for p in trained]).sum() * 0.0


class PendingSums:
    """The communication hook's state: the works of the current gradient sum, which the caller waits
    for (trainers/training/collective_wait.py); NCCL's are asynchronous to the host."""

    def __init__(self) -> None:
        self.works: list[Any] = []

    def take(self) -> list[Any]:
        works, self.works = self.works, []
        return works


def _sum_gradients(state, bucket):  # no annotations: DDP checks that a hook's are its own types
    """DDP communication hook: the sum over processes (DDP's default divides by their number, and the
    loss is already normalised by the whole step's tokens)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    state.works.append(work)
    return work.get_future().then(lambda f: f.value()[0])


def wrap_for_gradient_sum(model: torch.nn.Module, device: torch.device) -> tuple[Any, PendingSums]:
    """DDP around a zero loss of `model`: its backward sums the gradients accumulated under no_sync; and
    the hook's record of the works of each sum."""
    # The model's buffers are constants: no broadcast before each forward (the keyword was renamed in torch 2.13).
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                      inspect.signature(DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False})
    ddp = DistributedDataParallel(_ZeroLoss(model), device_ids=[device.index] if device.type == "cuda" else None,
                                  **no_buffer_sync)
    pending = PendingSums()
    ddp.register_comm_hook(pending, _sum_gradients)
    return ddp, pending
