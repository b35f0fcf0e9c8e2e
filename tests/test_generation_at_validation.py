"""--sample-interval: samples generated at validation, their gen/* metrics and sets, a gen/* --best-metric;
training ends bit-identical with and without it, and a SIGKILL mid-generation resumes bit-identically."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.demo_runs import assert_equal_nested, family_run, final_state, train, train_here
from trainers.checkpoint import schema
from trainers.config.settings import BEST_METRICS
from trainers.run.sample_sets import list_sets, read_step
from trainers.training.generation_metrics import HIGHER_IS_BETTER, LOWER_IS_BETTER

FLAGS = ["--batch-size", "16", "--val-interval", "3", "--max-val-batches", "1", "--save-interval", "3",
         "--log-interval", "100", "--max-steps", "6"]
SAMPLING = ["--sample-interval", "3"]
SAMPLED = ["--sample-temperature", "1.0", "--sample-top-k", "20"]


def assert_same_weights(a: Path, b: Path) -> None:
    sa, sb = final_state(a), final_state(b)
    assert sa.step == sb.step
    assert_equal_nested(sa.model, sb.model, "model")


@pytest.fixture(scope="module")
def runs(demo_assets, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen")
    out = {"on": root / "on", "off": root / "off", "sampled": root / "sampled"}
    for name, extra in (("on", SAMPLING), ("off", []), ("sampled", [*SAMPLING, *SAMPLED])):
        done = train_here(out[name], *demo_assets, *FLAGS, *extra)
        assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("search", ["on", "sampled"])
def test_training_with_and_without_generation_ends_bit_identical(runs, search: str):
    assert_same_weights(runs[search], runs["off"])
    on, off = final_state(runs[search]).sections["rng"], final_state(runs["off"]).sections["rng"]
    for key in ("torch", "numpy", "python"):  # generating drew nothing from the random state training goes on with
        assert repr(on[key]) == repr(off[key]), key
    assert not (runs["off"] / "samples").exists()


def test_sampled_generation_is_recorded_and_draws_other_codes_than_greedy(runs):
    sampled, greedy = read_step(runs["sampled"], 0), read_step(runs["on"], 0)  # step 0: the same weights
    assert sampled.settings["search"] == "sampled" and greedy.settings["search"] == "greedy"
    assert (sampled.settings["temperature"], sampled.settings["top_k"], sampled.settings["top_p"]) == (1.0, 20, 1.0)
    assert sampled.ids == greedy.ids
    assert [c.tolist() for c in sampled.codes] != [c.tolist() for c in greedy.codes]


def test_a_temperature_without_generation_says_it_has_no_effect(demo_assets, tmp_path):
    done = train_here(tmp_path / "run", *demo_assets, *FLAGS[:-2], "--max-steps", "1", "--sample-temperature", "0.8")
    assert done.returncode == 0, done.stderr
    assert "--sample-temperature 0.8 has no effect: generation at validation is off;" in done.stderr
    assert "pass --sample-interval N to generate samples" in done.stderr


def test_top_k_or_top_p_without_a_temperature_is_refused(demo_assets, tmp_path):
    refused = train_here(tmp_path / "run", *demo_assets, *FLAGS, *SAMPLING, "--sample-top-p", "0.8")
    assert refused.returncode == 2 and "pass --sample-temperature T" in refused.stderr, refused.stderr
    assert not (tmp_path / "run").exists()


def test_each_sampled_validation_has_its_set_and_gen_metrics_in_the_history(runs):
    assert sorted(list_sets(runs["on"])) == [0, 3, 6]
    sets = read_step(runs["on"], 3)
    assert len(sets.ids) == len(sets.codes) >= 1 and sets.settings["search"] == "greedy"
    vals = [h for h in final_state(runs["on"]).history if h["kind"] == "val"]
    assert [h["step"] for h in vals] == [0, 3, 6]
    assert all(h["gen/stop_rate"] == read_step(runs["on"], h["step"]).metrics["gen/stop_rate"] for h in vals)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs["on"] / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("gen/stop_rate")] == [(h["step"], h["gen/stop_rate"])
                                                                           for h in vals]


def test_best_metrics_are_the_directed_generation_metrics():
    assert set(m for m in BEST_METRICS if m.startswith("gen/")) == set(HIGHER_IS_BETTER | LOWER_IS_BETTER)


def test_a_gen_best_metric_keeps_best_pth_by_it_and_needs_sampling(demo_assets, tmp_path):
    refused = train_here(tmp_path / "no", *demo_assets, *FLAGS, "--best-metric", "gen/length_error_median")
    assert refused.returncode == 2 and "pass --sample-interval N too" in refused.stderr
    out = tmp_path / "run"
    done = train_here(out, *demo_assets, *FLAGS, *SAMPLING, "--best-metric", "gen/length_error_median")
    assert done.returncode == 0, done.stderr
    errors = {s: read_step(out, s).metrics["gen/length_error_median"] for s in list_sets(out)}
    best = schema.read(out / "best.pth").best
    assert best["metric"] == "gen/length_error_median" and best["value"] == min(errors.values())


@pytest.fixture(scope="module")
def family_generating(family_assets, request, tmp_path_factory) -> Path:
    """`runs["on"]` (a run generating at validation), for each model family's demo."""
    if family_assets.family == "indextts2":
        return request.getfixturevalue("runs")["on"]
    return family_run(family_assets, request, "runs", tmp_path_factory, *FLAGS, *SAMPLING)


def test_a_sigkill_mid_generation_resumes_bit_identically_and_the_set_is_whole(family_generating, family_assets,
                                                                              tmp_path):
    """Each model family: its generation's prompt is its own prefix and text embeddings."""
    runs, demo_assets = {"on": family_generating}, family_assets
    out = tmp_path / "run"
    killed = train(out, *demo_assets, *FLAGS, *SAMPLING, kill_at="generate:6:0")
    assert killed.returncode != 0 and sorted(list_sets(out)) == [0, 3]  # step 6's set: absent, not partial
    assert not [p for p in (out / "samples").iterdir() if p.name.startswith(".")]
    resumed = train(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_weights(out, runs["on"])
    ours, theirs = read_step(out, 6), read_step(runs["on"], 6)
    assert ours.ids == theirs.ids and all(map(torch.equal, map(torch.from_numpy, ours.codes),
                                              map(torch.from_numpy, theirs.codes)))


def test_a_set_that_cannot_be_written_is_warned_about_and_the_run_saves_its_checkpoints(runs, demo_assets, tmp_path):
    """A directory where step 6's set goes: the final validation's set fails to write (a real OSError in the atomic
    write), after best.pth and before the final checkpoint. The run says which file and why, and trains and saves on."""
    out = tmp_path / "run"
    killed = train(out, *demo_assets, *FLAGS, *SAMPLING, kill_at="step:3")
    assert killed.returncode != 0 and final_state(out).step == 3
    (out / "samples" / "step_00000006.npz").mkdir()
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert "WARNING could not write the sample set of step 6, " + str(out / "samples" / "step_00000006.npz") \
        in resumed.stderr and "Is a directory" in resumed.stderr
    assert os.path.samefile(out / "latest.pth", out / "model_step6.pth")
    assert_same_weights(out, runs["on"])
    assert sorted(list_sets(out)) == [0, 3] and not [p for p in (out / "samples").iterdir() if p.name.startswith(".")]


def test_a_full_disk_under_samples_is_warned_about_and_the_run_saves_its_checkpoints(runs, demo_assets, tmp_path):
    """The same with a real full disk: a 64 KiB tmpfs mounted on samples/ and filled (root only)."""
    out = tmp_path / "run"
    (out / "samples").mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(out / "samples")],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        with open(out / "samples" / "filler", "wb", buffering=0) as f:  # a user's file fills the disk
            try:
                while f.write(b"x" * 4096):
                    pass
            except OSError:
                pass
        done = train_here(out, *demo_assets, *FLAGS, *SAMPLING)
        assert done.returncode == 0, done.stderr
        assert "could not write the sample set of step 0" in done.stderr and "No space left on device" in done.stderr
        assert os.path.samefile(out / "latest.pth", out / "model_step6.pth")
        assert_same_weights(out, runs["on"])
        assert [p.name for p in (out / "samples").iterdir()] == ["filler"]
    finally:
        subprocess.run(["umount", str(out / "samples")], check=True)


def test_a_samples_path_that_is_not_a_directory_is_refused_at_start_up(demo_assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "samples").write_text("my notes\n")
    refused = train_here(out, *demo_assets, *FLAGS, *SAMPLING)
    assert refused.returncode == 2, refused.stderr
    assert f"{out / 'samples'} is not a directory" in refused.stderr and "nothing was trained" in refused.stderr
    assert sorted(p.name for p in out.iterdir() if p.name != ".trainer.lock") == ["samples"]  # nothing else written
    assert (out / "samples").read_text() == "my notes\n"


def test_under_torchrun_both_processes_get_every_code_and_stop_early_alike(demo_assets, tmp_path):
    """Each process generates half the samples and gets the other half's codes, so both compute the same
    metrics and stop early at the same validation (on the demo the generated length moves away from the
    reference's from step 0 to 3: patience 1 stops at 3); rank 0 alone logs and writes."""
    from tests.test_ddp_runs import torchrun

    out = tmp_path / "run"
    done = torchrun(out, *demo_assets, *FLAGS, *SAMPLING, "--best-metric", "gen/length_error_median",
                    "--early-stop-patience", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "early stop at step 3" in done.stderr and final_state(out).step == 3
    assert sorted(list_sets(out)) == [0, 3]
    assert done.stderr.count("generation step 3 stop_rate") == 1  # rank 0's line only
    errors = {s: read_step(out, s).metrics["gen/length_error_median"] for s in list_sets(out)}
    assert errors[3] > errors[0] and schema.read(out / "best.pth").best["value"] == errors[0]


def test_under_torchrun_each_process_generates_its_part_and_the_sampled_set_is_the_single_process_one(
        runs, demo_assets, tmp_path):
    """Rank 1 generates a batch of its own (it reaches the fault point after it, where it is sent SIGTERM: the
    job stops at the next step boundary). Each sample draws from its own generator keyed by the seed, so the
    set does not depend on which process generated which sample, nor on the batch: at step 0 (the same
    weights) the codes equal a single process's."""
    from tests.test_ddp_runs import torchrun

    out = tmp_path / "run"
    done = torchrun(out, *demo_assets, *FLAGS, *SAMPLING, *SAMPLED, kill_at="rank1/SIGTERM@generate:0:0")
    assert "fault injection: rank 1 sends SIGTERM at generate:0:0" in done.stderr, done.stderr[-3000:]
    assert "stopped by signal" in done.stderr and sorted(list_sets(out)) == [0], done.stderr[-3000:]
    ours, theirs = read_step(out, 0), read_step(runs["sampled"], 0)
    assert (ours.ids, ours.stopped, ours.settings, ours.metrics) == (theirs.ids, theirs.stopped, theirs.settings,
                                                                     theirs.metrics)
    assert [c.tolist() for c in ours.codes] == [c.tolist() for c in theirs.codes]


def test_out_of_memory_while_generating_halves_the_batch_and_changes_no_code(runs, demo_assets, tmp_path):
    """An out-of-memory error in the first generation batch (injected at step 0: OOM_AT 0:generate) is
    recovered with half the batch, kept for later validations; the codes do not depend on the batch, so
    every set equals the run without the error, and so do the weights."""
    out = tmp_path / "run"
    done = train_here(out, *demo_assets, *FLAGS, *SAMPLING, "--val-batch-size", "4",
                      env={"INDEXTTS_TRAIN_OOM_AT": "0:generate"})
    assert done.returncode == 0, done.stderr
    assert "out of memory while generating samples at step 0" in done.stderr
    assert "out of memory while generating samples at step 0: batches of 2 from here on" in done.stderr
    assert_same_weights(out, runs["on"])
    assert sorted(list_sets(out)) == sorted(list_sets(runs["on"]))
    for step in list_sets(out):
        ours, theirs = read_step(out, step), read_step(runs["on"], step)
        assert ours.ids == theirs.ids and ours.stopped == theirs.stopped, step
        assert [c.tolist() for c in ours.codes] == [c.tolist() for c in theirs.codes], step
