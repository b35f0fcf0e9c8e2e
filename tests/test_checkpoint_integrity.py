"""Checkpoint checksums (trainers/checkpoint/integrity.py) and `--resume auto` past damaged files.

A flipped byte in tensor data or an edited field loads with torch.load(weights_only=True) and
would silently change the result; these tests damage real demo checkpoints and check that the
schema refuses them by name, that `--resume auto` falls back to the newest intact checkpoint
(moving the damaged one aside, never deleting it) and still ends bit-identical to an
uninterrupted run, and that `tools/inspect_checkpoint.py --verify` reports each case.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from tests.demo_runs import assert_same_training, final_state, train_here
from trainers.checkpoint import integrity, schema
from trainers.checkpoint.recovery import NoIntactCheckpoint, newest_intact, set_aside
from trainers.checkpoint.step_files import CheckpointManager
from trainers.run.lock import LOCK_NAME
from trainers.tools.inspect_checkpoint import main as inspect_main
from trainers.torch_files import CheckpointError

STEPS = 16
FLAGS = ["--max-steps", str(STEPS), "--save-interval", "4", "--val-interval", "0", "--max-val-batches", "1",
         "--log-sample-ids", "--dropout", "0.1", "--keep-checkpoints", "3", "--log-interval", "100"]
V1_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "v1_run"


# ---------------------------------------------------------------- runs and damage

@pytest.fixture(scope="module")
def reference(demo_assets: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    result = train_here(out, *demo_assets, *FLAGS)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def partial(demo_assets: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference run stopped at step 12: model_step4/8/12.pth, latest.pth a hard link to step 12."""
    out = tmp_path_factory.mktemp("partial") / "run"
    result = train_here(out, *demo_assets, *FLAGS, "--max-steps", "12", "--lr-decay-steps", str(STEPS))
    assert result.returncode == 0, result.stderr
    assert os.path.samefile(out / "latest.pth", out / "model_step12.pth")
    return out


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run directory in which latest.pth is again a hard link to its step file."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("latest.pth"))
    twin = next(p for p in src.glob("model_step*.pth") if os.path.samefile(p, src / "latest.pth"))
    os.link(dst / twin.name, dst / "latest.pth")
    return dst


def data_records(path: Path) -> list[tuple[int, int]]:
    """(offset in the file, size) of each tensor storage of a torch zip file, largest first.

    torch stores the records uncompressed, so their bytes sit in the file as they are."""
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0]
    assert infos and all(i.compress_type == zipfile.ZIP_STORED for i in infos)
    records = []
    with open(path, "rb") as f:
        for info in infos:
            f.seek(info.header_offset)
            header = f.read(30)
            assert header[:4] == b"PK\x03\x04"
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            records.append((info.header_offset + 30 + name_len + extra_len, info.file_size))
    return sorted(records, key=lambda r: -r[1])


def flip_byte(path: Path, offset: int) -> None:
    """In place: every hard link of the file sees the change, as with real disk corruption."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def flip_model_byte(path: Path) -> str:
    """Flip one byte inside the data of a model tensor; returns the tensor's key. The file still loads."""
    before = torch.load(path, weights_only=True)["model"]
    for offset, size in data_records(path):
        flip_byte(path, offset + size // 2)
        after = torch.load(path, weights_only=True)["model"]  # loads without complaint
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        if changed:
            assert len(changed) == 1
            return changed[0]
        flip_byte(path, offset + size // 2)  # that record was not a model tensor's: undo
    raise AssertionError("no data record of a model tensor found")


def edit_step_keeping_checksums(path: Path, step: int) -> None:
    """Change progress.step and save again with torch.save, the old checksums left as they were."""
    obj = torch.load(path, weights_only=True)
    obj["progress"]["step"] = step
    path.unlink()  # a new file, so a hard-linked twin keeps the original
    torch.save(obj, path)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


# ---------------------------------------------------------------- the digests

def test_tensor_digest_covers_dtype_shape_and_values_whatever_the_layout():
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    digest = integrity.tensor_digest
    assert digest(t.T) == digest(t.T.contiguous())  # non-contiguous: its elements, in row-major order
    assert digest(t[1:3]) == digest(t[1:3].clone())  # a view: its own elements, not the whole storage
    assert digest(t.reshape(6, 4)) != digest(t)  # same bytes, other shape
    assert digest(t.view(torch.int32)) != digest(t)  # same bytes, other dtype
    assert digest(torch.zeros(4, dtype=torch.bfloat16)) != digest(torch.zeros(4, dtype=torch.float16))
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))  # bit-exact, not value-equal
    changed = t.clone()
    changed[3, 5] = torch.nextafter(changed[3, 5], torch.tensor(10.0))
    assert digest(changed) != digest(t)
    for odd in (torch.zeros(0, 3), torch.zeros(3, 0), torch.tensor(2.5), torch.tensor(True),
                torch.ones(3, dtype=torch.bfloat16), torch.arange(6, dtype=torch.int64)[::2]):
        assert len(digest(odd)) == 64
    assert digest(torch.zeros(0, 3)) != digest(torch.zeros(3, 0))


def test_fields_keep_types_apart_and_survive_a_round_trip(tmp_path):
    def fields(value):
        return integrity.compute({"format": "x", "s": {"v": value}})["fields"]["s/v"]

    assert len({fields(1), fields(1.0), fields(True), fields("1"), fields(None)}) == 5
    assert fields([1, 2]) == fields((1, 2))  # torch.save keeps tuples, but which one it is changes nothing
    assert fields({"a": 1, "b": 2}) == fields({"b": 2, "a": 1})
    assert fields(float("nan")) == fields(float("nan"))
    content = {"format": "x", "model": {"w": torch.ones(2, 3), "b": torch.zeros(0)},
               "optim": {"state": {0: {"exp_avg": torch.ones(3, 2).T, "step": torch.tensor(3.0)}},
                         "groups": [{"lr": 1e-3}]},
               "rng": {"torch": torch.get_rng_state(), "python": [3, (1, 2), None]}}
    content["integrity"] = integrity.compute(content)
    torch.save(content, tmp_path / "x.pth")
    loaded = torch.load(tmp_path / "x.pth", weights_only=True)
    assert integrity.problems(loaded, loaded["integrity"]) == []
    assert set(loaded["integrity"]["tensors"]) == {"model/w", "model/b", "optim/state/0/exp_avg",
                                                   "optim/state/0/step", "rng/torch"}
    loaded["optim"]["groups"][0]["lr"] = 2e-3
    assert integrity.problems(loaded, loaded["integrity"]) == ["field optim/groups differs from what was written"]


# ---------------------------------------------------------------- real checkpoints

def all_tensors(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(all_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(all_tensors(v) for v in value)
    return 0


def test_a_written_checkpoint_carries_checksums_of_everything_and_still_loads_as_before(partial):
    obj = torch.load(partial / "latest.pth", weights_only=True)
    assert obj["format"] == schema.FORMAT == "indextts2-gpt-trainer/3"
    assert all(isinstance(v, torch.Tensor) for v in obj["model"].values())  # upstream inference takes "model"
    record = obj["integrity"]
    assert len(record["tensors"]) == all_tensors({k: v for k, v in obj.items() if k != "integrity"})
    assert {"format", "progress/step", "data/epoch", "data/step_in_epoch", "rng/python", "rng/numpy", "run/config",
            "optim/optimizer", "optim/lr_schedule"} <= record["fields"].keys()
    assert "rng/torch" in record["tensors"] and "optim/optimizer/state/0/exp_avg" in record["tensors"]
    assert schema.read(partial / "latest.pth").verified


def test_a_flipped_byte_in_tensor_data_is_detected_by_name(partial, tmp_path):
    path = tmp_path / "model_step12.pth"
    shutil.copy(partial / "model_step12.pth", path)
    key = flip_model_byte(path)
    with pytest.raises(schema.IntegrityError) as info:
        schema.read(path)
    assert info.value.problems == [f"tensor model/{key} differs from what was written"]
    assert str(path) in str(info.value) and "corrupt" in str(info.value)
    assert schema.read(path, mmap=True).step == 12  # metadata readers that skip the checksums still read it


def test_an_edited_step_field_is_detected(partial, tmp_path):
    path = tmp_path / "model_step12.pth"
    shutil.copy(partial / "model_step12.pth", path)
    edit_step_keeping_checksums(path, 11)
    with pytest.raises(schema.IntegrityError) as info:
        schema.read(path)
    assert info.value.problems == ["field progress/step differs from what was written"]


def test_a_truncated_file_or_a_missing_record_is_refused(partial, tmp_path):
    path = tmp_path / "model_step12.pth"
    shutil.copy(partial / "model_step12.pth", path)
    truncate(path)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        schema.read(path)
    obj = torch.load(partial / "model_step12.pth", weights_only=True)
    del obj["integrity"]
    torch.save(obj, path)
    with pytest.raises(schema.IntegrityError, match="checksums is missing"):
        schema.read(path)


def test_formats_without_checksums_load_marked_not_verified(partial, tmp_path):
    old = schema.read(V1_FIXTURE / "model_step4.pth")
    assert old.integrity == "checksums not verified: written before checksums existed (format 1)"
    obj = torch.load(partial / "model_step12.pth", weights_only=True)
    del obj["integrity"]
    obj["format"] = "indextts2-gpt-trainer/2"
    v2 = schema.parse(obj, tmp_path / "v2.pth")
    assert (v2.format_version, v2.integrity, v2.verified) == (
        2, "checksums not verified: written before checksums existed (format 2)", False)


# ---------------------------------------------------------------- falling back

def listing(run: Path) -> dict[str, bytes]:
    """The run directory's files and bytes, but for the lock file (it names whoever last held the directory)."""
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file() and p.name != LOCK_NAME}


def fall_back(run: Path):
    """What --resume auto does: find the newest intact checkpoint, then (run locked) set the damaged aside."""
    found = newest_intact(run)
    assert found is not None
    return found, set_aside(run, found.damaged, found.path)


def test_a_corrupt_latest_and_its_step_twin_fall_back_to_the_previous_step(partial, tmp_path, caplog):
    run = copy_run(partial, tmp_path / "run")
    key = flip_model_byte(run / "latest.pth")  # through the link: model_step12.pth is damaged too
    damaged = (run / "model_step12.pth").read_bytes()
    with caplog.at_level(logging.WARNING, logger="train"):
        found, moved = fall_back(run)
    assert found.path == run / "model_step8.pth" and found.checkpoint.step == 8
    said = " ".join(m.strip() for m in caplog.messages)  # the reason is wrapped over lines of its own
    assert "latest.pth (= model_step12.pth)" in said and f"tensor model/{key} differs" in said
    assert (run / "model_step12.pth.corrupt").read_bytes() == damaged  # kept, byte for byte
    assert moved[0].moved_to == [run / "model_step12.pth.corrupt"]
    mgr = CheckpointManager(run, keep=3)
    assert os.path.samefile(run / "latest.pth", run / "model_step8.pth")  # never left pointing at bad data
    assert [s for s, _ in mgr.step_files()] == [4, 8]
    assert mgr.find_resume() == mgr.latest_path()
    assert mgr.clean_stale_temporaries() == [] and (run / "model_step12.pth.corrupt").exists()
    again = newest_intact(run)
    assert again is not None and again.path == run / "latest.pth" and again.damaged == []


def test_a_corrupt_step_file_newer_than_latest_no_longer_blocks_the_resume(partial, tmp_path):
    """A kill between writing model_step12.pth and relinking latest.pth, then damage to that file."""
    run = copy_run(partial, tmp_path / "run")
    CheckpointManager(run, keep=3).point_latest_at(run / "model_step8.pth")
    truncate(run / "model_step12.pth")
    found, _ = fall_back(run)
    assert found.checkpoint.step == 8 and found.path == run / "model_step8.pth"
    assert (run / "model_step12.pth.corrupt").exists() and not (run / "model_step12.pth").exists()
    assert os.path.samefile(run / "latest.pth", run / "model_step8.pth")


def test_a_damaged_latest_that_is_a_file_of_its_own_is_moved_aside_too(partial, tmp_path):
    run = copy_run(partial, tmp_path / "run")
    (run / "model_step12.pth").unlink()  # latest.pth is now the only name of step 12
    edit_step_keeping_checksums(run / "latest.pth", 13)
    damaged = (run / "latest.pth").read_bytes()
    found, _ = fall_back(run)
    assert found.path == run / "model_step8.pth"
    assert (run / "latest.pth.corrupt").read_bytes() == damaged
    assert os.path.samefile(run / "latest.pth", run / "model_step8.pth")


def test_an_earlier_set_aside_file_is_never_overwritten(partial, tmp_path):
    run = copy_run(partial, tmp_path / "run")
    (run / "model_step12.pth.corrupt").write_bytes(b"from an earlier fallback")
    truncate(run / "model_step12.pth")
    found, _ = fall_back(run)
    assert found.checkpoint.step == 8
    assert (run / "model_step12.pth.corrupt").read_bytes() == b"from an earlier fallback"
    assert (run / "model_step12.pth.corrupt-2").exists()


def test_no_intact_checkpoint_stops_and_changes_nothing(partial, tmp_path):
    run = copy_run(partial, tmp_path / "run")
    flip_model_byte(run / "model_step12.pth")
    truncate(run / "model_step8.pth")
    edit_step_keeping_checksums(run / "model_step4.pth", 5)
    before = listing(run)
    with pytest.raises(NoIntactCheckpoint) as info:
        newest_intact(run)
    message = str(info.value)
    assert "no intact checkpoint" in message
    for name, why in (("latest.pth (= model_step12.pth)", "differs from what was written"),
                      ("model_step8.pth", "truncated or corrupt"), ("model_step4.pth", "field progress/step differs")):
        assert f"  {name}: " in message and why in message.split(f"  {name}: ")[1].splitlines()[0], name
    assert listing(run) == before


def test_a_newer_format_is_not_mistaken_for_damage(partial, tmp_path):
    run = copy_run(partial, tmp_path / "run")
    obj = torch.load(run / "model_step12.pth", weights_only=True)
    obj["format"] = "indextts2-gpt-trainer/99"
    for name in ("latest.pth", "model_step12.pth"):
        (run / name).unlink()
    torch.save(obj, run / "model_step12.pth")
    os.link(run / "model_step12.pth", run / "latest.pth")
    before = listing(run)
    with pytest.raises(schema.UnknownFormat):
        newest_intact(run)
    assert listing(run) == before


# ---------------------------------------------------------------- the trainer

def test_resume_auto_falls_back_past_a_corrupt_newest_and_ends_bit_identical(reference, partial, tmp_path):
    run = copy_run(partial, tmp_path / "run")
    key = flip_model_byte(run / "latest.pth")
    before = listing(run)
    refused = train_here(run, "--resume", "auto", "--max-steps", str(STEPS), "--seed", "9")  # refused later on
    assert refused.returncode == 2 and listing(run) == before  # so the damaged file was not moved yet
    resumed = train_here(run, "--resume", "auto", "--max-steps", str(STEPS))
    assert resumed.returncode == 0, resumed.stderr
    warnings = [line for line in resumed.stderr.splitlines() if " WARNING " in line]
    said = " ".join(w.split(" WARNING ", 1)[1].strip() for w in warnings)  # the reason is wrapped into lines
    assert "latest.pth (= model_step12.pth)" in said and f"tensor model/{key} differs" in said
    assert any("renamed the damaged model_step12.pth to model_step12.pth.corrupt" in w for w in warnings)
    assert "resuming from" in resumed.stderr and "(step 8," in resumed.stderr and "checksums verified" in resumed.stderr
    assert (run / "model_step12.pth.corrupt").exists()
    assert_same_training(reference, run, STEPS)
    assert (final_state(run).epoch, final_state(run).step_in_epoch) == (0, STEPS)


def test_resume_of_a_named_corrupt_file_is_refused(partial, tmp_path):
    run = copy_run(partial, tmp_path / "run")
    edit_step_keeping_checksums(run / "model_step8.pth", 9)
    before = listing(run)
    refused = train_here(run, "--resume", str(run / "model_step8.pth"))
    assert refused.returncode == 2
    assert "model_step8.pth" in refused.stderr and "field progress/step differs" in refused.stderr
    assert listing(run) == before  # no fallback and nothing moved: the user named that file


def test_resume_auto_without_an_intact_checkpoint_exits_2(partial, tmp_path):
    run = copy_run(partial, tmp_path / "run")
    for name in ("model_step12.pth", "model_step8.pth", "model_step4.pth"):
        truncate(run / name)
    before = listing(run)
    refused = train_here(run, "--resume", "auto")
    assert refused.returncode == 2
    assert "no intact checkpoint" in refused.stderr and "model_step4.pth: " in refused.stderr
    assert listing(run) == before


# ---------------------------------------------------------------- inspect --verify

def verify(capsys, path: Path, *flags: str) -> tuple[int, str]:
    code = inspect_main([str(path), "--verify", *flags])
    return code, capsys.readouterr().out


def test_inspect_verify(partial, demo_assets, tmp_path, capsys):
    code, out = verify(capsys, partial / "latest.pth")
    assert code == 0 and "integrity: ok" in out
    path = tmp_path / "flipped.pth"
    shutil.copy(partial / "model_step12.pth", path)
    key = flip_model_byte(path)
    code, out = verify(capsys, path)
    assert code == 1 and "integrity: CORRUPT" in out and f"tensor model/{key} differs" in out
    code, out = verify(capsys, path, "--json")
    assert code == 1 and json.loads(out)["problems"] == [f"tensor model/{key} differs from what was written"]
    shutil.copy(partial / "model_step12.pth", path)
    edit_step_keeping_checksums(path, 3)
    code, out = verify(capsys, path)
    assert code == 1 and "field progress/step differs" in out
    truncate(path)
    code, out = verify(capsys, path)
    assert code == 1 and "truncated or corrupt" in out
    code, out = verify(capsys, V1_FIXTURE / "model_step4.pth")
    assert code == 0 and "integrity: not verifiable: written before checksums existed (format 1)" in out
    base = Path(demo_assets[demo_assets.index("--base-checkpoint") + 1])
    code, out = verify(capsys, base)
    assert code == 0 and "not verifiable: not a checkpoint of this trainer" in out
    assert inspect_main([str(tmp_path / "missing.pth"), "--verify"]) == 2
