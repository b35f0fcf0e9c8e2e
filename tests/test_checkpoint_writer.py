import collections
import copy
import errno
import io
import os
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer_process import run_python_code
from trainers.checkpoint.step_files import CheckpointManager
from trainers.checkpoint.writer import CheckpointWriter, SnapshotBuffers, snapshot, to_host
from trainers.files import os_error_in_chain
from trainers.torch_files import load_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]


class Killed(Exception):
    """Stands in for SIGKILL at an on_event hook."""


def training_state(step: int = 0) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer, list]:
    """A small model and AdamW with moments, and a checkpoint-like state built as the trainer does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    metrics: list = []
    train_one_step(model, opt, metrics)
    return build_state(model, opt, metrics, step), model, opt, metrics


def train_one_step(model, opt, metrics) -> None:
    loss = model(torch.randn(3, 4)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()  # in place: parameters, exp_avg, exp_avg_sq and the step tensor
    metrics.append({"loss": float(loss.detach())})


def build_state(model, opt, metrics, step: int) -> dict:
    return {
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},  # .cpu(): same storage
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": {"keys": torch.arange(4), "pos": 3}},
        "step": step,
        "config": {"lr": 0.1, "betas": (0.9, 0.999)},
        "metrics": metrics,
    }


def assert_same(a, b) -> None:
    """Equal structure and values, tensors compared exactly."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors(value)


def temp_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.iterdir() if ".tmp-" in p.name)


def small(step: int, value: float | None = None) -> dict:
    return {"step": step, "w": torch.full((64, 64), float(step if value is None else value))}


# -- snapshot ------------------------------------------------------------------


def test_snapshot_is_independent_of_later_in_place_updates():
    state, model, opt, metrics = training_state(step=1)
    expected = copy.deepcopy(state)  # clones every tensor
    snap = snapshot(state)

    live = {t.untyped_storage().data_ptr() for t in tensors(state)}
    assert not live & {t.untyped_storage().data_ptr() for t in tensors(snap)}

    for _ in range(3):  # training goes on: every tensor of the state changes in place
        train_one_step(model, opt, metrics)
    state["config"]["lr"] = 0.5
    assert not torch.equal(state["model"]["0.weight"], expected["model"]["0.weight"])
    assert not torch.equal(state["optimizer"]["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])

    assert_same(snap, expected)
    assert len(snap["metrics"]) == 1


def test_snapshot_writes_the_same_bytes_as_the_original_and_keeps_sharing():
    base = torch.arange(12.0)
    state = {
        "a": base,
        "view": base[2:5],  # shares base's storage
        "again": base,
        "t": base.view(3, 4).t(),  # non-contiguous view
        "param": torch.nn.Parameter(torch.ones(3)),
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "ints": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0),
        "od": collections.OrderedDict(x=torch.zeros(2)),
        "nested": [1, (2.5, "x", None), {"k": True}],
    }
    snap = snapshot(state)

    assert snap["again"] is snap["a"]
    assert snap["view"].untyped_storage().data_ptr() == snap["a"].untyped_storage().data_ptr()
    assert snap["a"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert type(snap["param"]) is torch.nn.Parameter and type(snap["od"]) is collections.OrderedDict
    original, copied = io.BytesIO(), io.BytesIO()
    torch.save(state, original)
    torch.save(snap, copied)
    assert original.getvalue() == copied.getvalue()


def test_snapshot_deep_copies_other_objects():
    arr = np.arange(3)
    Pair = collections.namedtuple("Pair", "x y")
    state = {"arr": arr, "pair": Pair(torch.ones(1), 2)}
    snap = snapshot(state)
    arr[0] = 99
    state["pair"].x.add_(1)
    assert snap["arr"].tolist() == [0, 1, 2]
    assert type(snap["pair"]) is Pair and torch.equal(snap["pair"].x, torch.ones(1))


def test_to_host_shares_cpu_tensors():
    state = {"w": torch.ones(3)}
    assert to_host(state)["w"].untyped_storage().data_ptr() == state["w"].untyped_storage().data_ptr()


def test_static_tensors_are_shared_not_copied(tmp_path):
    carried = {"emo_layer.weight": torch.ones(50), "emo_layer.bias": torch.zeros(5)}
    trained = torch.ones(50)
    state = {"model": {"w": trained, **carried}}
    snap = snapshot(state, static=carried.values())
    assert snap["model"]["emo_layer.weight"].untyped_storage().data_ptr() == carried["emo_layer.weight"].data_ptr()
    assert snap["model"]["w"].untyped_storage().data_ptr() != trained.data_ptr()

    writer = CheckpointWriter(CheckpointManager(tmp_path, keep=1), static=carried.values())
    writer.submit(state, 1)
    trained.add_(1)
    writer.wait()
    assert writer.buffer_bytes == trained.nbytes  # only the trained tensor was copied
    writer.close()
    assert_same(load_checkpoint(tmp_path / "latest.pth"), {"model": {"w": torch.ones(50), **carried}})


def test_snapshot_buffers_are_reused_when_sizes_match():
    buffers = SnapshotBuffers()
    first = snapshot({"a": torch.ones(100), "b": torch.zeros(10, 10)}, buffers=buffers)
    pointers = {t.untyped_storage().data_ptr() for t in first.values()}
    held = buffers.nbytes
    assert held == 800

    second = snapshot({"a": torch.full((100,), 2.0), "b": torch.full((10, 10), 3.0)}, buffers=buffers)
    assert {t.untyped_storage().data_ptr() for t in second.values()} == pointers
    assert buffers.nbytes == held
    assert torch.equal(second["a"], torch.full((100,), 2.0)) and torch.equal(second["b"], torch.full((10, 10), 3.0))

    third = snapshot({"a": torch.ones(101)}, buffers=buffers)  # new size: allocated
    assert third["a"].untyped_storage().data_ptr() not in pointers
    buffers.release()
    assert buffers.nbytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshot_of_cuda_tensors_lands_in_pinned_memory():
    state = {"w": torch.randn(1000, device="cuda"), "cpu": torch.ones(2)}
    before = state["w"].cpu()
    buffers = SnapshotBuffers()
    snap = snapshot(state, buffers=buffers)
    state["w"].add_(1)  # an update after the snapshot must not reach it (x + 1 - 1 is not x in floats: compare a copy)
    assert snap["w"].device.type == "cpu" and snap["w"].is_pinned()
    assert torch.equal(snap["w"], before)
    again = snapshot(state, buffers=buffers)
    assert again["w"].untyped_storage().data_ptr() == snap["w"].untyped_storage().data_ptr()


# -- the writer ------------------------------------------------------------------


def test_background_saves_land_complete_and_in_order(tmp_path):
    events = []
    mgr = CheckpointManager(tmp_path, keep=2, on_event=lambda e, s: events.append((e, s)))
    state, model, opt, metrics = training_state()
    expected = {}
    with CheckpointWriter(mgr) as writer:
        for step in range(1, 6):
            state = build_state(model, opt, metrics, step)
            expected[step] = copy.deepcopy(state)
            writer.submit(state, step)
            train_one_step(model, opt, metrics)  # runs while the write is in flight
    assert writer.last_step == 5

    assert events == [(e, s) for s in range(1, 6) for e in ("tmp_written", "renamed", "linked")]
    assert [s for s, _ in mgr.step_files()] == [4, 5]
    assert os.path.samefile(mgr.latest_path(), tmp_path / "model_step5.pth")
    for step in (4, 5):
        assert_same(load_checkpoint(tmp_path / f"model_step{step}.pth"), expected[step])
    assert temp_files(tmp_path) == []


def test_reserve_allocates_the_snapshot_buffers_in_the_background(tmp_path):
    carried = {"emo.w": torch.ones(1000)}
    base = torch.zeros(300)
    state = {"model": {"a": base, "view": base[10:20], **carried}, "opt": [torch.ones(7), torch.ones(7)]}
    writer = CheckpointWriter(CheckpointManager(tmp_path, keep=1), static=carried.values())
    writer.reserve(state)
    assert writer.wait() is None  # waits for the allocation
    assert writer.buffer_bytes == 300 * 4 + 2 * 7 * 4  # shared storage once, static tensor not at all

    reserved = {s.data_ptr() for group in writer._buffers._free.values() for s in group}
    writer.submit(state, 1)
    writer.wait()
    assert writer.buffer_bytes == 300 * 4 + 2 * 7 * 4  # the snapshot allocated nothing more
    assert {s.data_ptr() for _, s in writer._buffers._in_use} == reserved
    assert_same(load_checkpoint(tmp_path / "latest.pth"), state)
    writer.close()


def test_reserve_is_a_no_op_without_background_or_buffers(tmp_path):
    for kwargs in ({"background": False}, {"reuse_buffers": False}):
        writer = CheckpointWriter(CheckpointManager(tmp_path, keep=1), **kwargs)
        writer.reserve(small(1))
        assert not writer.busy and writer.buffer_bytes == 0
        writer.close()


def test_latest_names_the_newest_complete_file_after_each_wait(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    writer = CheckpointWriter(mgr)
    for step in (10, 20, 30):
        writer.submit(small(step), step)
        assert writer.wait() == tmp_path / f"model_step{step}.pth"
        assert load_checkpoint(mgr.latest_path())["step"] == step
        assert mgr.find_resume() == mgr.latest_path()
    writer.close()


def test_background_file_equals_synchronous_file(tmp_path):
    state, *_ = training_state(step=7)
    files = {}
    for background in (False, True):
        run_dir = tmp_path / f"background_{background}"
        with CheckpointWriter(CheckpointManager(run_dir, keep=1), background=background) as writer:
            writer.submit(state, 7)
        files[background] = (run_dir / "model_step7.pth").read_bytes()
    assert files[True] == files[False]


def test_second_submit_waits_for_the_first(tmp_path, monkeypatch):
    """Save 1 is held up before serialising; the state changes and save 2 is submitted.
    Save 2 must wait, or its snapshot would overwrite the buffers save 1 is writing."""
    gate = threading.Event()
    real_save = torch.save

    def slow_save(obj, f, *args, **kwargs):
        if obj["step"] == 1:
            assert gate.wait(10)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow_save)
    w = torch.ones(256, 256)
    writer = CheckpointWriter(CheckpointManager(tmp_path, keep=2))
    writer.submit({"step": 1, "w": w}, 1)
    assert writer.busy
    w.fill_(2.0)  # training continues at once

    threading.Timer(0.3, gate.set).start()
    t0 = time.perf_counter()
    writer.submit({"step": 2, "w": w}, 2)
    assert time.perf_counter() - t0 >= 0.25
    assert writer.last_wait_s >= 0.25
    assert (tmp_path / "model_step1.pth").exists()  # complete before save 2 started
    w.fill_(3.0)
    writer.close()

    assert torch.equal(load_checkpoint(tmp_path / "model_step1.pth")["w"], torch.ones(256, 256))
    assert torch.equal(load_checkpoint(tmp_path / "model_step2.pth")["w"], torch.full((256, 256), 2.0))


def fail_at(step: int, error: BaseException):
    def on_event(event: str, s: int) -> None:
        if event == "tmp_written" and s == step:
            raise error

    return on_event


@pytest.mark.parametrize("surfaces_at", ["submit", "wait", "close"])
def test_background_error_surfaces_at_next_call_with_its_type(tmp_path, surfaces_at):
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    mgr = CheckpointManager(tmp_path, keep=2, on_event=fail_at(2, disk_full))
    writer = CheckpointWriter(mgr)
    writer.submit(small(1), 1)
    writer.submit(small(2), 2)  # fails in the background; this call does not know yet

    with pytest.raises(OSError) as info:
        if surfaces_at == "submit":
            writer.submit(small(3), 3)
        elif surfaces_at == "wait":
            writer.wait()
        else:
            writer.close()
    assert info.value is disk_full and info.value.errno == errno.ENOSPC
    assert writer.failed_step == 2
    assert any("step 2 in the background" in note for note in info.value.__notes__)
    assert not (tmp_path / "model_step3.pth").exists()  # the submit that raised saved nothing
    assert load_checkpoint(mgr.latest_path())["step"] == 1
    assert writer.wait() == tmp_path / "model_step1.pth"  # raised once only

    if surfaces_at != "close":  # the writer stays usable, e.g. after space was freed
        mgr.on_event = None
        writer.submit(small(4), 4)
        assert writer.wait() == tmp_path / "model_step4.pth"
    writer.close()


def test_serializer_error_keeps_its_type_and_cause(tmp_path, monkeypatch):
    def failing_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from err

    mgr = CheckpointManager(tmp_path, keep=2)
    writer = CheckpointWriter(mgr)
    writer.submit(small(1), 1)
    writer.wait()
    monkeypatch.setattr(torch, "save", failing_save)
    writer.submit(small(2), 2)

    with pytest.raises(RuntimeError, match="PytorchStreamWriter") as info:
        writer.wait()
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert os_error_in_chain(info.value) is info.value.__cause__
    assert temp_files(tmp_path) == []  # the manager removes the partial temp file
    assert load_checkpoint(mgr.latest_path())["step"] == 1


def test_synchronous_mode_saves_inline_and_raises_at_once(tmp_path):
    events = []

    def on_event(event, step):
        events.append((event, step, threading.current_thread() is threading.main_thread()))
        if step == 2:
            raise Killed(event)

    mgr = CheckpointManager(tmp_path, keep=2, on_event=on_event)
    writer = CheckpointWriter(mgr, background=False)
    w = torch.ones(3)
    writer.submit({"step": 1, "w": w}, 1)
    assert not writer.busy and writer.last_path == tmp_path / "model_step1.pth"
    assert writer.buffer_bytes == 0  # no snapshot copy
    assert all(in_main for *_, in_main in events)
    with pytest.raises(Killed):
        writer.submit({"step": 2, "w": w}, 2)
    assert writer.failed_step == 2
    assert load_checkpoint(mgr.latest_path())["step"] == 1
    writer.close()


def test_wait_after_the_last_submit_leaves_the_file_complete(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1)
    writer = CheckpointWriter(mgr)
    big = torch.randn(4_000_000)  # 16 MB: the write takes a while
    expected = big.clone()
    writer.submit({"step": 3, "w": big}, 3)
    big.zero_()
    path = writer.close()

    assert path == tmp_path / "model_step3.pth" and not writer.busy
    assert torch.equal(load_checkpoint(mgr.latest_path())["w"], expected)
    assert temp_files(tmp_path) == []
    assert writer.buffer_bytes == 0
    assert writer.close() == path  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(small(4), 4)


def test_leaving_a_with_block_on_an_exception_still_finishes_the_write(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1)
    with pytest.raises(KeyError):
        with CheckpointWriter(mgr) as writer:
            writer.submit(small(5), 5)
            raise KeyError("training failed")
    assert load_checkpoint(mgr.latest_path())["step"] == 5


# -- real processes --------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    import torch
    from trainers.checkpoint.step_files import CheckpointManager
    from trainers.checkpoint.writer import CheckpointWriter
    from trainers.faults import KillPoint

    run_dir, kill_point, background, ending = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
    kill = KillPoint(((kill_point, 9, False),))  # SIGKILL

    def on_event(event, step):
        print(f"{event} {step} in {threading.current_thread().name}", flush=True)
        kill.on_checkpoint_event(event, step)

    writer = CheckpointWriter(CheckpointManager(run_dir, keep=2, on_event=on_event), background=background)
    w = torch.ones(4_000_000)
    writer.submit({"step": 1, "w": w}, 1)
    writer.wait()
    w.fill_(2.0)
    writer.submit({"step": 2, "w": w}, 2)
    if ending == "exit":  # end at once, without wait(): the writer thread is not a daemon
        sys.exit(0)
    for _ in range(50):  # training continues while the save is written
        w.add_(1.0)
        time.sleep(0.01)
    writer.wait()
    print("survived", flush=True)
    """
)


def run_child(run_dir: Path, kill_point: str, background: bool, ending: str = "wait") -> subprocess.CompletedProcess:
    """CHILD in a process of its own, forked from the tests' server (tests/trainer_process.py)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return run_python_code(CHILD, str(run_dir), kill_point, "1" if background else "0", ending, env=env,
                           timeout=120)


def outcome(run_dir: Path) -> dict:
    mgr = CheckpointManager(run_dir, keep=2)
    resume = mgr.find_resume()
    resumed = load_checkpoint(resume)
    return {
        "latest_step": load_checkpoint(mgr.latest_path())["step"],
        "resume": resume.name,
        "resume_step": resumed["step"],
        "resume_w": float(resumed["w"][0]),
        "resume_w_uniform": bool((resumed["w"] == resumed["w"][0]).all()),
        "files": sorted(p.name.split(".tmp-")[0] for p in run_dir.iterdir()),
    }


@pytest.mark.parametrize("event", ["tmp_written", "renamed"])
def test_real_sigkill_during_a_background_write_matches_the_synchronous_path(tmp_path, event):
    results = {}
    for background in (True, False):
        run_dir = tmp_path / f"background_{background}"
        proc = run_child(run_dir, f"save:2:{event}", background)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert "survived" not in proc.stdout
        writer_thread = "checkpoint-writer-step2" if background else "MainThread"
        assert f"{event} 2 in {writer_thread}" in proc.stdout
        results[background] = outcome(run_dir)

    assert results[True] == results[False]
    result = results[True]
    assert result["latest_step"] == 1  # latest.pth never names the killed save
    if event == "tmp_written":
        assert result["resume"] == "latest.pth" and result["resume_step"] == 1 and result["resume_w"] == 1.0
        assert ".model_step2.pth" in result["files"]  # the temp file, removed at the next start
    else:  # renamed: the new file is complete; resume prefers it, exactly as after a synchronous save
        assert result["resume"] == "model_step2.pth" and result["resume_step"] == 2 and result["resume_w"] == 2.0
    assert result["resume_w_uniform"]


def test_process_exit_without_wait_still_completes_the_write(tmp_path):
    proc = run_child(tmp_path, "none", background=True, ending="exit")
    assert proc.returncode == 0, proc.stderr
    mgr = CheckpointManager(tmp_path, keep=2)
    saved = load_checkpoint(mgr.latest_path())
    assert saved["step"] == 2 and torch.equal(saved["w"], torch.full((4_000_000,), 2.0))
    assert temp_files(tmp_path) == []


def test_os_error_in_chain():
    disk_full = OSError(errno.ENOSPC, "full")
    assert os_error_in_chain(disk_full) is disk_full
    try:
        try:
            raise disk_full
        except OSError:
            raise RuntimeError("writer failed")  # implicit chaining (__context__)
    except RuntimeError as err:
        assert os_error_in_chain(err) is disk_full
    assert os_error_in_chain(RuntimeError("no os error")) is None
