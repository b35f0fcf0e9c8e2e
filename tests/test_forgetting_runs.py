"""Replay mixing and the forgetting guard in real runs of the trainer (its main(), or a process of its own where a
SIGKILL is needed), on the two-language corpus of benchmarks/forgetting.py: a base model trained on "base", then
fine-tuned on "new" with "base" replayed.

* bad shares exit 2 naming the flag, before anything is written;
* a run with mixing, the guard and per-language validation, SIGKILLed and resumed, ends bit-identical to the
  uninterrupted run with the same sample ids per step; its steps hold the shares;
* the guard's stop, its best.pth choice, a resume that respects the stop and one with a larger limit;
* under torchrun (2 CPU processes) the ids of every step equal one process's;
* LoRA and frozen base rows run with mixing and the guard.

The shares per step and the killed run's exact resume are tested for each model family (`family_assets`): for
IndexTTS-2.5 on its demo split the same way into "en" and "de" (benchmarks/forgetting.py, two_language_corpus25),
whose languages are codes of its own.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.forgetting import BASE25, NEW25, two_language_corpus, two_language_corpus25
import yaml

from tests.demo_runs import DEMO25_CONFIG, REPO, assert_same_training, final_state, train, train_here
from tests.test_ddp_runs import assert_close_metrics, torchrun
from trainers.checkpoint import schema
from trainers.families import FAMILIES
from trainers.model.gpt_model import GPTConfig

DEMO_YAML = REPO / "checkpoints" / "demo.yaml"
STEPS = 15
COMMON = ["--effective-batch", "16", "--data-order", "random", "--max-val-batches", "0", "--log-interval", "3",
          "--keep-checkpoints", "10", "--epochs", "100"]
LANGUAGES = ("base", "new")  # IndexTTS2's: any name
# The validations of the fine-tune (fine_tune_flags) past its limit of 7%, per family: IndexTTS2's base language
# rises 10-15% from step 6 on; IndexTTS-2.5's "en" +3.1%, +5.7%, +7.3%, +5.7%, +3.1% at steps 3 to 15.
PAST_THE_LIMIT = {"indextts2": [6, 9, 12, 15], "indextts25": [9]}


@pytest.fixture(scope="module")
def corpus(demo_assets, tmp_path_factory) -> dict[str, Path]:
    demo = Path(demo_assets[demo_assets.index("--tokenizer") + 1]).parent
    gpt = GPTConfig.from_yaml_section(yaml.safe_load(DEMO_YAML.read_text())["gpt"])
    paths = two_language_corpus(demo, tmp_path_factory.mktemp("two_languages"), gpt)
    return {**paths, "tokenizer": demo / "bpe.model", "tiny_base": Path(demo_assets[-1]), "config": DEMO_YAML}


def train_base(corpus: dict[str, Path], out: Path, steps: int, lr: str, language: str = "base") -> Path:
    """The demo's tiny base trained on the base language alone: the model whose language a fine-tune may forget."""
    done = train_here(out, *COMMON, "--config", str(corpus["config"]), "--tokenizer", str(corpus["tokenizer"]),
                      "--base-checkpoint", str(corpus["tiny_base"]), "--train-manifest",
                      f"{corpus['base_train']}::{language}", "--max-steps", str(steps), "--learning-rate", lr,
                      "--warmup-steps", "4", "--val-interval", "0", "--save-interval", str(steps))
    assert done.returncode == 0, done.stderr
    return out / "latest.pth"


@pytest.fixture(scope="module")
def base_model(corpus, tmp_path_factory) -> Path:
    return train_base(corpus, tmp_path_factory.mktemp("base") / "run", 80, "3e-3")


def fine_tune_flags(corpus: dict[str, Path], base: Path, share: str = "0.125",
                    languages: tuple[str, str] = LANGUAGES) -> list[str]:
    """15 steps on "new" with 2 of every 16 samples from "base", validating both every 3 steps. On the demo the
    base language's mel loss rises 2% by step 3, then 10-15% from step 6 on, while the validation mel loss of
    both together falls below step 3's at step 12 and 15: a limit of 7% judges steps 0 and 3 within, the rest
    past, and best.pth is step 3 only because of the guard. `languages`: the names of "base" and "new"."""
    base_lang, new_lang = languages
    return [*COMMON, "--config", str(corpus["config"]), "--tokenizer", str(corpus["tokenizer"]), "--base-checkpoint",
            str(base), "--train-manifest", f"{corpus['new_train']}::{new_lang}", "--train-manifest",
            f"{corpus['base_train']}::{base_lang}@{share}", "--val-manifest", f"{corpus['base_val']}::{base_lang}",
            "--val-manifest", f"{corpus['new_val']}::{new_lang}", "--max-steps", str(STEPS), "--val-interval", "3",
            "--save-interval", "3", "--learning-rate", "6e-3", "--warmup-steps", "10", "--log-sample-ids",
            "--forgetting-limit", "0.07"]


@pytest.fixture(scope="module")
def fine_tune(family_assets, request) -> tuple[dict[str, Path], Path, tuple[str, str]]:
    """The corpus, the base model and the languages of each model family."""
    if family_assets.family == "indextts2":
        return request.getfixturevalue("corpus"), request.getfixturevalue("base_model"), LANGUAGES
    return request.getfixturevalue("fine_tune25")


@pytest.fixture(scope="module")
def fine_tune25(demo25_assets, tmp_path_factory) -> tuple[dict[str, Path], Path, tuple[str, str]]:
    """The IndexTTS-2.5 demo split into "en" and "de", and a base trained on "en" for 30 steps (its "en" validation
    mel loss rises past 7% at step 9 of the fine-tune)."""
    demo = Path(demo25_assets[demo25_assets.index("--tokenizer") + 1]).parent
    family = FAMILIES["indextts25"]
    gpt = family.read_config(yaml.safe_load(DEMO25_CONFIG.read_text())["gpt"])
    corpus = {**two_language_corpus25(demo, tmp_path_factory.mktemp("two_languages25"), gpt),
              "tokenizer": demo / family.demo_tokenizer_name, "tiny_base": demo / "base_gpt.pth",
              "config": DEMO25_CONFIG}
    return corpus, train_base(corpus, tmp_path_factory.mktemp("base25") / "run", 30, "1e-2", BASE25), (BASE25, NEW25)


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
def family_guarded(fine_tune, family_assets, request, tmp_path_factory) -> tuple[Path, str]:
    """`guarded`, for each model family."""
    if family_assets.family == "indextts2":
        return request.getfixturevalue("guarded")
    corpus, base, languages = fine_tune
    out = tmp_path_factory.mktemp("guarded25") / "run"
    done = train_here(out, *fine_tune_flags(corpus, base, languages=languages), "--batch-size", "8")
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


def test_every_step_holds_its_share_and_the_forgetting_is_measured_per_language(family_guarded, fine_tune,
                                                                                 family_assets):
    out, log = family_guarded
    base, new = fine_tune[2]
    made = step_make_up(out)
    # 192 "new" samples at 14 a step: the epoch's 14th step has 10 of them and round(2 x 10/14) = 1 replayed.
    assert made[:13] == [(16, 2)] * 13 and made[13] == (11, 1) and made[14] == (16, 2)
    vals = validations(out)
    assert sorted(vals) == [0, 3, 6, 9, 12, 15]
    for step, entry in vals.items():
        for lang in (base, new):
            change = entry["forgetting"][lang]
            assert change["base_step"] == 0
            assert change["mel_loss"] == pytest.approx(entry["langs"][lang]["mel_loss"] - vals[0]["langs"][lang]["mel_loss"])
    assert vals[15]["forgetting"][new]["mel_loss_rel"] < -0.1  # the new language is learnt
    assert f"forgetting step 6 {base} [base] vs step 0: text_loss" in log
    past = sorted(step for step, entry in vals.items() if not entry["forgetting_guard"]["within"])
    assert past == PAST_THE_LIMIT[family_assets.family]  # the base language forgotten past the limit, the guard said so
    for step in past:
        assert f"WARNING forgetting at step {step}: {base} mel_loss" in log
        assert f"WARNING step {step} is past --forgetting-limit 0.07 (7.0%) on mel_loss" in log
    assert schema.read(out / "best.pth").step not in past
    state = final_state(out)
    assert state.forgetting["base"][base]["step"] == 0 and state.replayed == {"1": 29}


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


def test_a_killed_run_with_mixing_and_the_guard_resumes_bit_identically(family_guarded, fine_tune, tmp_path):
    reference, _ = family_guarded
    corpus, base_model, languages = fine_tune
    out = tmp_path / "run"
    flags = [*fine_tune_flags(corpus, base_model, languages=languages), "--batch-size", "8"]
    first = train(out, *flags, kill_at="micro:5:0")  # mid accumulation, after the save of step 3
    assert first.returncode != 0 and final_state(out).step == 3
    second = train(out, "--resume", "auto", kill_at="micro:15:1")  # past the epoch boundary (step 14)
    assert second.returncode != 0 and final_state(out).step == 12
    last = train(out, "--resume", "auto")
    assert last.returncode == 0, last.stderr
    assert_same_training(reference, out, STEPS)
    assert final_state(out).forgetting == final_state(reference).forgetting
    assert final_state(out).replayed == final_state(reference).replayed
    assert schema.read(out / "best.pth").step == schema.read(reference / "best.pth").step  # 3 for IndexTTS2


def test_the_guard_stops_the_run_keeping_the_best_within_the_limit(stopped):
    out, log = stopped
    state = final_state(out)
    assert state.step == 6 and sorted(validations(out)) == [0, 3, 6]
    assert schema.read(out / "best.pth").step == 3
    assert "forgetting stop at step 6: past --forgetting-limit 0.07 (7.0%) on mel_loss" in log
    assert "forgetting stop: base mel_loss" in log and "worse than" in log
    assert "best.pth holds step 3, the best mel_loss among the validations within the limit" in log
    assert "the last validation within the limit was step 3" in log


def test_a_kill_at_the_stopping_validation_resumes_to_the_same_stop(stopped, corpus, base_model, tmp_path):
    """The resume gets a SIGTERM as that validation begins: it stops there all the same, saved, with status 143 as a
    signal in any other phase (it was 0)."""
    reference, _ = stopped
    out = tmp_path / "run"
    killed = train(out, *fine_tune_flags(corpus, base_model), "--forgetting-stop", kill_at="validation:6")
    assert killed.returncode != 0 and final_state(out).step == 3
    resumed = train(out, "--resume", "auto", kill_at="SIGTERM@validation:6")
    assert resumed.returncode == 143, resumed.stderr
    assert "forgetting stop at step 6" in resumed.stderr
    assert_same_training(reference, out, 6)
    assert schema.read(out / "best.pth").step == 3


def test_a_resume_respects_the_stop_and_a_larger_limit_trains_on(stopped, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped[0], out)
    before = (out / "latest.pth").read_bytes()
    again = train_here(out, "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "nothing to do: the run stopped at step 6, past --forgetting-limit 0.07" in again.stderr
    assert "forgetting stop: base mel_loss" in again.stderr
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
    assert "forgetting stop at step 6: past --forgetting-limit" in done.stderr
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


def test_lora_with_a_new_languages_rows_runs_with_mixing_and_the_guard_on_indextts25(fine_tune25, tmp_path):
    """IndexTTS-2.5's way to add a language: its rows (--new-language) and LoRA adapters, with "en" replayed."""
    corpus, base, (en, de) = fine_tune25
    out = tmp_path / "run"
    done = train_here(out, *fine_tune_flags(corpus, base, languages=(en, de)), "--max-steps", "6", "--forgetting-stop",
                      "--lora-rank", "4", "--new-language", de)
    assert done.returncode == 0, done.stderr
    assert f"--new-language {de}: rows lang_embedding.weight[2]" in done.stderr
    assert step_make_up(out)[:6] == [(16, 2)] * 6
    assert {en, de} == set(validations(out)[3]["forgetting"])
    assert final_state(out).forgetting["base"][en]["step"] == 0


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
