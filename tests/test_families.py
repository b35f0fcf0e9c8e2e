"""The model-family seam (trainers/families): a family with other inputs, another prefix and other keys trains
through the trainer's own loop, validation, probe and generation, and resumes exactly, with nothing outside its
definition (tests/toy_family.py, shaped like IndexTTS-2.5) naming its inputs; a run's family is saved and a
checkpoint of one family is refused with a config of another; IndexTTS2 (2.0) runs write what they always did.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.demo_runs import V1_RUN, assert_equal_nested, final_state, logged_metrics, small_corpus_flags, train_here
from tests.toy_family import LANGUAGES, SPEAKER_DIM, ToyGPT, registered, toy_corpus
from trainers.checkpoint import schema
from trainers.faults import OomInjector
from trainers.families import FAMILIES, family_for_config
from trainers.hardware.batch_probe import largest_fitting, model_fits
from trainers.model.generation import generate_codes
from trainers.model.gpt_model import GPTConfig

FLAGS = ["--effective-batch", "4", "--batch-size", "2", "--max-steps", "8", "--save-interval", "2", "--val-interval",
         "4", "--dropout", "0.1", "--learning-rate", "3e-3", "--warmup-steps", "2", "--log-sample-ids",
         "--sample-interval", "4", "--max-val-batches", "2"]
TOY_GPT = GPTConfig(model_dim=16, layers=2, heads=2, max_text_tokens=12, max_mel_tokens=16, number_text_tokens=20,
                    number_mel_codes=30, start_mel_token=28, stop_mel_token=29, dropout=0.1)


def toy_inputs(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"speaker": torch.randn(n, SPEAKER_DIM, generator=g), "emo_vec": torch.randn(n, TOY_GPT.model_dim, generator=g),
            "lang_id": torch.arange(n) % (len(LANGUAGES) + 1)}


def files_of(run: Path) -> dict[str, float]:
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*")}


def test_a_family_with_other_inputs_trains_and_resumes_exactly(tmp_path):
    with registered():
        flags = toy_corpus(V1_RUN / "data", tmp_path / "data")
        straight, stopped = tmp_path / "straight", tmp_path / "stopped"
        done = train_here(straight, *flags, *FLAGS)
        assert done.returncode == 0, done.stderr
        first = train_here(stopped, *flags, *FLAGS, kill_at="SIGTERM@micro:5:1")
        assert first.returncode == 143, first.stderr
        again = train_here(stopped, "--resume", "auto", *flags)
        assert again.returncode == 0, again.stderr

    a, b = final_state(straight), final_state(stopped)
    assert a.step == b.step == 8 and a.model_family == "toy"
    assert json.loads((straight / "run_config.json").read_text())["model_family"] == "toy"
    assert {"speaker_proj.weight", "lang_embedding.weight", "emovec_layer.weight"} <= a.model.keys()
    assert "speed_emb.weight" not in a.model and "inference_model.lm_head.weight" not in a.model
    for name in ("model", "optim", "data"):  # not rng: each run starts from this process's global state
        assert_equal_nested(a.section(name), b.section(name), name)
    assert logged_metrics(a.history) == logged_metrics(b.history)
    validations = [e for e in a.history if e["kind"] == "val"]
    assert [e["step"] for e in validations] == [0, 4, 8]
    assert all(set(e["langs"]) == {"en", "zh"} and "gen/zh/stop_rate" in e for e in validations)
    for path in sorted((straight / "samples").glob("step_*.npz")):
        with np.load(path) as x, np.load(stopped / "samples" / path.name) as y:
            assert all(np.array_equal(x[k], y[k]) for k in x.files), path.name


def test_the_probe_and_generation_take_the_familys_inputs_by_name():
    torch.manual_seed(0)
    model = ToyGPT(TOY_GPT).eval()
    fits = model_fits(model, torch.device("cpu"), None, longest_text=8, longest_codes=10, oom=OomInjector(above=3))
    assert largest_fitting(fits, 8) == 3  # the passes ran on the toy inputs up to the injected limit
    inputs = toy_inputs(3)
    text_ids, text_lens = torch.randint(2, 20, (3, 6)), torch.tensor([6, 2, 4])
    together = generate_codes(model, text_ids, text_lens, 8, **inputs)
    for i in range(3):
        alone = generate_codes(model, text_ids[i:i + 1], text_lens[i:i + 1], 8,
                               **{k: v[i:i + 1] for k, v in inputs.items()})
        assert torch.equal(alone.codes[0], together.codes[i])
    assert [c.tolist() for c in generate_codes(model, text_ids, text_lens, 8, kv_cache=False, **inputs).codes] == \
        [c.tolist() for c in together.codes]
    with pytest.raises(TypeError, match="speaker, emo_vec, lang_id"):
        generate_codes(model, text_ids, text_lens, 8, condition=torch.zeros(3, 32, 16), emo_vec=inputs["emo_vec"])
    with pytest.raises(ValueError, match=r"speaker must be \[3, 8\]"):
        generate_codes(model, text_ids, text_lens, 8, **{**inputs, "speaker": torch.zeros(3, 5)})


def test_the_language_embedding_reaches_every_text_position_and_the_prefix_is_three_positions():
    torch.manual_seed(0)
    model = ToyGPT(TOY_GPT).eval()
    inputs = toy_inputs(2)
    text_ids, lens = torch.randint(2, 20, (2, 5)), torch.tensor([5, 5])
    codes, code_lens = torch.randint(0, 28, (2, 4)), torch.tensor([4, 4])
    with torch.no_grad():
        text_logits, mel_logits = model(**inputs, text_ids=text_ids, text_lens=lens, codes=codes, code_lens=code_lens)
        other = model(**{**inputs, "lang_id": inputs["lang_id"] + 1}, text_ids=text_ids, text_lens=lens, codes=codes,
                      code_lens=code_lens)
    assert text_logits.shape == (2, 7, 21) and mel_logits.shape == (2, 6, 30)
    assert all((text_logits[:, j] != other[0][:, j]).any() for j in range(7))  # start and stop included


def test_a_checkpoint_of_one_family_is_refused_with_a_config_of_another(tmp_path):
    with registered():
        toy_flags = toy_corpus(V1_RUN / "data", tmp_path / "data")
        toy_run, v2_run = tmp_path / "toy_run", tmp_path / "v2_run"
        two_steps = [*FLAGS, "--max-steps", "2", "--sample-interval", "0"]
        assert train_here(toy_run, *toy_flags, *two_steps).returncode == 0
        assert train_here(v2_run, *small_corpus_flags(tmp_path / "v2_data"), *two_steps).returncode == 0
        for run, config in ((toy_run, tmp_path / "data" / "tiny.yaml"), (v2_run, tmp_path / "data" / "toy.yaml")):
            before = files_of(run)
            refused = train_here(run, "--resume", "auto", "--config", str(config), "--max-steps", "4",
                                 "--allow-config-change")
            assert refused.returncode == 2, refused.stderr
            assert "Traceback" not in refused.stderr
            assert "IndexTTS2 (2.0)" in refused.stderr and "the toy model" in refused.stderr
            assert files_of(run) == before


def test_an_indextts2_run_saves_no_family_and_a_checkpoint_naming_none_is_indextts2(tmp_path):
    """A 2.0 checkpoint is as it was before families: no run.model_family, in the checkpoint or run_config.json."""
    run = tmp_path / "run"
    done = train_here(run, *small_corpus_flags(tmp_path / "data"), *FLAGS, "--max-steps", "2", "--sample-interval", "0")
    assert done.returncode == 0, done.stderr
    state = final_state(run)
    assert "model_family" not in state.sections["run"] and state.model_family == "indextts2"
    assert "model_family" not in json.loads((run / "run_config.json").read_text())
    assert schema.read(V1_RUN / "model_step4.pth").model_family == "indextts2"
    assert next(iter(FAMILIES)) == schema.FIRST_FAMILY
    assert family_for_config({"gpt": {}, "version": 2.0}) is FAMILIES["indextts2"]
    assert family_for_config({"gpt": {}}) is FAMILIES["indextts2"]  # what no later family claims
    assert family_for_config({"gpt": {}, "version": 2.5}) is FAMILIES["indextts25"]
