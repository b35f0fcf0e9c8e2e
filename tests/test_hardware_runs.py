"""The hardware decides only how a step's samples are split: OOM recovery, other splits, other machines.

Out-of-memory errors are injected (trainers/faults.py) so the recovery path runs on a CPU.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.demo_runs import assert_close_weights, family_run, final_state, train_here

FLAGS = ["--max-val-batches", "1", "--val-interval", "0", "--log-sample-ids", "--dropout", "0.1",
         "--keep-checkpoints", "1", "--log-interval", "100"]
SMALL = ["--batch-size", "8", "--grad-accumulation", "2", "--max-steps", "16", "--val-batch-size", "16", *FLAGS]
LARGE = ["--batch-size", "8", "--grad-accumulation", "4", "--max-steps", "16", "--lr-decay-steps", "16", *FLAGS]


def _trained(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str) -> Path:
    out = tmp_path_factory.mktemp(name) / "run"
    result = train_here(out, *flags)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def small_reference(demo_assets, tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, "small", *demo_assets, *SMALL)


@pytest.fixture(scope="module")
def large_reference(demo_assets, tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, "large", *demo_assets, *LARGE)


@pytest.fixture(scope="module")
def large_half(demo_assets, tmp_path_factory) -> Path:
    """The first 8 of LARGE's 16 steps, to copy and resume in several ways."""
    return _trained(tmp_path_factory, "large_half", *demo_assets, *LARGE, "--max-steps", "8")


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)  # latest.pth is a hard link in src, a plain copy here
    return dst


def _validations(out: Path) -> list[float]:
    return [m["mel_loss"] for m in final_state(out).history if m["kind"] == "val"]


@pytest.fixture(scope="module")
def family_small_reference(family_assets, request, tmp_path_factory) -> Path:
    """`small_reference`, for each model family's demo."""
    return family_run(family_assets, request, "small_reference", tmp_path_factory, *SMALL)


def test_oom_above_4_trains_at_4_x_4_on_the_same_samples(family_assets, family_small_reference, tmp_path):
    """Each model family."""
    demo_assets, small_reference = family_assets, family_small_reference
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *SMALL, env={"INDEXTTS_TRAIN_OOM_ABOVE": "4"})
    assert result.returncode == 0, result.stderr
    assert "out of memory at step 1 with micro-batch 8: redone with micro-batch 4 x accumulation 4" in result.stderr
    assert result.stderr.count("out of memory at step") == 1  # halved once, then kept
    # Validation ran out of memory too (batch 16) and was redone from the start with 8, then 4.
    assert "out of memory in validation: again with batch 8" in result.stderr
    assert "out of memory in validation: again with batch 4" in result.stderr
    assert (out / "sample_ids.tsv").read_text() == (small_reference / "sample_ids.tsv").read_text()
    assert_close_weights(small_reference, out)
    for ours, theirs in zip(_validations(out), _validations(small_reference), strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5)


def test_oom_mid_accumulation_discards_the_partial_step(demo_assets, small_reference, tmp_path):
    out = tmp_path / "run"
    # Micro-batch 0 of step 5 has already added its gradients when micro-batch 1 fails.
    result = train_here(out, *demo_assets, *SMALL, env={"INDEXTTS_TRAIN_OOM_AT": "5:1"})
    assert result.returncode == 0, result.stderr
    assert "out of memory at step 5 with micro-batch 8" in result.stderr
    assert (out / "sample_ids.tsv").read_text() == (small_reference / "sample_ids.tsv").read_text()
    assert_close_weights(small_reference, out)  # a kept partial gradient would be off by ~lr, far beyond rounding


def test_auto_micro_batch_is_probed_cached_and_reused(demo_assets, small_reference, tmp_path):
    out = tmp_path / "run"
    auto = ["--effective-batch", "16", *[f for f in SMALL if f not in ("--batch-size", "8", "--grad-accumulation", "2")]]
    auto[auto.index("--max-steps") + 1] = "8"
    result = train_here(out, *demo_assets, *auto, "--lr-decay-steps", "16", env={"INDEXTTS_TRAIN_OOM_ABOVE": "4"})
    assert result.returncode == 0, result.stderr
    assert "micro-batch 4 x accumulation 4" in result.stderr and "(auto: probed on the longest" in result.stderr
    assert "out of memory at step" not in result.stderr  # the probe found the size before training
    assert json.loads((out / "micro_batch_probe.json").read_text())["micro_batch"] == 4
    resumed = train_here(out, "--resume", "auto", "--max-steps", "16", env={"INDEXTTS_TRAIN_OOM_ABOVE": "4"})
    assert resumed.returncode == 0, resumed.stderr
    assert "probed earlier on this machine" in resumed.stderr
    assert (out / "sample_ids.tsv").read_text() == (small_reference / "sample_ids.tsv").read_text()
    assert_close_weights(small_reference, out)


def test_oom_at_micro_batch_1_stops_with_progress_saved(demo_assets, tmp_path):
    out = tmp_path / "run"
    flags = ["--effective-batch", "2", "--batch-size", "1", "--max-steps", "6", *FLAGS]
    stopped = train_here(out, *demo_assets, *flags, env={"INDEXTTS_TRAIN_OOM_AT": "3:0"})
    assert stopped.returncode == 5, stopped.stderr
    assert "out of memory in step 3 even with a batch of 1" in stopped.stderr
    assert final_state(out).step == 2  # the last step boundary
    resumed = train_here(out, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert final_state(out).step == 6


@pytest.mark.parametrize("split", [("--batch-size", "32"), ("--batch-size", "2"), ("--grad-accumulation", "16")])
def test_checkpoint_of_8_x_4_resumes_with_another_split(large_half, large_reference, tmp_path, split):
    out = _copy_run(large_half, tmp_path / "run")
    resumed = train_here(out, "--resume", "auto", "--max-steps", "16", *split)
    assert resumed.returncode == 0, resumed.stderr
    micro = 32 if split == ("--batch-size", "32") else 2
    assert f"effective batch 32 = micro-batch {micro} x accumulation {32 // micro}" in resumed.stderr
    assert (out / "sample_ids.tsv").read_text() == (large_reference / "sample_ids.tsv").read_text()
    assert_close_weights(large_reference, out)


def test_effective_batch_change_is_refused_with_an_explanation(large_half):
    out = large_half  # refusals change nothing, so the shared run can be used
    for flags in (["--effective-batch", "64"], ["--batch-size", "8", "--grad-accumulation", "8"]):
        refused = train_here(out, "--resume", "auto", *flags)
        assert refused.returncode == 2
        assert "effective_batch: saved 32, now 64" in refused.stderr
        assert "change only --batch-size or --grad-accumulation" in refused.stderr
    assert final_state(out).step == 8


def test_checkpoint_from_a_cuda_machine_resumes_on_this_one(large_half, large_reference, tmp_path):
    out = _copy_run(large_half, tmp_path / "run")
    # What a checkpoint written on a 2-GPU bf16 machine carries that this machine cannot use.
    state = final_state(out)
    state = state.edited("rng", cuda=[torch.zeros(16, dtype=torch.uint8)] * 2)
    state = state.edited("hardware", machine="cuda|NVIDIA A100-SXM4-80GB|81153MiB|sm80", amp_dtype="torch.bfloat16")
    (out / "latest.pth").unlink()  # a hard link: replace it, do not write through it
    torch.save(state.to_file(), out / "latest.pth")
    # The split it saved is not carried to another machine; the same one is typed here for exactness.
    resumed = train_here(out, "--resume", "auto", "--max-steps", "16", "--batch-size", "8")
    assert resumed.returncode == 0, resumed.stderr
    assert "hardware changed: the checkpoint was written on cuda|NVIDIA A100" in resumed.stderr
    if not torch.cuda.is_available():
        assert "CUDA RNG states for 2 device(s)" in resumed.stderr
    assert "mixed precision changed from torch.bfloat16 to None" in resumed.stderr
    a, b = final_state(large_reference), final_state(out)
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)  # same machine underneath: exact


@pytest.mark.parametrize("point", ["5:clip", "5:1:cublas"])
def test_oom_in_clipping_or_from_cublas_is_recovered_like_one_in_forward_backward(demo_assets, small_reference,
                                                                                 tmp_path, point):
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *SMALL, env={"INDEXTTS_TRAIN_OOM_AT": point})
    assert result.returncode == 0, result.stderr
    assert "out of memory at step 5 with micro-batch 8" in result.stderr
    assert (out / "sample_ids.tsv").read_text() == (small_reference / "sample_ids.tsv").read_text()
    assert_close_weights(small_reference, out)


# Keeps the out-of-memory injector active without injecting anything (step 1000 is never reached): the
# hardware plan then consults the probe cache as it does on a GPU.
AS_ON_A_GPU = {"INDEXTTS_TRAIN_OOM_AT": "1000:update"}


def test_oom_in_the_optimizer_update_stops_with_5_and_the_resume_starts_at_half(demo_assets, small_reference,
                                                                                tmp_path):
    """The update cannot be redone, so the run stops; it used to leave nothing that makes the resume (which
    reuses the saved --batch-size 8) start smaller, so every resume ran out of memory the same way."""
    out = tmp_path / "run"
    result = train_here(out, *demo_assets, *SMALL, "--save-interval", "2", env={"INDEXTTS_TRAIN_OOM_AT": "5:update"})
    assert result.returncode == 5, result.stderr
    assert "out of memory outside the forward/backward pass, at step 5" in result.stderr
    assert "The next start on this machine uses micro-batch 4 (recorded in micro_batch_probe.json)" in result.stderr
    assert final_state(out).step == 4  # the update may have been half applied: nothing of step 5 is kept
    resumed = train_here(out, "--resume", "auto", env=AS_ON_A_GPU)
    assert resumed.returncode == 0, resumed.stderr
    assert "micro-batch 8 ran out of memory on this machine with these settings" in resumed.stderr
    assert "micro-batch 4 x accumulation 4" in resumed.stderr
    assert "(--batch-size, lowered after running out of memory)" in resumed.stderr
    assert (out / "sample_ids.tsv").read_text() == (small_reference / "sample_ids.tsv").read_text()
    assert_close_weights(small_reference, out)


def test_oom_in_the_gradient_sum_makes_the_next_start_use_half_the_micro_batch(demo_assets, tmp_path, monkeypatch):
    """Under torchrun an out-of-memory error while DDP sums the gradients stops every process (exit 5). Forced
    in one process: the gradient sum of step 3 raises what trainers/training/distributed.py raises there."""
    from trainers.errors import EXIT_OUT_OF_MEMORY, DistributedFailure
    from trainers.training.distributed import World

    calls = []

    def sum_gradients(self) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise DistributedFailure("out of memory while summing the gradients of the processes (CUDA out of "
                                     "memory)", EXIT_OUT_OF_MEMORY)

    monkeypatch.setattr(World, "sum_gradients", sum_gradients)
    out = tmp_path / "run"
    flags = ["--effective-batch", "16", "--max-steps", "4", "--lr-decay-steps", "16", *FLAGS]
    result = train_here(out, *demo_assets, *flags, env={"INDEXTTS_TRAIN_OOM_ABOVE": "8"})
    assert result.returncode == 5, result.stderr
    assert "out of memory while summing the gradients" in result.stderr
    assert "The next start on this machine uses micro-batch 4 (recorded in micro_batch_probe.json)" in result.stderr
    monkeypatch.undo()
    resumed = train_here(out, "--resume", "auto", env={"INDEXTTS_TRAIN_OOM_ABOVE": "8"})
    assert resumed.returncode == 0, resumed.stderr
    assert "micro-batch 4 x accumulation 4" in resumed.stderr and "(auto: probed earlier on this machine" in resumed.stderr


def test_a_typed_batch_size_follows_the_run_on_its_machine_only(demo_assets, tmp_path):
    out = tmp_path / "run"
    flags = ["--effective-batch", "16", "--batch-size", "4", "--lr-decay-steps", "6", *FLAGS]
    assert train_here(out, *demo_assets, *flags, "--max-steps", "2").returncode == 0
    same = train_here(out, "--resume", "auto", "--max-steps", "4")
    assert same.returncode == 0, same.stderr
    assert "reusing --batch-size 4 saved with this run" in same.stderr and "(same machine: cpu)" in same.stderr
    assert "micro-batch 4 x accumulation 4 (--batch-size)" in same.stderr
    moved = final_state(out).edited("hardware", machine="cuda|NVIDIA A100-SXM4-80GB|81153MiB|sm80")
    (out / "latest.pth").unlink()  # a hard link: replace it, do not write through it
    torch.save(moved.to_file(), out / "latest.pth")
    other = train_here(out, "--resume", "auto", "--max-steps", "6")
    assert other.returncode == 0, other.stderr
    assert "not reusing --batch-size 4: the run saved it on another machine" in other.stderr
    assert "(cuda|NVIDIA A100-SXM4-80GB|81153MiB|sm80; this is cpu)" in other.stderr
    assert "micro-batch 16 x accumulation 1 (auto: CPU" in other.stderr
