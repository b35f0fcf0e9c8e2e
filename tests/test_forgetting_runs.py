"""Replay mixing and the forgetting guard in real runs of the trainer (its main(), or a process of its own where a
SIGKILL is needed), on the two-language corpus of benchmarks/forgetting.py: a base model trained on "base", then
fine-tuned on "new" with "base" replayed.

* bad shares exit 2 naming the flag, before anything is written;
* a run with mixing, the guard and per-language validation, SIGKILLed and resumed, ends bit-identical to the
  uninterrupted run with the same sample ids per step; its steps hold the shares;
* the guard's stop, its best.pth choice, a resume that respects the stop and one with a larger limit;
* under torchrun (2 CPU processes) the ids of every step equal one process's;
* LoRA and frozen base rows run with mixing and the guard.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.forgetting import two_language_corpus
import yaml

from tests.demo_runs import REPO, assert_same_training, final_state, train, train_here
from tests.test_ddp_runs import assert_close_metrics, torchrun
from trainers.checkpoint import schema
from trainers.model.gpt_model import GPTConfig

DEMO_YAML = REPO / "checkpoints" / "demo.yaml"
STEPS = 15
COMMON = ["--config", str(DEMO_YAML), "--effective-batch", "16", "--data-order", "random", "--max-val-batches", "0",
          "--log-interval", "3", "--keep-checkpoints", "10", "--epochs", "100"]


@pytest.fixture(scope="module")
def corpus(demo_assets, tmp_path_factory) -> dict[str, Path]:
    demo = Path(demo_assets[demo_assets.index("--tokenizer") + 1]).parent
    gpt = GPTConfig.from_yaml_section(yaml.safe_load(DEMO_YAML.read_text())["gpt"])
    paths = two_language_corpus(demo, tmp_path_factory.mktemp("two_languages"), gpt)
    return {**paths, "tokenizer": demo / "bpe.model", "tiny_base": Path(demo_assets[-1])}


@pytest.fixture(scope="module")
def base_model(corpus, tmp_path_factory) -> Path:
    """The demo's tiny base trained on "base" alone: the model whose language a fine-tune may forget."""
    out = tmp_path_factory.mktemp("base") / "run"
    done = train_here(out, *COMMON, "--tokenizer", str(corpus["tokenizer"]), "--base-checkpoint",
                      str(corpus["tiny_base"]), "--train-manifest", f"{corpus['base_train']}::base",
                      "--max-steps", "80", "--learning-rate", "3e-3", "--warmup-steps", "4", "--val-interval", "0",
                      "--save-interval", "80")
    assert done.returncode == 0, done.stderr
    return out / "latest.pth"


def fine_tune_flags(corpus: dict[str, Path], base: Path, share: str = "0.125") -> list[str]:
    """15 steps on "new" with 2 of every 16 samples from "base", validating both every 3 steps. On the demo the
    base language's mel loss rises 2% by step 3, then 10-15% from step 6 on, while the validation mel loss of
    both together falls below step 3's at step 12 and 15: a limit of 7% judges steps 0 and 3 within, the rest
    past, and best.pth is step 3 only because of the guard."""
    return [*COMMON, "--tokenizer", str(corpus["tokenizer"]), "--base-checkpoint", str(base),
            "--train-manifest", f"{corpus['new_train']}::new", "--train-manifest", f"{corpus['base_train']}::base@{share}",
            "--val-manifest", f"{corpus['base_val']}::base", "--val-manifest", f"{corpus['new_val']}::new",
            "--max-steps", str(STEPS), "--val-interval", "3", "--save-interval", "3", "--learning-rate", "6e-3",
            "--warmup-steps", "10", "--log-sample-ids", "--forgetting-limit", "0.07"]


def validations(run: Path) -> dict[int, dict]:
    return {h["step"]: h for h in final_state(run).history if h["kind"] == "val"}


def step_make_up(run: Path) -> list[tuple[int, int]]:
    """(samples, of them from the base language) of every step in sample_ids.tsv."""
    rows = [line.split("\t")[2].split(",") for line in (run / "sample_ids.tsv").read_text().splitlines()]
    return [(len(ids), sum(not i.startswith("new_") for i in ids)) for ids in rows]


@pytest.fixture(scope="module")
def guarded(corpus, base_model, tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted fine-tune with replay and the guard (no stop), 15 steps."""
    out = tmp_path_factory.mktemp("guarded") / "run"
    done = train_here(out, *fine_tune_flags(corpus, base_model), "--batch-size", "8")
    assert done.returncode == 0, done.stderr
    return out, done.stderr


@pytest.fixture(scope="module")
def stopped(corpus, base_model, tmp_path_factory) -> tuple[Path, str]:
    """The same fine-tune with --forgetting-stop."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    done = train_here(out, *fine_tune_flags(corpus, base_model), "--forgetting-stop")
    assert done.returncode == 0, done.stderr
    return out, done.stderr


@pytest.mark.parametrize("replays, expected", [
    (["base_train::base@-0.1"], "the share -0.1 must be > 0 and < 1"),
    (["base_train::base@1.5"], "the share 1.5 must be > 0 and < 1"),
    (["base_train::base@0.4", "new_val::new@0.6"], "the shares sum to 1, leaving no room for the target manifest(s)"),
    (["base_train::base@0.999"], "the shares take 16 of the 16 samples of each step, leaving none for the target"),
    (["base_small::base@0.5"], "its share is 8 samples of each step of 16, but the manifest holds 5; lower the share "
                               "to at most 0.28"),
    (["base_train::zh@0.125"], "replays language zh, which the validation does not measure (its languages among the "
                               "48 samples validated: base, new)"),
    (["base_train::base@0.001"], "rounds to 0 per step"),
])
def test_bad_shares_exit_2_naming_the_flag_before_anything_is_written(corpus, base_model, tmp_path, replays, expected):
    small = tmp_path / "base_small.jsonl"
    small.write_text("".join(corpus["base_train"].read_text().splitlines(keepends=True)[:5]))
    paths = {**corpus, "base_small": small}
    flags = fine_tune_flags(corpus, base_model)
    at = next(i for i, f in enumerate(flags) if "@" in f)
    del flags[at - 1: at + 1]  # the replay manifest and its flag
    for replay in replays:
        name, _, rest = replay.partition("::")
        flags += ["--train-manifest", f"{paths[name]}::{rest}"]
    out = tmp_path / "run"
    refused = train_here(out, *flags)
    assert refused.returncode == 2, refused.stderr
    assert "--train-manifest" in refused.stderr and expected in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not out.exists()


def test_a_guard_without_base_languages_and_an_unvalidated_base_language_exit_2(corpus, base_model, tmp_path):
    flags = fine_tune_flags(corpus, base_model)
    at = next(i for i, f in enumerate(flags) if "@" in f)
    del flags[at - 1: at + 1]  # no replay manifest
    alone = train_here(tmp_path / "a", *flags)
    assert alone.returncode == 2 and "--forgetting-limit 0.07 watches the base languages, and none is named" in \
        alone.stderr
    unknown = train_here(tmp_path / "b", *flags, "--base-language", "zh")
    assert unknown.returncode == 2 and "the validation does not measure zh" in unknown.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_every_step_holds_its_share_and_the_forgetting_is_measured_per_language(guarded):
    out, log = guarded
    made = step_make_up(out)
    # 192 "new" samples at 14 a step: the epoch's 14th step has 10 of them and round(2 x 10/14) = 1 replayed.
    assert made[:13] == [(16, 2)] * 13 and made[13] == (11, 1) and made[14] == (16, 2)
    vals = validations(out)
    assert sorted(vals) == [0, 3, 6, 9, 12, 15]
    for step, entry in vals.items():
        for lang in ("base", "new"):
            change = entry["forgetting"][lang]
            assert change["base_step"] == 0
            assert change["mel_loss"] == pytest.approx(entry["langs"][lang]["mel_loss"] - vals[0]["langs"][lang]["mel_loss"])
    assert vals[15]["forgetting"]["new"]["mel_loss_rel"] < -0.1  # the new language is learnt
    assert "forgetting step 6 language base [base] vs step 0: text_loss" in log
    assert "WARNING forgetting past --forgetting-limit 0.07 on mel_loss of base at step 6: language base mel_loss" in log
    state = final_state(out)
    assert state.forgetting["base"]["base"]["step"] == 0 and state.replayed == {"1": 29}


def test_a_change_of_the_shares_on_resume_is_a_change_of_the_data(guarded, corpus, base_model, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(guarded[0], out)
    before = (out / "latest.pth").read_bytes()
    flags = [f.replace("@0.125", "@0.25") for f in fine_tune_flags(corpus, base_model)]
    refused = train_here(out, "--resume", "auto", *flags, "--max-steps", "16")
    assert refused.returncode == 2, refused.stderr
    assert "data_shares: saved '1::base@1/8', now '1::base@1/4' (changes the result)" in refused.stderr
    assert "the replay shares (--train-manifest F::LANG@SHARE) decide which samples make each step" in refused.stderr
    assert (out / "latest.pth").read_bytes() == before
    allowed = train_here(out, "--resume", "auto", *flags, "--max-steps", "16", "--lr-decay-steps", "16",
                         "--allow-config-change")
    assert allowed.returncode == 0, allowed.stderr
    assert "target samples per step (the effective batch less the replay shares) changed from 14 to 12" in \
        allowed.stderr
    assert step_make_up(out)[15] == (16, 4)


def test_best_pth_is_only_taken_from_validations_within_the_limit(guarded):
    out, _ = guarded
    vals = validations(out)
    within = [s for s, e in vals.items() if e["forgetting_guard"]["within"]]
    assert within == [0, 3]
    overall_best = min(vals, key=lambda s: vals[s]["mel_loss"])
    assert overall_best not in within  # without the guard best.pth would be a step past the limit
    assert schema.read(out / "best.pth").step == min(within, key=lambda s: vals[s]["mel_loss"]) == 3


def test_a_killed_run_with_mixing_and_the_guard_resumes_bit_identically(guarded, corpus, base_model, tmp_path):
    reference, _ = guarded
    out = tmp_path / "run"
    flags = [*fine_tune_flags(corpus, base_model), "--batch-size", "8"]
    first = train(out, *flags, kill_at="micro:5:0")  # mid accumulation, after the save of step 3
    assert first.returncode != 0 and final_state(out).step == 3
    second = train(out, "--resume", "auto", kill_at="micro:15:1")  # past the epoch boundary (step 14)
    assert second.returncode != 0 and final_state(out).step == 12
    last = train(out, "--resume", "auto")
    assert last.returncode == 0, last.stderr
    assert_same_training(reference, out, STEPS)
    assert final_state(out).forgetting == final_state(reference).forgetting
    assert schema.read(out / "best.pth").step == 3


def test_the_guard_stops_the_run_keeping_the_best_within_the_limit(stopped):
    out, log = stopped
    state = final_state(out)
    assert state.step == 6 and sorted(validations(out)) == [0, 3, 6]
    assert schema.read(out / "best.pth").step == 3
    assert ("forgetting stop at step 6: language base mel_loss" in log and "best.pth holds step 3, the best mel_loss "
            "among the validations within the limit; the last validation within it was step 3" in log)


def test_a_kill_at_the_stopping_validation_resumes_to_the_same_stop(stopped, corpus, base_model, tmp_path):
    reference, _ = stopped
    out = tmp_path / "run"
    killed = train(out, *fine_tune_flags(corpus, base_model), "--forgetting-stop", kill_at="validation:6")
    assert killed.returncode != 0 and final_state(out).step == 3
    resumed = train(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert_same_training(reference, out, 6)
    assert schema.read(out / "best.pth").step == 3


def test_a_resume_respects_the_stop_and_a_larger_limit_trains_on(stopped, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped[0], out)
    before = (out / "latest.pth").read_bytes()
    again = train_here(out, "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "nothing to do: the run stopped at step 6: its last validation (step 6) is past --forgetting-limit" in \
        again.stderr
    assert (out / "latest.pth").read_bytes() == before
    larger = train_here(out, "--resume", "auto", "--forgetting-limit", "0.3")
    assert larger.returncode == 0, larger.stderr
    vals = validations(out)
    assert final_state(out).step == STEPS and all(vals[s]["forgetting_guard"]["within"] for s in (9, 12, 15))
    assert vals[6]["forgetting_guard"]["within"] is False  # judged with the limit of its time
    assert schema.read(out / "best.pth").step == min(vals, key=lambda s: vals[s]["mel_loss"]) == 15


def test_two_processes_take_the_steps_and_shares_of_one(guarded, corpus, base_model, tmp_path):
    reference, _ = guarded
    out = tmp_path / "run"
    done = torchrun(out, *fine_tune_flags(corpus, base_model), "--batch-size", "8")
    assert done.returncode == 0, done.stderr
    assert (out / "sample_ids.tsv").read_text() == (reference / "sample_ids.tsv").read_text()
    assert final_state(out).replayed == final_state(reference).replayed
    # The same steps: the logged losses agree to float rounding (the weights too, but Adam magnifies the rounding
    # of rarely updated text_embedding rows to 2e-4 at this learning rate, beyond assert_close_weights' bound).
    train_entries = [[h for h in final_state(run).history if h["kind"] == "train"] for run in (reference, out)]
    assert_close_metrics(*train_entries, ("text_loss", "mel_loss", "mel_top1", "grad_norm"), rel=1e-5)


def test_two_processes_stop_at_the_guard_together(stopped, corpus, base_model, tmp_path):
    out = tmp_path / "run"
    done = torchrun(out, *fine_tune_flags(corpus, base_model), "--forgetting-stop", "--batch-size", "8")
    assert done.returncode == 0, done.stderr
    assert "forgetting stop at step 6: language base mel_loss" in done.stderr
    assert (out / "sample_ids.tsv").read_text() == (stopped[0] / "sample_ids.tsv").read_text()
    assert final_state(out).step == 6 and schema.read(out / "best.pth").step == 3


@pytest.mark.parametrize("variant", [["--lora-rank", "4"], ["--freeze-base-vocab"], ["--sample-interval", "3"]])
def test_lora_frozen_base_rows_and_generation_run_with_mixing_and_the_guard(corpus, base_model, tmp_path, variant):
    out = tmp_path / "run"
    done = train_here(out, *fine_tune_flags(corpus, base_model), "--max-steps", "6", "--forgetting-stop", *variant)
    assert done.returncode == 0, done.stderr
    assert step_make_up(out)[:6] == [(16, 2)] * 6
    changes = validations(out)[3]["forgetting"]
    assert {"base", "new"} == set(changes)
    if "--sample-interval" in variant:  # the generation metrics of each language are measured too
        assert {"gen/stop_rate", "gen/stop_rate_rel", "gen/length_error_median"} <= set(changes["base"])


def test_the_experiment_api_and_the_plot_show_the_forgetting_per_language(guarded):
    out, _ = guarded
    from trainers.experiment import ExperimentManager

    exp = ExperimentManager.load(out)
    vals = validations(out)
    assert exp.forgetting["base"]["base"]["mel_loss"] == vals[0]["langs"]["base"]["mel_loss"]
    assert [v["step"] for v in exp.forgetting["val"]] == sorted(vals)
    assert exp.forgetting["val"][2]["langs"]["base"]["mel_loss_rel"] > 0.07
    assert exp.forgetting["val"][2]["guard"]["within"] is False

    pytest.importorskip("matplotlib")
    from trainers.tools.plot_runs import build_figure, label_runs, load_run

    run = load_run(out)
    label_runs([run])
    panels = {ax.get_title(): ax for ax in build_figure([run]).axes if ax.get_visible()}
    base = panels["forgetting: base (validation mel loss vs base, %)"]
    assert "forgetting: new (validation mel loss vs base, %)" in panels
    curve, = [line for line in base.lines if line.get_gid() == f"forgetting:{run.label}"]
    assert list(curve.get_xdata()) == sorted(vals)
    assert list(curve.get_ydata()) == pytest.approx([100 * vals[s]["forgetting"]["base"]["mel_loss_rel"]
                                                     for s in sorted(vals)])
    limit, = [line for line in base.lines if line.get_gid() == f"limit:{run.label}"]
    assert list(limit.get_ydata()) == pytest.approx([7.0, 7.0])
