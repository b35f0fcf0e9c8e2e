"""Several processes under torchrun train exactly the single-process run (trainers/training/distributed.py).

Every launch is `python -m torch.distributed.run --standalone --nproc_per_node 2 trainers/train_gpt_v2.py`
on the CPU with gloo (torchrun forked from the tests' server, tests/trainer_process.py; its workers are the
script), several seconds each on 2 cores, so the claims share runs:

* one uninterrupted 2-process run (the reference for bit-identity) against one single-process run;
* one 2-process run that is killed and resumed four times: the whole machine (torchrun and every
  worker SIGKILLed) at step 6, SIGTERM to rank 1 alone during step 9 (a background save), SIGKILL of
  rank 1 alone after step 11 (rank 0 exits 6, never of SIGABRT), SIGKILL of rank 0 while its
  background write of step 12 is half done; the last resume must end bit-identical to the 2-process
  reference;
* a copy of that run as the machine left it at step 6, continued by one process, then by two with
  another split and an out-of-memory error injected into rank 1: the single-process steps;
* an epoch of 17 samples at effective batch 16: the last step has 1 sample for 2 processes;
* a background write of rank 0 that fails (a file-size limit, as a full disk): both stop with 4.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.demo_runs import SCRIPT, assert_close_weights, assert_same_training, final_state, subprocess_env, train_here
from tests.slowness import scaled
from tests.trainer_process import TrainerProcess

STEPS = 12
COMMON = ["--effective-batch", "16", "--max-steps", str(STEPS), "--save-interval", "4", "--val-interval", "0",
          "--max-val-batches", "1", "--log-sample-ids", "--dropout", "0.1", "--keep-checkpoints", "10",
          "--log-interval", "4", "--warmup-steps", "4"]
# A hung collective ends after this many seconds instead of 30 minutes (the backstop the tests must never reach).
BACKSTOP = {"INDEXTTS_DDP_TIMEOUT_S": "60"}


def torchrun(out: Path, *args: str, nproc: int = 2, kill_at: str | None = None, env: dict[str, str] | None = None,
             timeout: float = 240, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """The trainer under torchrun, in a session of its own; torchrun is forked from the test's server
    (tests/trainer_process.py), its workers are the script. After a timeout torchrun, its workers (each in
    a session of its own) and their loader processes are killed by pid, never left running.
    `file_size_limit`: RLIMIT_FSIZE of torchrun and its workers (`ulimit -f`), a disk that fills up.
    `timeout`: seconds on an idle machine (tests/slowness.py)."""
    argv = ["--standalone", "--nproc_per_node", str(nproc), str(SCRIPT), "--output-dir", str(out), *args]
    proc = TrainerProcess(argv, subprocess_env(kill_at, {**BACKSTOP, **(env or {})}), new_session=True,
                          file_size_limit=file_size_limit, command="torchrun")
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"torchrun hung for {hung.timeout:.0f} s: {' '.join(proc.argv)}\n{proc.stderr_text()[-5000:]}")
    return proc.result()


def worker_statuses(result: subprocess.CompletedProcess) -> dict[int, int]:
    """Each rank's exit code, from torchrun's failure report (torchrun itself exits 1 when any worker fails)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", result.stderr)
    return {int(rank): int(code) for rank, code in found}


def history(out: Path, kind: str) -> list[dict]:
    return [h for h in final_state(out).history if h["kind"] == kind]


def assert_close_metrics(a: list[dict], b: list[dict], keys: tuple[str, ...], rel: float) -> None:
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        for key in keys:
            assert y[key] == pytest.approx(x[key], rel=rel), f"step {x['step']} {key}: {x[key]} vs {y[key]}"


@pytest.fixture(scope="module")
def single(demo_assets, tmp_path_factory) -> Path:
    """One process, micro-batch 8 x accumulation 2."""
    out = tmp_path_factory.mktemp("single") / "run"
    result = train_here(out, *demo_assets, *COMMON, "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def two(demo_assets, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Two processes, each micro-batch 8 x accumulation 1; never interrupted."""
    out = tmp_path_factory.mktemp("two") / "run"
    result = torchrun(out, *demo_assets, *COMMON, "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.fixture(scope="module")
def machine_lost(demo_assets, tmp_path_factory) -> tuple[Path, Path]:
    """Two processes until the machine dies at step 6 (torchrun and both workers SIGKILLed), and a copy."""
    out = tmp_path_factory.mktemp("killed") / "run"
    killed = torchrun(out, *demo_assets, *COMMON, "--batch-size", "8", kill_at="machine/step:6")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stderr.count("fault injection") == 2  # each worker reached step 6, then the machine was gone
    assert final_state(out).step == 4
    from trainers.run.lock import RunLock

    RunLock(out).acquire().release()  # no worker survived to hold the run directory
    copy = tmp_path_factory.mktemp("copy") / "run"
    shutil.copytree(out, copy, symlinks=True)
    return out, copy


def test_two_processes_train_the_single_process_steps(single, two):
    out, result = two
    assert "batch: world 2 x (micro-batch 8 x accumulation 1) = effective batch 16" in result.stderr
    assert (out / "sample_ids.tsv").read_text() == (single / "sample_ids.tsv").read_text()
    assert_close_weights(single, out)
    # The logged loss sums and token counts are the whole step's: the same values as one process. The
    # gradient norm is the single-process one (averaged gradients would halve it).
    assert_close_metrics(history(single, "train"), history(out, "train"),
                         ("text_loss", "mel_loss", "mel_top1", "grad_norm"), rel=1e-4)
    # Validation is split between the processes and reduced; on the same weights (step 0) only the order of
    # the float sums differs.
    single_val, two_val = history(single, "val"), history(out, "val")
    assert_close_metrics(single_val[:1], two_val[:1], ("text_loss", "mel_loss", "mel_top1"), rel=1e-6)
    assert_close_metrics(single_val, two_val, ("text_loss", "mel_loss", "mel_top1"), rel=1e-4)
    assert final_state(out).sections["hardware"]["world_size"] == 2
    assert len(list((out / "logs").glob("events.out.tfevents.*"))) == 1  # rank 0 alone writes


def test_killed_signalled_and_a_dead_process_resume_bit_identically(demo_assets, two, machine_lost):
    out = machine_lost[0]
    # SIGTERM to rank 1 alone while it computes step 9: both stop after step 9 with one checkpoint.
    # Their shutdown is made to abort (SIGABRT@exit, as gloo's threads did at times after such a stop).
    aborts = "rank0/SIGABRT@exit,rank1/SIGABRT@exit"
    stopped = torchrun(out, "--resume", "auto", "--background-saves", kill_at=f"rank1/SIGTERM@micro:9:0,{aborts}")
    assert worker_statuses(stopped) == {0: 143, 1: 143}, stopped.stderr
    assert stopped.returncode == 1  # torchrun's own status when any worker exits non-zero
    assert "[rank 1] received SIGTERM" in stopped.stderr
    assert "a stop signal reached 1 of 2 processes" in stopped.stderr
    assert "stopped by signal at step 9" in stopped.stderr
    assert re.findall(r"saved checkpoint \S+ \(step (\d+)\)", stopped.stderr) == ["8", "9"]  # periodic, then the stop's
    assert "(step 9) written in" in stopped.stderr  # in rank 0's background writer, complete before both exits
    assert final_state(out).step == 9

    # Rank 1 SIGKILLed after step 11: rank 0 stops at its next collective, long before the backstop, with
    # status 6. Interpreter shutdown, where gloo's threads at times abort such a process (SIGABRT), is
    # made to abort every time here (rank0/SIGABRT@exit): rank 0 must leave without it.
    lost = torchrun(out, "--resume", "auto", kill_at="rank1/step:11,rank0/SIGABRT@exit")
    ended = time.time()
    statuses = worker_statuses(lost)
    assert statuses == {1: -signal.SIGKILL, 0: 6}, lost.stderr
    assert "lost contact with the other processes" in lost.stderr
    when = re.search(r"(\S+ \S+) fault injection: rank 1 sends SIGKILL at step:11", lost.stderr)
    assert when, lost.stderr
    # within 20 s on an idle machine, and always well within the 60 s backstop
    assert ended - time.mktime(time.strptime(when.group(1), "%Y-%m-%d %H:%M:%S")) < min(scaled(20), 45)
    assert final_state(out).step == 9  # step 12 was never completed by both, so never saved

    # Rank 0 SIGKILLed in its background writer, with the final checkpoint's file half written: rank 1, waiting
    # to learn how the write ends, exits 6; step 9 stays the newest checkpoint.
    killed = torchrun(out, "--resume", "auto", "--background-saves", kill_at="rank0/save:12:tmp_written")
    assert worker_statuses(killed) == {0: -signal.SIGKILL, 1: 6}, killed.stderr
    assert "lost contact with the other processes" in killed.stderr
    assert final_state(out).step == 9

    resumed = torchrun(out, "--resume", "auto", "--background-saves")
    assert resumed.returncode == 0, resumed.stderr  # 0 once the final background write is complete
    assert " WARNING " not in resumed.stderr, resumed.stderr
    assert "checkpoint saves are synchronous" not in resumed.stderr and "(step 12) written in" in resumed.stderr
    assert_same_training(two[0], out, STEPS)


def test_a_background_write_that_fails_stops_both_processes_with_4(demo_assets, tmp_path):
    """Rank 0 writes in the background; the others learn that it failed at the next step boundary."""
    out = tmp_path / "run"
    flags = ["--effective-batch", "16", "--batch-size", "8", "--save-interval", "2", "--val-interval", "0",
             "--max-val-batches", "1", "--log-interval", "100", "--lr-decay-steps", "8"]
    assert train_here(out, *demo_assets, *flags, "--max-steps", "4").returncode == 0
    size = (out / "latest.pth").stat().st_size
    # The next save would be step 12: the failure at step 6 must stop both long before it.
    failed = torchrun(out, "--resume", "auto", "--max-steps", "16", "--save-interval", "6", "--log-interval", "1",
                      "--background-saves", "--dist-timeout", "60", file_size_limit=size // 2)
    assert worker_statuses(failed) == {0: 4, 1: 4}, failed.stderr
    assert 7 <= max(int(s) for s in re.findall(r"INFO step (\d+)/16", failed.stderr)) <= 9, failed.stderr
    assert "waits at most 60 s for the others (--dist-timeout)" in failed.stderr
    assert "writing the checkpoint of step 6 failed" in failed.stderr  # in the background: training went on
    assert "could not write the checkpoint of step 6" in failed.stderr and "File too large" in failed.stderr
    assert "[rank 1] rank 0 could not write the checkpoint of step 6 (see its message)" in failed.stderr
    assert "Traceback" not in failed.stderr.split("elastic/multiprocessing/api.py")[0]  # the workers' lines
    assert final_state(out).step == 4 and not [p.name for p in out.iterdir() if ".tmp" in p.name]
    # A stop's save fails in the background: every process waits to learn how it ended, and all exit 4 (not 143).
    stopped = torchrun(out, "--resume", "auto", "--max-steps", "16", "--background-saves",
                       kill_at="rank1/SIGTERM@micro:5:0", file_size_limit=size // 2)
    assert worker_statuses(stopped) == {0: 4, 1: 4}, stopped.stderr
    assert "[rank 1] rank 0 could not write the checkpoint of step 5 (see its message)" in stopped.stderr
    assert final_state(out).step == 4


def test_two_then_one_then_two_processes_with_an_out_of_memory_error_on_one(single, machine_lost):
    out = machine_lost[1]  # two processes until the machine died at step 6; the newest checkpoint is step 4
    one = train_here(out, "--resume", "auto", kill_at="SIGTERM@micro:8:0")
    assert one.returncode == 143, one.stderr
    assert "the checkpoint was written by 2 process(es), this run has 1" in one.stderr
    assert final_state(out).step == 8
    # Two processes again, each at 4 x 2; rank 1 runs out of memory in the second micro-batch of step 10, after
    # the first added its gradients: both redo the step at 2 x 4.
    # No allocator setting of the user's (empty counts as unset): each worker sets expandable segments itself, so
    # the halving message has nothing to suggest (tests/test_cuda_alloc.py: what it says when they are off).
    no_allocator_conf = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""}
    two = torchrun(out, "--resume", "auto", "--batch-size", "4",
                   env={"INDEXTTS_TRAIN_OOM_AT": "rank1/10:1", **no_allocator_conf})
    assert two.returncode == 0, two.stderr
    assert "fragmented" not in two.stderr and "expandable_segments" not in two.stderr
    assert "world 2 x (micro-batch 4 x accumulation 2) = effective batch 16" in two.stderr
    assert "the checkpoint was written by 1 process(es), this run has 2" in two.stderr
    assert "out of memory at step 10 with micro-batch 4: redone with micro-batch 2 x accumulation 4" in two.stderr
    assert "WARNING cause: out of memory in 1 of 2 processes" in two.stderr
    assert "[rank 1] cause: CUDA out of memory (injected" in two.stderr
    assert (out / "sample_ids.tsv").read_text() == (single / "sample_ids.tsv").read_text()
    assert_close_weights(single, out)


def test_a_last_step_with_fewer_samples_than_processes(demo_assets, tmp_path):
    flags = list(demo_assets)
    manifest = Path(flags[flags.index("--train-manifest") + 1])
    short = manifest.with_name("train17.jsonl")  # beside it: the feature paths are relative to the manifest
    short.write_text("".join(manifest.read_text().splitlines(keepends=True)[:17]))
    flags[flags.index("--train-manifest") + 1] = str(short)
    # 2 epochs of 17 samples: steps of 16, 1, 16, 1 samples. One validation sample: rank 1 validates none.
    flags += ["--effective-batch", "16", "--epochs", "2", "--lr-decay-steps", "4", "--warmup-steps", "1",
              "--save-interval", "1", "--val-interval", "0", "--max-val-batches", "1", "--val-batch-size", "1",
              "--log-sample-ids", "--dropout", "0.1", "--log-interval", "1"]
    single, out = tmp_path / "single", tmp_path / "two"
    assert train_here(single, *flags).returncode == 0
    first = train_here(out, *flags, "--max-steps", "1")
    assert first.returncode == 0, first.stderr
    rest = torchrun(out, "--resume", "auto", "--max-steps", "4", timeout=120)
    assert rest.returncode == 0, rest.stderr
    ids = (out / "sample_ids.tsv").read_text()
    assert [len(line.split("\t")[2].split(",")) for line in ids.splitlines()] == [16, 1, 16, 1]
    assert ids == (single / "sample_ids.tsv").read_text()
    assert_close_weights(single, out)
    two_val = [h for h in history(out, "val") if h["step"] != 1]  # less the end of the single-process part
    assert_close_metrics(history(single, "val"), two_val, ("text_loss", "mel_loss", "mel_top1"), rel=1e-4)


def test_a_step_is_divided_by_strided_slices_and_nothing_changes_without_torchrun(monkeypatch):
    from trainers.data.data_order import StepPlan
    from trainers.faults import for_this_process
    from trainers.training.distributed import World
    from trainers.training.torchrun_env import batch_summary

    single = World.from_env({})
    plan = StepPlan(0, 3, [[9, 4, 7], [1, 8, 2], [6]])
    assert not single.distributed and single.own_part(plan, 2) is plan and single.rank_batch(16) == 16
    worlds = [World.from_env({"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)}) for r in (0, 1)]
    assert [w.own_part(plan, 2).micro_batches for w in worlds] == [[[9, 7], [8, 6]], [[4, 1], [2]]]
    assert [w.own_part(StepPlan(1, 1, [[5]]), 8).micro_batches for w in worlds] == [[[5]], []]  # rank 1: none
    assert worlds[1].rank_batch(17) == 9
    assert batch_summary(worlds[0], 16, 8, 1) == "world 2 x (micro-batch 8 x accumulation 1) = effective batch 16"
    monkeypatch.setenv("RANK", "1")
    assert for_this_process("rank1/SIGTERM@step:9") == "SIGTERM@step:9" and for_this_process("rank0/step:9") is None
    assert for_this_process("save:18:tmp_written") == "save:18:tmp_written"
    from trainers.run.resolve import _given_batch_split

    # --batch-size and --grad-accumulation are per process: both without --effective-batch, times the processes.
    assert _given_batch_split({"batch_size": 8, "grad_accumulation": 2}, 2)["effective_batch"] == 32
    assert _given_batch_split({"batch_size": 8, "grad_accumulation": 2})["effective_batch"] == 16
