"""A run directory copied to another place (another machine, another path) resumes exactly.

The saved input paths are found again (trainers/run/portable.py): inside the moved run
directory, through `--data-root OLD=NEW`, or through the copies `tools/pack_run.py` puts into
the run directory; every file found elsewhere is checked against the run's fingerprints.
Each test moves a real demo run and compares it with one uninterrupted, unmoved run.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.demo_runs import REPO, assert_same_training, final_state, train_here
from trainers.config.flags import parse_command_line
from trainers.run.lock import LOCK_NAME
from trainers.run.portable import INPUTS_FILE, Places, rebase

STEPS = 16
COMMON = ["--batch-size", "8", "--grad-accumulation", "2", "--max-steps", str(STEPS), "--save-interval", "4",
          "--val-interval", "0", "--max-val-batches", "1", "--log-sample-ids", "--dropout", "0.1",
          "--keep-checkpoints", "2", "--log-interval", "100", "--warmup-steps", "4"]


@pytest.fixture(scope="module")
def reference(demo_assets: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run that never moved."""
    out = tmp_path_factory.mktemp("portable_reference") / "run"
    result = train_here(out, *demo_assets, *COMMON)
    assert result.returncode == 0, result.stderr
    return out


def copy_data(demo_assets: list[str], to: Path) -> list[str]:
    """A family's demo corpus, tokenizer, base checkpoint and a copy of its config (IndexTTS2's demo.yaml where the
    flags name none) in the folder `to`, and the flags naming them there."""
    tokenizer = Path(demo_assets[demo_assets.index("--tokenizer") + 1])
    config = Path(demo_assets[demo_assets.index("--config") + 1]) if "--config" in demo_assets else \
        REPO / "checkpoints" / "demo.yaml"
    shutil.copytree(tokenizer.parent, to)
    shutil.copy(config, to / config.name)
    return ["--demo", "--train-manifest", str(to / "train.jsonl"), "--val-manifest", str(to / "val.jsonl"),
            "--tokenizer", str(to / tokenizer.name), "--base-checkpoint", str(to / "base_gpt.pth"),
            "--config", str(to / config.name)]


def copy_run(source: Path, target: Path) -> None:
    """The README's command for moving a run: `cp -a` keeps latest.pth a hard link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(source), str(target)], check=True)
    shutil.rmtree(source)


def trained_then_moved(demo_assets: list[str], tmp_path: Path) -> tuple[Path, Path, Path]:
    """A 4-step run trained with its data in tmp/a, then the run copied to tmp/b and the data moved
    there: (the run's new directory, the data's old folder, its new folder)."""
    old_data, new_data = tmp_path / "a" / "data", tmp_path / "b" / "data"
    flags = copy_data(demo_assets, old_data)
    assert train_here(tmp_path / "a" / "run", *flags, *COMMON, "--max-steps", "4").returncode == 0
    run = tmp_path / "b" / "run"
    copy_run(tmp_path / "a" / "run", run)
    old_data.rename(new_data)
    return run, old_data, new_data


def pack_main(argv: list[str]) -> int:
    from trainers.tools.pack_run import main

    return main(argv)


def snapshot(run: Path) -> dict[str, tuple[str, int]]:
    """Every file of a run directory: its content hash and modification time; but the lock file, which a refused
    start takes and releases before it reads the directory (it names the last holder; trainers/run/lock.py)."""
    return {str(p.relative_to(run)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def assert_latest_is_a_hard_link(run: Path) -> None:
    latest = (run / "latest.pth").stat()
    newest = max(run.glob("model_step*.pth"), key=lambda p: int(p.stem.removeprefix("model_step")))
    assert os.path.samestat(latest, newest.stat()) and latest.st_nlink == 2


def test_moved_run_and_data_resume_with_one_remap_bit_identically(demo_assets, reference, tmp_path):
    old_data, new_data = tmp_path / "studio1" / "data", tmp_path / "studio2" / "datasets" / "voice"
    flags = copy_data(demo_assets, old_data)
    stopped = train_here(tmp_path / "studio1" / "run", *flags, *COMMON, kill_at="SIGTERM@micro:7:0")
    assert stopped.returncode == 143, stopped.stderr
    run = tmp_path / "studio2" / "runs" / "run"
    copy_run(tmp_path / "studio1" / "run", run)
    assert_latest_is_a_hard_link(run)  # cp -a kept it one: the copy is not twice the size
    new_data.parent.mkdir(parents=True)
    old_data.rename(new_data)

    resumed = train_here(run, "--resume", "auto", "--data-root", f"{old_data}={new_data}")
    assert resumed.returncode == 0, resumed.stderr
    assert "(step 7," in resumed.stderr
    for flag, name in (("--train-manifest", "train.jsonl"), ("--tokenizer", "bpe.model"), ("--config", "demo.yaml")):
        assert f"input moved: {flag} {old_data / name} -> {new_data / name}\n" in resumed.stderr
        assert f"input moved: {flag}: --data-root " in resumed.stderr
    assert " WARNING " not in resumed.stderr
    assert_same_training(reference, run, STEPS)  # every model and optimizer tensor, and sample_ids.tsv
    assert final_state(run).settings["tokenizer"] == str(new_data / "bpe.model")  # saved: the next resume needs no flag
    again = train_here(run, "--resume", "auto", "--max-steps", str(STEPS + 2))
    assert again.returncode == 0 and "input moved" not in again.stderr, again.stderr


def test_moved_demo_run_finds_its_demo_data_inside_the_run_directory(reference, tmp_path):
    old = tmp_path / "here" / "demo"
    stopped = train_here(old, "--demo", *COMMON, kill_at="SIGTERM@micro:7:0")
    assert stopped.returncode == 143, stopped.stderr
    run = tmp_path / "elsewhere" / "demo"
    shutil.copytree(old, run)  # a plain recursive copy: latest.pth is now a file of its own, not a link
    shutil.rmtree(old)
    assert not os.path.samestat((run / "latest.pth").stat(), (run / "model_step7.pth").stat())

    resumed = train_here(run, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"input moved: --tokenizer {old}/demo_data/bpe.model -> {run}/demo_data/bpe.model" in resumed.stderr
    assert f"input moved: --tokenizer: inside the run directory, saved as {old}" in resumed.stderr
    assert "Reusing demo corpus" in resumed.stderr  # not generated again
    # --demo generates the same corpus the reference was trained on.
    assert final_state(run).fingerprints == final_state(reference).fingerprints
    assert_same_training(reference, run, STEPS)
    assert_latest_is_a_hard_link(run)  # the copied latest.pth was replaced by a link at the next save


@pytest.mark.parametrize("change", ["manifest", "config"])
def test_a_changed_input_at_the_new_place_is_refused(demo_assets, tmp_path, change):
    run, old_data, new_data = trained_then_moved(demo_assets, tmp_path)
    if change == "manifest":  # one training line fewer: another data set
        lines = (new_data / "train.jsonl").read_text().splitlines(keepends=True)
        (new_data / "train.jsonl").write_text("".join(lines[:-1]))
        flag, fingerprint = "--train-manifest", "data fingerprint"
    else:  # another model: a longer text context
        text = (new_data / "demo.yaml").read_text()
        (new_data / "demo.yaml").write_text(text.replace("max_text_tokens: 48", "max_text_tokens: 64"))
        flag, fingerprint = "--config", "model_config fingerprint"
    before = snapshot(run)

    refused = train_here(run, "--resume", "auto", "--data-root", f"{old_data}={new_data}", "--max-steps", "8")
    assert refused.returncode == 2, refused.stderr
    assert f"{flag} {new_data}" in refused.stderr and fingerprint in refused.stderr
    assert "--allow-config-change" in refused.stderr
    assert snapshot(run) == before  # nothing written

    packed = pack_main([str(run), "--data-root", f"{old_data}={new_data}"])
    if change == "config":  # pack_run checks what it copies the same way
        assert packed == 2 and not (run / INPUTS_FILE).exists()
        assert snapshot(run) == before


def test_missing_inputs_are_reported_all_at_once_with_the_flags_that_fix_them(demo_assets, tmp_path, capsys):
    run, old_data, new_data = trained_then_moved(demo_assets, tmp_path)
    before = snapshot(run)

    wrong = tmp_path / "nowhere"
    refused = train_here(run, "--resume", "auto", "--data-root", f"{old_data}={wrong}")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count(" ERROR ") == 1  # one report, every missing input in it
    for flag, name in (("--train-manifest", "train.jsonl"), ("--val-manifest", "val.jsonl"),
                       ("--tokenizer", "bpe.model"), ("--config", "demo.yaml")):
        assert f"  {flag} {old_data / name} (looked in: {wrong / name}, {old_data / name})" in refused.stderr
        assert f"{flag} FILE" in refused.stderr
    assert "5 input file(s)" not in refused.stderr and "4 input file(s)" in refused.stderr
    assert "--base-checkpoint" not in refused.stderr.split(" ERROR ")[1]  # not needed: the checkpoint carries it
    assert f"--data-root {old_data}=/new/folder" in refused.stderr
    assert snapshot(run) == before

    # tools/pack_run.py reports the same way
    assert pack_main([str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {old_data / 'bpe.model'} (looked in: {old_data / 'bpe.model'})" in err
    assert not (run / INPUTS_FILE).exists()


def resume_packed_elsewhere(packed: Path, run: Path, data: Path, tokenizer: str, config: str) -> None:
    """The packed run copied to `run` and resumed there, its tokenizer, config and base checkpoint gone from the data
    folder (only the data stays behind): the trainer finds the copies inside the run directory."""
    for name in (tokenizer, config, "base_gpt.pth"):
        (data / name).unlink()
    copy_run(packed, run)
    resumed = train_here(run, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"input moved: --tokenizer {data / tokenizer} -> {run / 'inputs' / tokenizer}\n" in resumed.stderr
    assert "input moved: --tokenizer: packed" in resumed.stderr


def test_a_packed_run_resumes_anywhere_without_a_remap(demo_assets, reference, tmp_path, capsys):
    data = tmp_path / "data"
    flags = copy_data(demo_assets, data)
    stopped = train_here(tmp_path / "a" / "run", *flags, *COMMON, kill_at="SIGTERM@micro:7:0")
    assert stopped.returncode == 143, stopped.stderr
    checkpoints = {p.name: snapshot(p.parent)[p.name] for p in (tmp_path / "a" / "run").glob("*.pth")}

    assert pack_main([str(tmp_path / "a" / "run")]) == 0
    out = capsys.readouterr().out
    assert f"copied: --tokenizer {data / 'bpe.model'} -> inputs/bpe.model" in out
    assert f"copied: --config {data / 'demo.yaml'} -> inputs/demo.yaml" in out
    assert "not needed: --base-checkpoint" in out
    assert f"--train-manifest {data / 'train.jsonl'}, and the feature files it names" in out
    assert {p.name: snapshot(p.parent)[p.name] for p in (tmp_path / "a" / "run").glob("*.pth")} == checkpoints
    assert pack_main([str(tmp_path / "a" / "run")]) == 0  # again: nothing to copy
    assert "already inside the run directory: --tokenizer inputs/bpe.model" in capsys.readouterr().out

    run = tmp_path / "b" / "run"
    resume_packed_elsewhere(tmp_path / "a" / "run", run, data, "bpe.model", "demo.yaml")
    assert_same_training(reference, run, STEPS)


def test_a_packed_indextts25_run_carries_its_tiktoken_file_and_config(demo25_assets, tmp_path, capsys):
    """IndexTTS-2.5's tokenizer is a .tiktoken file, its config another gpt section: pack_run copies both and checks
    them as the trainer would (the family reads the vocabulary size from the file); the moved run, its tokenizer
    and config gone from the data folder, resumes from the copies to its last step."""
    data = tmp_path / "data"
    flags = copy_data(demo25_assets, data)
    source = Path(flags[flags.index("--tokenizer") + 1])
    short = ["--batch-size", "4", "--max-steps", "4", "--save-interval", "2", "--val-interval", "0",
             "--log-interval", "100", "--warmup-steps", "2"]
    stopped = train_here(tmp_path / "a" / "run", *flags, *short, kill_at="SIGTERM@micro:3:0")
    assert stopped.returncode == 143, stopped.stderr

    assert pack_main([str(tmp_path / "a" / "run")]) == 0
    out = capsys.readouterr().out
    assert f"copied: --tokenizer {data / source.name} -> inputs/{source.name}" in out, out
    assert f"copied: --config {data / 'demo25.yaml'} -> inputs/demo25.yaml" in out, out
    run = tmp_path / "b" / "run"
    resume_packed_elsewhere(tmp_path / "a" / "run", run, data, source.name, "demo25.yaml")
    ended = final_state(run)
    assert ended.step == 4 and ended.model_family == "indextts25"


def test_a_run_without_a_checkpoint_needs_its_base_checkpoint_and_pack_copies_it(demo_assets, reference, tmp_path,
                                                                                 capsys):
    old_data, new_data = tmp_path / "a" / "data", tmp_path / "b" / "data"
    flags = copy_data(demo_assets, old_data)
    stopped = train_here(tmp_path / "a" / "run", *flags, *COMMON, kill_at="SIGTERM@setup")
    assert stopped.returncode == 143 and not list((tmp_path / "a" / "run").glob("*.pth")), stopped.stderr
    run = tmp_path / "b" / "run"
    copy_run(tmp_path / "a" / "run", run)
    old_data.rename(new_data)
    refused = train_here(run, "--resume", "auto")
    assert refused.returncode == 2
    assert f"--base-checkpoint {old_data / 'base_gpt.pth'}" in refused.stderr  # needed to start at step 0

    assert pack_main([str(run), "--data-root", f"{old_data}={new_data}"]) == 0
    assert "-> inputs/base_gpt.pth" in capsys.readouterr().out
    for name in ("bpe.model", "demo.yaml", "base_gpt.pth"):
        (new_data / name).unlink()
    resumed = train_here(run, "--resume", "auto", "--data-root", f"{old_data}={new_data}")
    assert resumed.returncode == 0, resumed.stderr
    assert "no checkpoint yet" in resumed.stderr
    assert_same_training(reference, run, STEPS)


def test_data_root_replaces_whole_folder_names_only():
    assert rebase("/data/set/a.jsonl", "/data", "/mnt/d") == "/mnt/d/set/a.jsonl"
    assert rebase("/database/a.jsonl", "/data", "/mnt/d") is None
    assert rebase("/data/a.jsonl", "/data/", "/mnt/d/") == "/mnt/d/a.jsonl"
    cmd = parse_command_line(["--data-root", "/old=/new", "--data-root", "/old/sub=/other"])
    assert cmd.data_roots == (("/old", "/new"), ("/old/sub", "/other"))
    with pytest.raises(SystemExit) as stop:
        parse_command_line(["--data-root", "/old"])
    assert stop.value.code == 2


def test_the_places_looked_in_and_their_order(tmp_path):
    run = tmp_path / "run"
    packed = {"tokenizer": {"path": "inputs/bpe.model", "was": "/old/data/bpe.model"}}
    places = Places(run, (("/old", "/a"), ("/old/data", "/b")), packed, (("/old/run", str(run)),))
    assert places.candidates("tokenizer", "/old/data/bpe.model") == [
        ("/b/bpe.model", "--data-root /old/data=/b"),  # the longest OLD wins
        (str(run / "inputs" / "bpe.model"), "packed into the run directory, see inputs.json"),
        ("/old/data/bpe.model", "")]
    assert [p for p, _ in places.candidates("tokenizer", "/old/run/demo_data/bpe.model")] == [
        "/a/run/demo_data/bpe.model", str(run / "demo_data" / "bpe.model"), "/old/run/demo_data/bpe.model"]
    # A config that was another checkout's default is looked for in this checkout too (and checked by its fingerprint).
    assert (str(REPO / "checkpoints" / "demo.yaml"), "the default --config checkpoints/demo.yaml of this checkout") in \
        Places(run, demo=True).candidates("config", "/home/me/indextts-trainer/checkpoints/demo.yaml")
    assert len(Places(run).candidates("config", "/home/me/my.yaml")) == 1
