import errno
import logging
import os
import signal
import textwrap
from pathlib import Path

import pytest
import torch

from tests.trainer_process import run_python_code
from trainers.checkpoint.step_files import CheckpointManager
from trainers.torch_files import CheckpointError, atomic_torch_save, load_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]


class Killed(Exception):
    """Stands in for SIGKILL at an on_event hook."""


def kill_at(event_name: str, at_step: int):
    def on_event(event: str, step: int) -> None:
        if event == event_name and step == at_step:
            raise Killed(event)

    return on_event


def state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((2, 3), float(step))}}


def loaded_step(path: Path) -> int:
    return load_checkpoint(path)["step"]


def temp_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.iterdir() if ".tmp-" in p.name)


def test_round_trip_with_weights_only(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    written = mgr.save(state(5), step=5)

    assert written == tmp_path / "model_step5.pth"
    for path in (written, mgr.latest_path()):
        obj = torch.load(path, weights_only=True)
        assert obj["step"] == 5
        assert torch.equal(obj["model"]["w"], torch.full((2, 3), 5.0))
    assert temp_files(tmp_path) == []


def test_atomic_torch_save_emits_events_in_order(tmp_path):
    events = []
    target = tmp_path / "x.pth"
    atomic_torch_save({"a": torch.ones(1)}, target, step=3, on_event=lambda e, s: events.append((e, s)))

    assert events == [("tmp_written", 3), ("renamed", 3)]
    assert torch.equal(load_checkpoint(target)["a"], torch.ones(1))


def test_save_emits_all_events_in_order(tmp_path):
    events = []
    mgr = CheckpointManager(tmp_path, keep=1, on_event=lambda e, s: events.append((e, s)))
    mgr.save(state(1), 1)
    assert events == [("tmp_written", 1), ("renamed", 1), ("linked", 1)]


def test_latest_is_hard_link_and_bytes_written_once(tmp_path, monkeypatch):
    calls = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (calls.append(1), real_save(*a, **k)))
    mgr = CheckpointManager(tmp_path, keep=3)

    for step in (1, 2, 3):
        mgr.save(state(step), step)

    assert len(calls) == 3  # one serialisation per save
    assert [s for s, _ in mgr.step_files()] == [1, 2, 3]
    newest = os.stat(tmp_path / "model_step3.pth")
    latest = os.stat(mgr.latest_path())
    assert not mgr.latest_path().is_symlink()
    assert (latest.st_ino, latest.st_dev) == (newest.st_ino, newest.st_dev)
    assert newest.st_nlink == 2
    assert loaded_step(mgr.latest_path()) == 3


def test_rotation_keeps_exactly_keep_files(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    for step in range(0, 50, 10):
        mgr.save(state(step), step)
        assert len(mgr.step_files()) == min(step // 10 + 1, 2)

    assert [s for s, _ in mgr.step_files()] == [30, 40]
    assert loaded_step(mgr.latest_path()) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.pth", "model_step30.pth", "model_step40.pth",
    ]


def test_keep_zero_writes_only_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=0)
    assert mgr.save(state(1), 1) == mgr.latest_path()
    mgr.save(state(2), 2)

    assert [p.name for p in tmp_path.iterdir()] == ["latest.pth"]
    assert not mgr.latest_path().is_symlink()
    assert loaded_step(mgr.latest_path()) == 2
    assert mgr.find_resume() == mgr.latest_path()


def test_apply_keep_without_a_save_leaves_what_latest_does_not_name_as_newest(tmp_path):
    """A resume with nothing to train rotates (trainers/main.py nothing_to_do) only where latest.pth names the
    step resumed, the newest; with keep 0 never the file a symlinked latest.pth needs."""
    saved = CheckpointManager(tmp_path, keep=3)
    for step in (1, 2, 3):
        saved.save(state(step), step)
    names = lambda: sorted(p.name for p in tmp_path.glob("model_step*.pth"))  # noqa: E731
    CheckpointManager(tmp_path, keep=1).apply_keep(2)  # an explicit --resume of model_step2.pth: not the newest
    assert names() == ["model_step1.pth", "model_step2.pth", "model_step3.pth"]
    os.replace(tmp_path / "latest.pth", tmp_path / "old.pth")
    os.symlink("model_step3.pth", tmp_path / "latest.pth")  # a file system without hard links
    CheckpointManager(tmp_path, keep=0).apply_keep(3)
    assert names() == ["model_step3.pth"] and loaded_step(tmp_path / "latest.pth") == 3


def test_saving_same_step_again_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(state(1), 1)
    mgr.save({"step": 1, "model": {"w": torch.zeros(1)}}, 1)

    assert [s for s, _ in mgr.step_files()] == [1]
    assert os.path.samefile(mgr.latest_path(), tmp_path / "model_step1.pth")
    assert torch.equal(load_checkpoint(mgr.latest_path())["model"]["w"], torch.zeros(1))
    assert temp_files(tmp_path) == []


def test_kill_after_tmp_written_keeps_previous_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2, on_event=kill_at("tmp_written", 2))
    mgr.save(state(1), 1)
    before = mgr.latest_path().read_bytes()

    with pytest.raises(Killed):
        mgr.save(state(2), 2)

    assert mgr.latest_path().read_bytes() == before
    assert loaded_step(mgr.latest_path()) == 1
    assert not (tmp_path / "model_step2.pth").exists()
    assert mgr.find_resume() == mgr.latest_path()

    stale = temp_files(tmp_path)
    assert [p.name for p in stale] == [f".model_step2.pth.tmp-{os.getpid()}"]
    assert mgr.clean_stale_temporaries() == stale
    assert temp_files(tmp_path) == []


def test_kill_after_renamed_resumes_from_newer_step_file(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep=2, on_event=kill_at("renamed", 2))
    mgr.save(state(1), 1)
    with pytest.raises(Killed):
        mgr.save(state(2), 2)

    assert loaded_step(mgr.latest_path()) == 1
    with caplog.at_level(logging.INFO, logger="trainers.checkpoint.step_files"):
        resume = mgr.find_resume()
    assert resume == tmp_path / "model_step2.pth"
    assert loaded_step(resume) == 2
    assert "model_step2.pth" in caplog.text


def test_kill_after_linked_keeps_old_files_until_next_save(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1, on_event=kill_at("linked", 2))
    mgr.save(state(1), 1)
    with pytest.raises(Killed):
        mgr.save(state(2), 2)

    assert [s for s, _ in mgr.step_files()] == [1, 2]
    assert mgr.find_resume() == mgr.latest_path()
    assert loaded_step(mgr.latest_path()) == 2

    CheckpointManager(tmp_path, keep=1).save(state(3), 3)
    assert [s for s, _ in mgr.step_files()] == [3]


def test_find_resume_without_latest_uses_newest_step_file(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    assert mgr.find_resume() is None
    for step in (1, 2):
        mgr.save(state(step), step)
    mgr.latest_path().unlink()

    assert mgr.find_resume() == tmp_path / "model_step2.pth"


def test_step_files_and_cleanup_ignore_unrelated_files(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=5)
    mgr.save(state(7), 7)
    unrelated = [
        "model_step01.pth", "model_stepX.pth", "model_step3.pth.bak", "notes.txt",
        ".model_step3.pth.tmp-abc", ".other.pth.tmp-12", "model_step3.pt",
    ]
    for name in unrelated:
        (tmp_path / name).write_text("x")

    assert mgr.step_files() == [(7, tmp_path / "model_step7.pth")]
    assert mgr.clean_stale_temporaries() == []
    assert all((tmp_path / name).exists() for name in unrelated)


def test_corrupt_latest_raises_checkpoint_error_naming_file(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(state(1), 1)
    good = mgr.latest_path().read_bytes()
    # Replace rather than overwrite: writing through the hard link would
    # corrupt model_step1.pth too.
    mgr.latest_path().unlink()
    mgr.latest_path().write_bytes(good[: len(good) // 2])

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(mgr.latest_path())
    assert str(mgr.latest_path()) in str(info.value)
    assert "model_step" in str(info.value)
    assert loaded_step(tmp_path / "model_step1.pth") == 1


def test_missing_or_non_dict_checkpoint_raises(tmp_path):
    with pytest.raises(CheckpointError, match="nope.pth"):
        load_checkpoint(tmp_path / "nope.pth")
    torch.save(torch.ones(1), tmp_path / "tensor.pth")
    with pytest.raises(CheckpointError, match="tensor.pth"):
        load_checkpoint(tmp_path / "tensor.pth")


def test_symlink_fallback_when_hard_links_fail(tmp_path, monkeypatch, caplog):
    def no_link(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "hard links not permitted")

    monkeypatch.setattr(os, "link", no_link)
    mgr = CheckpointManager(tmp_path, keep=1)
    with caplog.at_level(logging.WARNING, logger="trainers.checkpoint.step_files"):
        for step in (1, 2, 3):
            mgr.save(state(step), step)

    latest = mgr.latest_path()
    assert latest.is_symlink()
    assert os.readlink(latest) == "model_step3.pth"  # relative
    assert torch.load(latest, weights_only=True)["step"] == 3
    assert [s for s, _ in mgr.step_files()] == [3]
    assert mgr.find_resume() == latest
    assert temp_files(tmp_path) == []
    assert caplog.text.count("Hard links are not supported") == 1


def test_symlink_fallback_kill_after_renamed(tmp_path, monkeypatch):
    def no_link(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "no hard links here")

    monkeypatch.setattr(os, "link", no_link)
    mgr = CheckpointManager(tmp_path, keep=3, on_event=kill_at("renamed", 2))
    mgr.save(state(1), 1)
    with pytest.raises(Killed):
        mgr.save(state(2), 2)
    assert mgr.find_resume() == tmp_path / "model_step2.pth"


def test_dangling_symlink_latest_falls_back_to_step_file(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    mgr.save(state(1), 1)
    mgr.latest_path().unlink()
    os.symlink("model_step9.pth", mgr.latest_path())

    assert mgr.find_resume() == tmp_path / "model_step1.pth"


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep=-1)
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep=1).save(state(0), -3)


CHILD_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import torch
    from trainers.checkpoint.step_files import CheckpointManager

    def die_mid_save(event, step):
        if event == "tmp_written" and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    run_dir = Path(sys.argv[1])
    CheckpointManager(run_dir, keep=2).save({"step": 1, "w": torch.ones(4)}, 1)
    CheckpointManager(run_dir, keep=2, on_event=die_mid_save).save(
        {"step": 2, "w": torch.zeros(4)}, 2
    )
    print("survived")
    """
)


def test_real_sigkill_during_save(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = run_python_code(CHILD_SCRIPT, str(tmp_path), env=env, timeout=120)  # forked: tests/trainer_process.py
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "survived" not in proc.stdout

    mgr = CheckpointManager(tmp_path, keep=2)
    latest = load_checkpoint(mgr.latest_path())
    assert latest["step"] == 1
    assert torch.equal(latest["w"], torch.ones(4))
    assert mgr.find_resume() == mgr.latest_path()

    removed = mgr.clean_stale_temporaries()
    assert len(removed) == 1
    assert removed[0].name.startswith(".model_step2.pth.tmp-")
    assert temp_files(tmp_path) == []


def test_rotation_never_deletes_what_latest_points_to(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep=1)
    mgr.save(state(5), 5)
    with caplog.at_level(logging.WARNING, logger="trainers.checkpoint.step_files"):
        mgr.save(state(3), 3)  # e.g. resumed from an older checkpoint

    assert "newer checkpoints exist" in caplog.text
    assert os.path.samefile(mgr.latest_path(), tmp_path / "model_step3.pth")
    assert loaded_step(mgr.latest_path()) == 3
