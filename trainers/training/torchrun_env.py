"""A torchrun worker's place and limits: its rank from torchrun's variables, how long it waits for the
others (--dist-timeout), NCCL's watchdog behind that, its log lines, and the batch summary line."""
from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from trainers.errors import UserError

# Every collective waits at most this long for the other processes; past it the process stops
# (exit 6). It must exceed the longest time one process can legitimately wait for another: rank 0's
# set-up while the others wait (a first check of a large manifest on a network disk: minutes), and
# rank 0 finishing a checkpoint write at an agreement while the others wait (7.7 GB at the official
# size: minutes on a slow cloud disk). 30 minutes covers both with room; a process that hangs past
# it (which torchrun cannot see, unlike one that dies) is ended within half an hour.
# --dist-timeout sets it for one launch; without the flag, the environment variable does.
TIMEOUT_VAR = "INDEXTTS_DDP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
MAX_TIMEOUT_S = 7 * 86400.0
# NCCL's own watchdog gets this much longer than the trainer's wait for the gradient sum, so the
# trainer (exit 6 and its message) acts before the watchdog would abort the process (SIGABRT).
NCCL_WATCHDOG_MARGIN_S = 60.0


def read_torchrun_env(env: dict[str, str], timeout_s: float | None = None) -> dict[str, Any] | None:
    """World's fields from torchrun's variables (None: not started by torchrun). `timeout_s`, from
    --dist-timeout, wins over INDEXTTS_DDP_TIMEOUT_S, which wins over the default."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_size = int(env.get("LOCAL_WORLD_SIZE", size))
        from_var = float(env.get(TIMEOUT_VAR, DEFAULT_TIMEOUT_S)) if timeout_s is None else timeout_s
    except ValueError as exc:
        raise UserError(f"torchrun's RANK / WORLD_SIZE / LOCAL_RANK or {TIMEOUT_VAR} is not a number: {exc}")
    if not (0 <= rank < size and 0 <= local_rank < local_size):
        raise UserError(f"inconsistent torchrun environment: RANK {rank}, WORLD_SIZE {size}, LOCAL_RANK "
                        f"{local_rank}, LOCAL_WORLD_SIZE {local_size}")
    if timeout_s is None and not 0 < from_var <= MAX_TIMEOUT_S:
        raise UserError(f"{TIMEOUT_VAR}={env[TIMEOUT_VAR]}: the wait for the other processes must be > 0 and at "
                        f"most {MAX_TIMEOUT_S:g} seconds; unset it, or pass --dist-timeout SECONDS instead")
    source = "--dist-timeout" if timeout_s is not None else TIMEOUT_VAR if TIMEOUT_VAR in env else "the default"
    return {"rank": rank, "size": size, "local_rank": local_rank, "local_size": local_size,
            "timeout_s": from_var, "timeout_source": source}


def delay_nccl_watchdog(seconds: float) -> str:
    """Give NCCL's watchdog a longer timeout than the trainer's own wait for the gradient sum; returns
    what was done, for the start-up line. Not run here: this project has no multi-GPU machine."""
    try:
        dist.group.WORLD._get_backend(torch.device("cuda"))._set_default_timeout(datetime.timedelta(seconds=seconds))
    except (AttributeError, RuntimeError, ValueError) as exc:  # a private API: it may change between versions
        return f"; NCCL's watchdog keeps the same timeout ({type(exc).__name__}: {exc})"
    return f"; NCCL's watchdog only after {seconds:g} s"


def label_log_lines(rank: int) -> None:
    """Rank 0 logs as a single process does; the others log warnings and errors only, marked with their rank."""
    if rank == 0:
        return
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [rank {rank}] %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
    root.setLevel(logging.WARNING)


def batch_summary(world: Any, effective_batch: int, micro_batch: int, accumulation: int) -> str:
    """'world 2 x (micro-batch 8 x accumulation 1) = effective batch 16' (used by the start-up summary)."""
    covered = world.size * micro_batch * accumulation
    tail = (f"= effective batch {effective_batch}" if covered == effective_batch else
            f"covers effective batch {effective_batch} (at most {world.rank_batch(effective_batch)} samples per "
            "process)")
    return f"world {world.size} x (micro-batch {micro_batch} x accumulation {accumulation}) {tail}"
