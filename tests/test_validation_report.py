"""Validation reports losses per language when the validation manifests name several (F::LANG)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.demo_runs import final_state, train_here


def test_validation_losses_per_language(demo_assets, tmp_path):
    val = Path(demo_assets[demo_assets.index("--val-manifest") + 1])
    lines = val.read_text().splitlines()
    halves = []
    for name, part in (("a.jsonl", lines[:20]), ("b.jsonl", lines[20:])):
        path = val.parent / name  # beside the original: the lines' relative paths still resolve
        path.write_text("\n".join(part) + "\n")
        halves.append(path)
    args = [a for a in demo_assets]
    i = args.index("--val-manifest")
    args[i: i + 2] = ["--val-manifest", f"{halves[0]}::am", "--val-manifest", f"{halves[1]}::ja"]
    done = train_here(tmp_path / "run", *args, "--max-steps", "1", "--max-val-batches", "0", "--val-batch-size", "7")
    assert done.returncode == 0, done.stderr
    assert "validation step 0 language am" in done.stderr and "validation step 0 language ja" in done.stderr
    first = [h for h in final_state(tmp_path / "run").history if h["kind"] == "val"][0]
    am, ja = first["langs"]["am"], first["langs"]["ja"]
    assert am["mel_loss"] != ja["mel_loss"]
    # The overall loss is the token-weighted mean of the languages': it lies strictly between them.
    low, high = sorted((am["mel_loss"], ja["mel_loss"]))
    assert low < first["mel_loss"] < high
    assert train_here(tmp_path / "one", *demo_assets, "--max-steps", "1", "--max-val-batches", "0").returncode == 0
    one = [h for h in final_state(tmp_path / "one").history if h["kind"] == "val"][0]
    assert "langs" not in one and one["mel_loss"] == pytest.approx(first["mel_loss"], rel=1e-6)  # same samples
