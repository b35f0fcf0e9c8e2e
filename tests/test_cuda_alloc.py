"""Expandable segments for CUDA's allocator by default, and the out-of-memory message that suggests them
(trainers/hardware/cuda_alloc.py). No GPU here: what is checked is the variable the trainer sets before
torch loads, and what it says; that a GPU run then fragments less is not measured."""
from __future__ import annotations

from trainers.hardware import cuda_alloc
from trainers.hardware.cuda_alloc import fragmentation_advice, use_expandable_segments

from tests.demo_runs import small_corpus_flags, train_here


def test_the_trainer_sets_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    monkeypatch.setattr(cuda_alloc, "_set_here", False)
    env = {"PYTORCH_ALLOC_CONF": ""}  # empty: not set, and it must not shadow the value set here
    assert use_expandable_segments(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert fragmentation_advice(env) == ""
    assert "(set by the trainer against fragmentation" in cuda_alloc.allocator_line(env)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        mine = {name: "max_split_size_mb:64"}
        assert not use_expandable_segments(mine) and mine == {name: "max_split_size_mb:64"}  # kept as it is
        assert f"add expandable_segments:True (comma-separated) to your\n{name}=max_split_size_mb:64" in \
            fragmentation_advice(mine)
    assert fragmentation_advice({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}) == ""


def test_halving_the_micro_batch_suggests_expandable_segments_when_they_are_off(tmp_path):
    """main() in this process does not pass through the script's start (where the variable is set): like a
    user's own PYTORCH_CUDA_ALLOC_CONF without them. tests/test_ddp_runs.py checks the real processes."""
    flags = [*small_corpus_flags(tmp_path / "data"), "--effective-batch", "8", "--batch-size", "8", "--max-steps",
             "2", "--val-interval", "0", "--max-val-batches", "1", "--warmup-steps", "1"]
    result = train_here(tmp_path / "run", *flags, env={"INDEXTTS_TRAIN_OOM_AT": "2:0",
                                                      "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert result.returncode == 0, result.stderr
    assert "redone with micro-batch 4 x accumulation 2" in result.stderr
    assert "free GPU memory can be fragmented (sizes change from step to step):" in result.stderr
    assert "to reuse it, add expandable_segments:True (comma-separated) to your" in result.stderr
    assert "WARNING PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64\n" in result.stderr
