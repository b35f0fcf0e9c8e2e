"""Training with an extended tokenizer: frozen base rows, tokenizer checks, weights-only starts.

The demo tokenizer (160 pieces) is extended with Ethiopic pieces by tools/tokenizer/extend_bpe.py,
and a copy of the demo manifest uses some of the new ids, so the new rows get real gradients.
"""
from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

from tests.demo_runs import final_state, train, train_here
from trainers.model.weights import TEXT_ROW_KEYS, read_state_dict
from trainers.tools.inspect_checkpoint import main as inspect_main
from trainers.tools.tokenizer.extend_bpe import main as extend_main

BASE_TOKENS = 160
EXTENDED = 200
FLAGS = ["--batch-size", "8", "--grad-accumulation", "2", "--weight-decay", "0.1", "--save-interval", "6",
         "--val-interval", "0", "--max-val-batches", "1", "--keep-checkpoints", "1", "--log-interval", "100"]


def _ethiopic_corpus(path: Path, seed: int) -> Path:
    rng = random.Random(seed)
    syllables = [chr(c) for c in range(0x1200, 0x1218)]  # 24 characters: room for 16 longer pieces
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(60)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(400)]
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in lines), encoding="utf-8")
    return path


def _extend(base: Path, out: Path, seed: int) -> Path:
    corpus = _ethiopic_corpus(out.with_suffix(".jsonl"), seed)
    assert extend_main(["--base-model", str(base), "--manifests", str(corpus), "--output-model", str(out),
                        "--target-size", str(EXTENDED)]) == 0
    return out


def _manifest_with_new_ids(root: Path) -> Path:
    """The demo training manifest with every 4th text id moved to a new piece (ids 160..199)."""
    (root / "features_ext").mkdir()
    lines = []
    for line in (root / "train.jsonl").read_text().splitlines():
        item = json.loads(line)
        ids = np.load(root / item["target_text_ids_path"])
        ids = np.where(ids % 4 == 0, BASE_TOKENS + ids % (EXTENDED - BASE_TOKENS), ids)
        item["target_text_ids_path"] = item["target_text_ids_path"].replace("features/", "features_ext/")
        np.save(root / item["target_text_ids_path"], ids)
        lines.append(json.dumps(item))
    path = root / "train_ext.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# Once per session, as the demo corpus it adds files to: a module fixture is built again when xdist's worksteal
# or the order of the tests brings a worker back to this module, and the files it adds would exist already.
@pytest.fixture(scope="session")
def data(demo_assets: list[str]) -> dict[str, object]:
    flags = demo_assets
    value = {flags[i]: flags[i + 1] for i in range(1, len(flags), 2)}
    root = Path(value["--tokenizer"]).parent  # the session's demo corpus; only new files are added
    tokenizer = _extend(Path(value["--tokenizer"]), root / "bpe_ext.model", seed=1)
    other = _extend(Path(value["--tokenizer"]), root / "bpe_other.model", seed=2)
    spm.SentencePieceTrainer.train(input=str(root / "bpe_other.jsonl"), model_prefix=str(root / "unrelated"),
                                   vocab_size=EXTENDED, model_type="bpe", minloglevel=2)
    return {
        "base_run": flags,
        "extended_run": ["--demo", "--train-manifest", str(_manifest_with_new_ids(root)), "--val-manifest",
                         value["--val-manifest"], "--tokenizer", str(tokenizer), "--base-checkpoint",
                         value["--base-checkpoint"]],
        "base_checkpoint": Path(value["--base-checkpoint"]),
        "other_tokenizer": other,
        "unrelated_tokenizer": root / "unrelated.model",
        "extended_tokenizer": tokenizer,
    }


def _base_rows(t: torch.Tensor, base_tokens: int) -> torch.Tensor:
    return torch.cat([t[:base_tokens], t[-1:]])  # the base ids and the extra row, moved to the end


def _inspect(capsys, *argv: str) -> str:
    assert inspect_main(list(argv)) == 0
    return capsys.readouterr().out


def test_base_rows_stay_bit_identical_through_decay_and_a_kill(data, tmp_path, capsys):
    out = tmp_path / "run"
    killed = train(out, *data["extended_run"], *FLAGS, "--max-steps", "24", kill_at="step:10")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "the 161 base rows of text_embedding and text_head are frozen" in killed.stderr
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    state = final_state(out)
    assert state.step == 24 and state.settings["freeze_base_vocab"] is True
    assert (state.text_tokens, state.base_text_tokens) == (EXTENDED, BASE_TOKENS)
    base = read_state_dict(data["base_checkpoint"])
    for key in TEXT_ROW_KEYS:
        rows = state.model[key]
        assert rows.shape[0] == EXTENDED + 1
        assert torch.equal(_base_rows(rows, BASE_TOKENS), base[key]), f"{key}: base rows moved"
        initial = base[key][:BASE_TOKENS].mean(dim=0)  # where the new rows started
        assert all(not torch.equal(rows[i], initial) for i in range(BASE_TOKENS, EXTENDED)), f"{key}: a new row is untrained"
    report = _inspect(capsys, str(out / "latest.pth"), "--base", str(data["base_checkpoint"]))
    assert "base rows: unchanged" in report


def test_a_lora_run_trains_the_new_rows_beside_the_adapters_and_holds_the_base_rows(data, tmp_path):
    """LoRA with an extended tokenizer: the checkpoint holds the adapters and the whole text rows (no other base
    tensor); after a kill and a resume the base rows are still the base's, the new rows have trained."""
    out = tmp_path / "run"
    killed = train(out, *data["extended_run"], *FLAGS, "--lora-rank", "4", "--max-steps", "8", kill_at="step:7")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "text_embedding and text_head train (their base rows held exact)" in killed.stderr
    assert train_here(out, "--resume", "auto").returncode == 0
    state = final_state(out)
    assert state.step == 8 and state.lora is not None
    assert {k for k in state.model if not k.endswith((".lora_a", ".lora_b"))} == set(TEXT_ROW_KEYS)
    base = read_state_dict(data["base_checkpoint"])
    for key in TEXT_ROW_KEYS:
        rows = state.model[key]
        assert torch.equal(_base_rows(rows, BASE_TOKENS), base[key]), f"{key}: base rows moved"
        initial = base[key][:BASE_TOKENS].mean(dim=0)
        assert all(not torch.equal(rows[i], initial) for i in range(BASE_TOKENS, EXTENDED)), f"{key}: a new row is untrained"


@pytest.fixture(scope="module")
def unfrozen_run(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("unfrozen") / "run"
    result = train_here(out, *data["extended_run"], *FLAGS, "--max-steps", "6", "--no-freeze-base-vocab")
    assert result.returncode == 0, result.stderr
    return out


def test_without_freezing_the_base_rows_drift_and_inspect_says_so(data, unfrozen_run, capsys):
    out = unfrozen_run
    state = final_state(out)
    assert state.settings["freeze_base_vocab"] is False
    base = read_state_dict(data["base_checkpoint"])
    assert not torch.equal(_base_rows(state.model["text_embedding.weight"], BASE_TOKENS),
                           base["text_embedding.weight"])
    report = _inspect(capsys, str(out / "latest.pth"), "--base", str(data["base_checkpoint"]))
    assert "base rows: trained (freezing off;" in report and "train with --freeze-base-vocab" in report


def test_resume_with_another_tokenizer_is_refused(data, unfrozen_run):
    refused = train_here(unfrozen_run, "--resume", "auto", "--tokenizer", str(data["other_tokenizer"]))
    assert refused.returncode == 2
    assert "the tokenizer file differs from the one this run was trained with" in refused.stderr
    assert final_state(unfrozen_run).step == 6  # refusals change nothing


def test_checkpoint_of_another_vocabulary_size_starts_a_new_run_from_its_weights(data, tmp_path):
    old = tmp_path / "old"
    assert train_here(old, *data["base_run"], *FLAGS, "--max-steps", "6").returncode == 0
    ext = data["extended_run"]
    new_flags = ["--tokenizer", str(data["extended_tokenizer"]), "--train-manifest", ext[ext.index("--train-manifest") + 1]]
    # Continuing in the old run's directory would replace its checkpoints: refused.
    refused = train_here(old, "--resume", "auto", *new_flags)
    assert refused.returncode == 2 and "Pass a new --output-dir" in refused.stderr
    # A tokenizer that is not an extension of the run's one: refused.
    x = tmp_path / "x"
    refused = train_here(x, "--resume", str(old / "latest.pth"), "--tokenizer", str(data["unrelated_tokenizer"]))
    assert refused.returncode == 2 and "is not an extension of" in refused.stderr

    new = tmp_path / "new"
    started = train_here(new, "--resume", str(old / "latest.pth"), *new_flags, "--max-steps", "4")
    assert started.returncode == 0, started.stderr
    assert "starting a NEW run at step 0 from its model weights only" in started.stderr
    state, previous = final_state(new), final_state(old)
    assert state.step == 4 and state.epoch == 0 and state.step_in_epoch == 4  # counted from 0
    assert state.settings["lr_decay_steps"] == 4  # the schedule is planned for the new run
    assert all(int(s["step"]) == 4 for s in state.optimizer["state"].values())  # fresh AdamW, not 6 + 4
    assert (state.text_tokens, state.base_text_tokens) == (EXTENDED, BASE_TOKENS)
    for key in TEXT_ROW_KEYS:  # the old run's rows are this run's frozen base
        assert torch.equal(_base_rows(state.model[key], BASE_TOKENS), previous.model[key])
    assert (old / "model_step6.pth").exists()  # the old run is untouched


def test_a_lora_branch_of_a_full_run_with_an_extended_tokenizer_trains_the_new_rows(data, tmp_path):
    """A full run's checkpoint branched as LoRA with a longer tokenizer: the checkpoint's rows are the frozen base
    rows, the new rows train beside the adapters; a tokenizer that does not extend the run's is refused."""
    old = tmp_path / "old"
    assert train_here(old, *data["base_run"], *FLAGS, "--max-steps", "2").returncode == 0
    refused = train_here(tmp_path / "x", "--resume", str(old / "latest.pth"), "--lora-rank", "4", "--tokenizer",
                         str(data["unrelated_tokenizer"]))
    assert refused.returncode == 2 and "is not an extension of" in refused.stderr
    ext = data["extended_run"]
    new = tmp_path / "new"
    started = train_here(new, "--resume", str(old / "latest.pth"), "--lora-rank", "4", "--max-steps", "4",
                         "--tokenizer", str(data["extended_tokenizer"]),
                         "--train-manifest", ext[ext.index("--train-manifest") + 1])
    assert started.returncode == 0, started.stderr
    assert "text_embedding and text_head train (their base rows held exact)" in started.stderr
    state, previous = final_state(new), final_state(old)
    assert state.step == 4 and state.lora is not None
    assert (state.text_tokens, state.base_text_tokens) == (EXTENDED, BASE_TOKENS)
    for key in TEXT_ROW_KEYS:
        assert torch.equal(_base_rows(state.model[key], BASE_TOKENS), previous.model[key]), key
