"""Host memory of checkpoint saves: measuring it, packing pinned buffers, choosing the save mode, and
what the trainer does when a host allocation fails (forced on the CPU: no GPU here)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from tests.demo_runs import final_state, train_here
from trainers.checkpoint import snapshot as snapshot_module
from trainers.checkpoint.host_blocks import BLOCK_BYTES, allocated_bytes, plan_blocks, reserved_bytes
from trainers.checkpoint.save_mode import choose_save_mode
from trainers.checkpoint.snapshot import SnapshotBuffers, buffer_sizes, snapshot
from trainers.checkpoint.step_files import CheckpointManager
from trainers.checkpoint.writer import CheckpointWriter
from trainers.config.settings import TrainConfig
from trainers.errors import HostMemoryError
from trainers.hardware.host_memory import GiB, HostMemory, host_memory
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.training.optimization import Optimization

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--max-val-batches", "1", "--val-interval", "0", "--log-interval", "100", "--effective-batch", "8",
         "--batch-size", "8"]
# What torch raises when cudaHostAlloc cannot pin the memory asked for.
PINNED_ALLOCATION_FAILED = ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
                            "other API call, so the stacktrace below might be incorrect.")


def _official_trained_sizes() -> list[int]:
    """Byte sizes of the official model's trained tensors (group A), each once: weights, exp_avg, exp_avg_sq."""
    gpt = yaml.safe_load((REPO / "checkpoints" / "config.yaml").read_text(encoding="utf-8"))["gpt"]
    with torch.device("meta"):
        model = UnifiedVoiceGPT(GPTConfig.from_yaml_section(gpt))
    return [p.numel() * 4 for p in model.parameters()] * 3


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_available_memory_is_the_lowest_of_meminfo_and_every_cgroup_limit(tmp_path):
    meminfo = "MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:   12000000 kB\n"
    bare = _tree(tmp_path / "bare", {"proc/meminfo": meminfo})
    assert host_memory(bare) == HostMemory(12000000 * 1024, 16384000 * 1024, "MemAvailable")
    # cgroup v2, a parent limit of 8 GiB binding: room = limit - (usage - inactive page cache)
    v2 = _tree(tmp_path / "v2", {"proc/meminfo": meminfo, "proc/self/cgroup": "0::/job/trainer\n",
                                 "sys/fs/cgroup/job/memory.max": str(8 * GiB),
                                 "sys/fs/cgroup/job/memory.current": str(5 * GiB),
                                 "sys/fs/cgroup/job/memory.stat": f"anon 1\ninactive_file {GiB}\n",
                                 "sys/fs/cgroup/job/trainer/memory.max": "max",
                                 "sys/fs/cgroup/job/trainer/memory.current": str(4 * GiB)})
    assert host_memory(v2) == HostMemory(4 * GiB, 8 * GiB, "cgroup limit 8.0 GiB")
    v1 = _tree(tmp_path / "v1", {"proc/meminfo": meminfo, "proc/self/cgroup": "4:memory:/docker/abc\n0::/\n",
                                 "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": str(6 * GiB),
                                 "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": str(3 * GiB),
                                 "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
                                 "sys/fs/cgroup/memory/memory.usage_in_bytes": str(9 * GiB)})
    assert host_memory(v1) == HostMemory(3 * GiB, 6 * GiB, "cgroup limit 6.0 GiB")
    nothing = host_memory(tmp_path / "empty")  # no /proc: total RAM from sysconf
    assert nothing is not None and nothing.available == nothing.total > 0 and nothing.source == "total RAM"


def test_pinned_snapshot_buffers_of_the_official_model_are_packed_without_power_of_two_rounding():
    sizes = _official_trained_sizes()
    exact = sum(sizes)
    assert exact / GiB == pytest.approx(5.89, abs=0.01)  # weights + AdamW's two moments
    one_each = sum(allocated_bytes(n, pinned=True) for n in sizes)  # one pinned allocation per tensor
    assert one_each / GiB == pytest.approx(8.13, abs=0.01)
    plan = plan_blocks(sizes, pinned=True)
    assert all(b & (b - 1) == 0 and b <= BLOCK_BYTES for b in plan.block_sizes)  # nothing left to round
    assert sum(plan.block_sizes) == 24 * BLOCK_BYTES  # 6.0 GiB: 2% over the buffers, not 38%
    slots = sorted((b, offset, n) for n, (b, offset) in zip(sizes, plan.slots))
    for (b1, o1, n1), (b2, o2, _) in zip(slots, slots[1:]):
        assert b1 != b2 or o1 + n1 <= o2  # no two buffers overlap
    assert all(offset + n <= plan.block_sizes[b] for b, offset, n in slots)
    assert reserved_bytes([(n, False) for n in sizes]) < sum(plan.block_sizes)  # pageable: not rounded at all


def test_reserved_buffers_are_slices_of_few_blocks_and_snapshots_write_the_same_bytes(tmp_path):
    state = {"a": torch.randn(1000), "b": torch.randn(3, 7), "c": torch.arange(5), "view": None}
    state["view"] = state["a"][10:20]  # shares a's storage: one buffer
    buffers = SnapshotBuffers()
    buffers.reserve(buffer_sizes(state, pin_memory=False))
    assert buffers.nbytes == 4000 + 84 + 40 and buffers.allocated_bytes == 3 * 4096  # one block of 3 pages
    snap = snapshot(state, buffers=buffers)
    assert buffers.allocated_bytes == 3 * 4096  # the snapshot took the reserved slices
    for key in ("a", "b", "c"):
        assert snap[key].untyped_storage().nbytes() == state[key].untyped_storage().nbytes()
    assert snap["view"].untyped_storage().data_ptr() == snap["a"].untyped_storage().data_ptr()
    for name, saved in (("snap", snap), ("state", state)):
        (tmp_path / name).mkdir()
        torch.save(saved, tmp_path / name / "same.pth")  # the file's name is written in it
    assert (tmp_path / "snap" / "same.pth").read_bytes() == (tmp_path / "state" / "same.pth").read_bytes()


def test_a_refused_reservation_keeps_none_of_its_blocks(monkeypatch):
    from trainers.checkpoint import host_blocks

    monkeypatch.setattr(host_blocks, "BLOCK_BYTES", 8192)  # 3 buffers of 5000 bytes: 3 blocks
    real, calls = snapshot_module._new_host_storage, []

    def second_refused(nbytes: int, pinned: bool) -> torch.UntypedStorage:
        calls.append(nbytes)
        if len(calls) == 2:
            raise RuntimeError(PINNED_ALLOCATION_FAILED)
        return real(nbytes, pinned)

    monkeypatch.setattr(snapshot_module, "_new_host_storage", second_refused)
    buffers = SnapshotBuffers()
    with pytest.raises(HostMemoryError, match=r"could not allocate 0.0 MiB of pageable host memory \(CUDA error: out "
                                              r"of memory\)$"):
        buffers.reserve([(5000, False)] * 3)
    assert buffers.nbytes == 0 and buffers.allocated_bytes == 0 and len(calls) == 2


def test_pinned_buffers_that_cannot_be_had_become_pageable_ones(tmp_path, monkeypatch, caplog):
    """Pinning refused (forced on the CPU: pinned allocations raise torch's error); the writer reserves pageable
    buffers instead, says so once, and its snapshots then take them."""
    real = snapshot_module._new_host_storage

    def no_pinning(nbytes: int, pinned: bool) -> torch.UntypedStorage:
        if pinned:
            raise RuntimeError(PINNED_ALLOCATION_FAILED)
        return real(nbytes, pinned)

    monkeypatch.setattr(snapshot_module, "_new_host_storage", no_pinning)
    state = {"w": torch.randn(100, 10), "b": torch.randn(10)}
    writer = CheckpointWriter(CheckpointManager(tmp_path, keep=1), pin_memory=True)
    with caplog.at_level(logging.INFO):
        writer.reserve(state)
        writer.wait()
    assert "could not pin host memory for checkpoint snapshots:" in caplog.text and "  could not allocate" in caplog.text
    assert writer.background and writer.pin_memory is False and writer.buffer_bytes == 4040
    reserved = writer._buffers.allocated_bytes
    writer.submit(state, 1)
    assert writer.wait() == tmp_path / "model_step1.pth" and writer._buffers.allocated_bytes == reserved
    writer.close()


def test_adamw_state_to_come_is_sized_as_its_first_step_creates_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    optim = Optimization(model, TrainConfig(), fp16=False, frozen=None, device_type="cpu")
    predicted = sorted((n, d.type == "cuda") for n, d in optim.state_sizes_to_come())
    model(torch.randn(2, 4)).sum().backward()
    optim.apply(optim.prepare())
    assert optim.state_sizes_to_come() == []
    assert predicted == sorted(buffer_sizes(optim.optimizer.state_dict()["state"], pin_memory=None))


@pytest.mark.parametrize("available_gib, workers, expected", [
    (64, 4, (True, True)),      # a large host: pinned
    (9.5, 2, (True, True)),     # 5.95 GiB of packed pinned blocks + 3 GiB kept
    (7.5, 2, (False, False)),   # the copy and what the run still takes do not fit: synchronous
])
def test_save_mode_follows_the_host_memory_available(available_gib, workers, expected):
    sizes = [(n, True) for n in _official_trained_sizes()]
    host = HostMemory(int(available_gib * GiB), 16 * GiB, "MemAvailable")
    mode = choose_save_mode(sizes, host, workers)
    assert (mode.background, mode.pinned) == expected
    assert ("synchronous" in mode.message) == (not mode.background)
    assert choose_save_mode(sizes, None, workers) == choose_save_mode(sizes, HostMemory(GiB * 999, 0, ""), workers)


def test_pageable_buffers_when_only_the_pinned_blocks_do_not_fit():
    sizes = [(BLOCK_BYTES // 2 + 1, True)] * 4  # pinned: 4 blocks of 128 MiB + 4 KiB, each rounded to 256 MiB
    room = 3 * BLOCK_BYTES  # 768 MiB: the 512 MiB of pageable blocks fit, the 1 GiB of pinned ones do not
    mode = choose_save_mode(sizes, HostMemory(room + 2 * GiB, 8 * GiB, "MemAvailable"), 0)
    assert (mode.background, mode.pinned) == (True, False) and "pageable host memory" in mode.message


def test_a_failed_host_allocation_falls_back_to_synchronous_saves(demo_assets, tmp_path, monkeypatch):
    """The reported failure: every host allocation for a snapshot raises what torch raises for a failed pinned
    allocation. The run used to stop at its first save (best.pth, step 0) with exit 5 and "Free GPU memory";
    the reservation at start now meets the failure first and the saves become synchronous."""
    def refused(nbytes: int, pinned: bool) -> torch.UntypedStorage:
        raise RuntimeError(PINNED_ALLOCATION_FAILED)

    monkeypatch.setattr(snapshot_module, "_new_host_storage", refused)
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *FLAGS, "--max-steps", "2", "--background-saves")
    assert result.returncode == 0, result.stderr
    assert "could not reserve host memory for checkpoint snapshots:\n" in result.stderr
    assert "WARNING   could not allocate" in result.stderr
    assert "checkpoint saves are synchronous from now on" in result.stderr
    assert "GPU" not in result.stderr and final_state(out).step == 2


def test_background_saves_reserve_their_buffers_at_start_and_allocate_nothing_in_the_loop(demo_assets, tmp_path,
                                                                                           monkeypatch):
    """The reservation at start-up covers every save, AdamW's moments (created at the first step) included: the
    training thread allocates no host memory for a snapshot. Nothing called the reservation before."""
    import threading

    real, threads = snapshot_module._new_host_storage, []

    def allocate(nbytes: int, pinned: bool) -> torch.UntypedStorage:
        threads.append(threading.current_thread().name)
        return real(nbytes, pinned)

    monkeypatch.setattr(snapshot_module, "_new_host_storage", allocate)
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *FLAGS, "--max-steps", "4", "--save-interval", "2", "--background-saves")
    assert result.returncode == 0, result.stderr
    assert "of pageable host memory for checkpoint snapshots in" in result.stderr  # CPU tensors: not pinned
    assert result.stderr.count("in the background") == 4  # best.pth at steps 0 and 4, model_step2, model_step4
    assert threads and set(threads) == {"checkpoint-writer-reserve"}


def test_background_saves_are_not_chosen_when_their_copy_does_not_fit(demo_assets, tmp_path, monkeypatch):
    import trainers.checkpoint.checkpointer as checkpointer

    monkeypatch.setattr(checkpointer, "host_memory", lambda: HostMemory(GiB, 2 * GiB, "MemAvailable"))
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *FLAGS, "--max-steps", "2", "--background-saves")
    assert result.returncode == 0, result.stderr
    assert "WARNING checkpoint saves are synchronous (the loop waits for each write): a background save keeps\n" \
           in result.stderr
    assert "in the background" not in result.stderr and final_state(out).step == 2


def test_a_host_allocation_failure_at_a_save_stops_with_7_and_keeps_the_last_checkpoint(demo_assets, tmp_path,
                                                                                         monkeypatch):
    """A save's host copy cannot be allocated once a checkpoint exists. On a GPU a synchronous save copies the
    device tensors into new host memory; here the state is on the CPU, so `to_host` is made to copy every tensor
    as it copies device tensors, and the host allocation refuses with torch's error for a failed pinned one."""
    import trainers.checkpoint.writer as writer

    out = tmp_path / "run"
    real = snapshot_module._new_host_storage

    def refused_once_step_2_is_saved(nbytes: int, pinned: bool) -> torch.UntypedStorage:
        if (out / "model_step2.pth").exists():
            raise RuntimeError(PINNED_ALLOCATION_FAILED)
        return real(nbytes, pinned)

    monkeypatch.setattr(snapshot_module, "_new_host_storage", refused_once_step_2_is_saved)
    monkeypatch.setattr(writer, "to_host", lambda state: snapshot(state, pin_memory=False))
    result = train_here(out, *demo_assets, *FLAGS, "--max-steps", "4", "--save-interval", "2")
    assert result.returncode == 7, result.stderr
    assert "not enough host memory (RAM) for the copy of the checkpoint of step 4: could not allocate" \
           in result.stderr
    assert "the previous checkpoint (model_step2.pth) is intact" in result.stderr
    assert "continue with --resume auto --output-dir" in result.stderr
    assert "GPU" not in result.stderr and final_state(out).step == 2


def test_a_host_allocation_failure_while_stopping_on_another_error_exits_7(demo_assets, tmp_path, monkeypatch):
    """Out of memory at micro-batch 1 stops the run after saving the steps done; that save's host copy is refused
    (forced as above). Exit 7 with its message, not a traceback."""
    import trainers.checkpoint.writer as writer

    out = tmp_path / "run"
    real = snapshot_module._new_host_storage

    def refused_after_step_0(nbytes: int, pinned: bool) -> torch.UntypedStorage:
        if (out / "best.pth").exists():
            raise RuntimeError(PINNED_ALLOCATION_FAILED)
        return real(nbytes, pinned)

    monkeypatch.setattr(snapshot_module, "_new_host_storage", refused_after_step_0)
    monkeypatch.setattr(writer, "to_host", lambda state: snapshot(state, pin_memory=False))
    flags = ["--effective-batch", "2", "--batch-size", "1", "--max-steps", "6", *FLAGS[:6]]
    result = train_here(out, *demo_assets, *flags, env={"INDEXTTS_TRAIN_OOM_AT": "3:0"})
    assert result.returncode == 7, result.stderr
    assert "out of memory in step 3 even with a batch of 1" in result.stderr
    assert "not enough host memory (RAM) for the copy of the checkpoint of step 2" in result.stderr


def test_under_torchrun_the_other_processes_of_the_machine_are_counted_before_rank_0_keeps_a_copy():
    """Rank 0 alone keeps the copy, but 8 processes on one machine each load torch's CUDA libraries and start
    their loader processes: a host with room for one trainer's copy has none beside 8 trainers."""
    sizes = [(n, True) for n in _official_trained_sizes()]
    host = HostMemory(16 * GiB, 64 * GiB, "MemAvailable")
    assert choose_save_mode(sizes, host, 2).background
    crowded = choose_save_mode(sizes, host, 2 * 8, trainers=8)
    assert not crowded.background
    assert "less 24.0 GiB kept for torch in 8 trainer processes and 16 data-loader process(es)" in crowded.message
