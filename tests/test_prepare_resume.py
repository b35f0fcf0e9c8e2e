"""indextts-prepare killed with SIGKILL at every write point and at random instants, then run again with the same
command: the output equals an uninterrupted run's, byte for byte (trainers/tools/prepare/store.py). The killed
runs are processes of their own, forked from the tests' server (tests/trainer_process.py)."""
from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from tests.prepare_data import assert_same_output, corpus, flags, prepare_here, prepare_process
from trainers.tools.prepare.settings import Shard
from trainers.tools.prepare.store import Store

# Every kind of write, in the order a run reaches it (4 batches of 4 clips, 4 files per clip), chained: each killed
# run continues the one before it.
WRITE_POINTS = ("plan:1", "feature_tmp:2", "feature:6", "record:1", "feature_tmp:7", "record:2", "manifest_tmp:1",
                "manifest:3", "merged:1")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    """The corpus and an uninterrupted run's output."""
    root = tmp_path_factory.mktemp("prepare_resume")
    listing, tokenizer, config = corpus(root / "audio", "indextts2")
    result = prepare_here(*flags(listing, tokenizer, config, root / "reference", "--batch-size", "4"))
    assert result.returncode == 0, result.stderr
    return listing, tokenizer, config, root / "reference"


def test_killed_at_every_write_point_and_run_again_it_ends_as_an_uninterrupted_run(data, tmp_path):
    listing, tokenizer, config, reference = data
    out = tmp_path / "out"
    argv = flags(listing, tokenizer, config, out, "--batch-size", "4")
    for point in WRITE_POINTS:
        proc = prepare_process(*argv, env={"INDEXTTS_PREPARE_KILL_AT": point})
        assert proc.wait(60) == -signal.SIGKILL, f"{point}: not killed there\n{proc.stderr_text()}"
        if point == "feature_tmp:2":
            assert [p.name for p in (out / "features").iterdir() if p.name.startswith(".")], "no temporary left"
    records = sorted((out / ".prepare").glob("records-*.jsonl"))
    with open(records[0], "ab") as f:
        f.write(b'{"id": "spk0_00", "key": "torn')  # a record a power loss cut mid-way
    final = prepare_here(*argv)
    assert final.returncode == 0, final.stderr
    assert "removed" not in final.stdout  # the temporaries went with the merge of the killed runs
    assert_same_output(reference, out)
    lines = records[0].read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])  # the torn record was cut off


def test_killed_at_random_instants_and_run_again_it_ends_as_an_uninterrupted_run(data, tmp_path):
    listing, tokenizer, config, reference = data
    assert prepare_process("--help").wait(120) == 0  # the tests' server started, if no test started it before
    started = time.monotonic()
    timing = prepare_process(*flags(listing, tokenizer, config, tmp_path / "timing", "--batch-size", "4"))
    assert timing.wait(60) == 0, timing.stderr_text()
    took = time.monotonic() - started  # a whole run as a process, here and now
    out = tmp_path / "out"
    argv = flags(listing, tokenizer, config, out, "--batch-size", "4")
    draw = random.Random(40)
    delays = [round(draw.uniform(0.2, 0.9) * took, 3) for _ in range(4)]
    statuses, recorded = [], []
    for delay in delays:
        proc = prepare_process(*argv)
        time.sleep(delay)
        proc.kill_tree()
        statuses.append(proc.wait(30))
        recorded.append(sum(len(p.read_text().splitlines()) for p in (out / ".prepare").glob("records-*.jsonl"))
                        if (out / ".prepare").is_dir() else 0)
    landed = f"delays {delays} of a {took:.2f} s run: statuses {statuses}, records after each {recorded}"
    assert statuses.count(-signal.SIGKILL) >= 2 and 0 < recorded[-1], landed  # killed mid-way, after some records
    final = prepare_here(*argv)
    assert final.returncode == 0, f"{landed}\n{final.stderr}"
    assert_same_output(reference, out)


def test_a_second_process_on_the_same_shard_is_refused(data, tmp_path):
    listing, tokenizer, config, _ = data
    out = tmp_path / "out"
    Store(out).state.mkdir(parents=True)
    held = Store(out).journal(Shard()).open()
    try:
        refused = prepare_here(*flags(listing, tokenizer, config, out))
    finally:
        held.close()
    assert refused.returncode == 2
    assert "another indextts-prepare is preparing shard 1/1 into" in refused.stderr


def test_under_torchrun_each_process_prepares_its_shard_and_one_set_of_manifests_is_written(data, tmp_path):
    """Two processes under torchrun (its workers are `python -m trainers.tools.prepare.cli`): shards 1/2 and 2/2 by
    RANK, and the one finishing last writes the manifests, those of one process."""
    from tests.demo_runs import subprocess_env
    from tests.trainer_process import TrainerProcess

    listing, tokenizer, config, reference = data
    out = tmp_path / "out"
    argv = ["--standalone", "--nproc_per_node", "2", "-m", "trainers.tools.prepare.cli",
            *flags(listing, tokenizer, config, out, "--batch-size", "4")]
    proc = TrainerProcess(argv, subprocess_env(), new_session=True, command="torchrun")
    assert proc.wait(240) == 0, proc.stderr_text()[-4000:]
    assert sorted(p.name for p in (out / ".prepare").glob("records-*")) == ["records-1-of-2.jsonl",
                                                                          "records-2-of-2.jsonl"]
    assert "shard 1/2: " in proc.stderr_text() and "shard 2/2: " in proc.stderr_text()
    assert_same_output(reference, out, exact=False)
