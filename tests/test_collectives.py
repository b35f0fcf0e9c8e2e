"""A torchrun process whose collective hangs or fails ends with exit 6 and its message, in this process.

NCCL's gradient sum is asynchronous to the host: DDP's backward returns while the all-reduce is
still running, and a process whose peer hangs or died used to block at the next CUDA
synchronisation until NCCL's watchdog aborted it (SIGABRT). There is no NCCL here, so the
condition is forced with real gloo works of a two-rank group made in this process (one thread per
rank): rank 1 never joins rank 0's all-reduce, which therefore never ends (a hung peer), or ends
with gloo's error after the group's own timeout (a failed collective). `World.sum_gradients`
gets them as the communication hook records NCCL's works; DDP itself is stood in for by a pass
that issues them, since DDP over gloo waits for its works before backward returns.
"""
from __future__ import annotations

import datetime
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from trainers.errors import EXIT_PEER_LOST, DistributedFailure, UserError
from trainers.training import collective_wait
from trainers.training.distributed import World
from trainers.training.gradient_sum import PendingSums


def two_ranks(timeout_s: float) -> list[dist.ProcessGroupGloo]:
    """Rank 0 and rank 1 of a gloo group in this process (each constructor waits for the other)."""
    store, groups = dist.HashStore(), [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(groups), "the two-rank gloo group did not form"
    return groups


class _AsyncSum:
    """What DDP's backward leaves behind with NCCL: the all-reduce issued (recorded by the hook), not done."""

    def __init__(self, group: dist.ProcessGroupGloo, pending: PendingSums, grad: torch.Tensor) -> None:
        self.group, self.pending, self.grad = group, pending, grad

    def __call__(self) -> "_AsyncSum":
        return self

    def backward(self) -> None:
        self.pending.works.append(self.group.allreduce([self.grad]))


def world_waiting_on(group: dist.ProcessGroupGloo, grad: torch.Tensor, timeout_s: float, stop=None) -> World:
    pending = PendingSums()
    return World(rank=0, size=2, timeout_s=timeout_s, stop=stop, _ddp=_AsyncSum(group, pending, grad),
                 _pending=pending)


def test_a_gradient_sum_that_never_ends_stops_with_exit_6_after_the_timeout():
    groups = two_ranks(timeout_s=60)  # gloo's own timeout far away: the trainer's wait must act
    grad = torch.ones(4)
    world = world_waiting_on(groups[0], grad, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(DistributedFailure) as failure:
        world.sum_gradients()
    assert 0.5 <= time.monotonic() - started < 10
    assert failure.value.exit_status == EXIT_PEER_LOST and world.broken
    assert re.match(r"no answer from the other processes for \d+ s during the gradient sum \(--dist-timeout 0.5\)",
                    str(failure.value)), failure.value
    groups[1].allreduce([torch.ones(4)]).wait()  # rank 1 arrives at last: the work ends, nothing is left running


def test_a_gradient_sum_that_fails_stops_with_exit_6_and_the_backends_error():
    groups = two_ranks(timeout_s=0.3)  # rank 1 never comes: gloo ends rank 0's work with its timeout error
    world = world_waiting_on(groups[0], torch.ones(4), timeout_s=60)
    with pytest.raises(DistributedFailure) as failure:
        world.sum_gradients()
    message = str(failure.value)
    assert message.startswith("lost contact with the other processes of this run during the gradient sum (")
    assert "Timed out" in message and failure.value.exit_status == EXIT_PEER_LOST


def test_a_stop_signal_while_a_peer_does_not_come_ends_the_wait(monkeypatch):
    """torchrun signals every worker when one of them died; the survivor stops waiting for it."""
    monkeypatch.setattr(collective_wait, "SIGNAL_GRACE_S", 0.2)
    groups = two_ranks(timeout_s=60)
    world = world_waiting_on(groups[0], torch.ones(4), timeout_s=60, stop=SimpleNamespace(requested=True))
    started = time.monotonic()
    with pytest.raises(DistributedFailure, match="a stop signal came during the gradient sum"):
        world.sum_gradients()
    assert time.monotonic() - started < 10
    groups[1].allreduce([torch.ones(4)]).wait()


def test_a_gradient_sum_that_ends_is_summed_and_returns():
    groups = two_ranks(timeout_s=60)
    grad = torch.ones(4)
    world = world_waiting_on(groups[0], grad, timeout_s=30)
    peer = threading.Thread(target=lambda: (time.sleep(0.2), groups[1].allreduce([torch.full((4,), 2.0)]).wait()))
    peer.start()
    world.sum_gradients()
    peer.join()
    assert grad.tolist() == [3.0] * 4 and not world.broken and world._pending.works == []


def test_the_wait_for_the_others_comes_from_the_flag_then_the_variable_then_the_default():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert (World.from_env(env).timeout_s, World.from_env(env).timeout_source) == (1800.0, "the default")
    old = {**env, "INDEXTTS_DDP_TIMEOUT_S": "120"}  # the variable keeps working without the flag
    assert (World.from_env(old).timeout_s, World.from_env(old).timeout_source) == (120.0, "INDEXTTS_DDP_TIMEOUT_S")
    flagged = World.from_env(old, timeout_s=45.0)
    assert (flagged.timeout_s, flagged.timeout_source) == (45.0, "--dist-timeout")
    with pytest.raises(UserError, match="INDEXTTS_DDP_TIMEOUT_S=0: the wait .* pass --dist-timeout SECONDS"):
        World.from_env({**env, "INDEXTTS_DDP_TIMEOUT_S": "0"})
    assert World.from_env({}).timeout_s == 1800.0 and not World.from_env({}, timeout_s=5.0).distributed


def test_dist_timeout_is_a_flag_of_this_launch_checked_at_once(capsys):
    from trainers.config.flags import parse_command_line

    cmd = parse_command_line(["--resume", "auto", "--output-dir", "x", "--dist-timeout", "90"])
    assert cmd.dist_timeout == 90.0 and "dist_timeout" not in cmd.given  # never saved with the run
    with pytest.raises(SystemExit) as refused:
        parse_command_line(["--dist-timeout", "0"])
    assert refused.value.code == 2
    assert "--dist-timeout: must be a finite number > 0 and <= 604800, got '0'" in capsys.readouterr().err


def test_a_second_stop_signal_while_waiting_leaves_the_group_as_it_is():
    """A second signal abandons the step at once (StopNow); with a sum possibly still running on NCCL, the
    process group must not be destroyed on the way out (that would wait for it)."""
    from trainers.stop_signals import StopNow

    class SecondSignal:
        @property
        def requested(self):
            raise StopNow(15)  # what the handler raises in the middle of the wait

    groups = two_ranks(timeout_s=60)
    world = world_waiting_on(groups[0], torch.ones(4), timeout_s=60, stop=SecondSignal())
    with pytest.raises(StopNow):
        world.sum_gradients()
    assert world.broken
    groups[1].allreduce([torch.ones(4)]).wait()
