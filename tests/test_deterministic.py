"""--deterministic keeps its promise: an op without a deterministic kernel stops the run (exit 2, named,
no traceback) instead of training on; the loss avoids NLLLoss; attention keeps a fused backend.

No GPU here: the CUDA-only conditions are forced on the CPU. `put_` (accumulate=False) has no
deterministic kernel on any device, so a wrapper that runs it before a model op stands for a CUDA
kernel without one; fake GPUs (tests/test_hardware.py) stand for the devices' capabilities.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.demo_runs import final_state, small_corpus_flags, train_here
from tests.test_hardware import _FakeGpu, _fake_cuda
from trainers.hardware.detect import detect_hardware, pick_device
from trainers.hardware.determinism import attention_backend, make_deterministic, math_attention_bytes
from trainers.model.cross_entropy import summed_cross_entropy

NO_KERNEL = "does not have a deterministic implementation"


@pytest.fixture
def deterministic_state_kept():
    """torch's process-wide determinism switches as they were before the test (an in-process run with
    --deterministic sets them for the rest of the process). Assigned back by hand, like tf32_flags_kept."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    sdp = [cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
           cuda.cudnn_sdp_enabled()]
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             cudnn.deterministic, cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    cudnn.deterministic, cudnn.benchmark = saved[2], saved[3]
    for enable, value in zip((cuda.enable_flash_sdp, cuda.enable_mem_efficient_sdp, cuda.enable_math_sdp,
                              cuda.enable_cudnn_sdp), sdp):
        enable(value)
    if saved[4] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[4]


def _no_deterministic_kernel() -> None:
    torch.zeros(1).put_(torch.tensor([0]), torch.tensor([0.0]))


def _alerting(original, from_call: int = 1, training_only: bool = True):
    """`original`, preceded from its `from_call`-th call on (counting calls with gradients only, if
    training_only) by an op without a deterministic kernel."""
    calls = [0]

    def wrapper(*args, **kwargs):
        if torch.is_grad_enabled() or not training_only:
            calls[0] += 1
            if calls[0] >= from_call:
                _no_deterministic_kernel()
        return original(*args, **kwargs)
    return wrapper


def _flags(tmp_path, steps: int) -> list[str]:
    """A few seconds' run on the small corpus (copied to tmp_path/data once), with --deterministic."""
    data = tmp_path / "data"
    corpus = small_corpus_flags(data) if not data.exists() else \
        ["--train-manifest", str(data / "train.jsonl"), "--val-manifest", str(data / "val.jsonl"),
         "--tokenizer", str(data / "bpe.model"), "--config", str(data / "tiny.yaml")]
    return [*corpus, "--effective-batch", "4", "--warmup-steps", "1", "--val-interval", "0", "--save-interval", "100",
            "--max-steps", str(steps), "--deterministic"]


def test_an_op_without_a_deterministic_kernel_stops_the_run_keeping_the_steps_before_it(
        tmp_path, monkeypatch, deterministic_state_kept):
    """Attention (one layer, one pass per step) meets such an op from step 3 on: the run saves steps 1-2
    (each ran deterministic kernels only) and exits 2 naming the op, instead of warning and training on."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", _alerting(F.scaled_dot_product_attention, from_call=3))
    run = tmp_path / "run"
    stopped = train_here(run, *_flags(tmp_path, 5))
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert (f"--deterministic: put_ has no deterministic implementation on this device (torch {torch.__version__}), "
            "met in the forward/backward pass of step 3; it was not run") in stopped.stderr
    assert "pass --no-deterministic to train on" in stopped.stderr and "Traceback" not in stopped.stderr
    assert "deterministic: on (an op with no deterministic kernel stops the run with exit 2 before it runs)" \
        in stopped.stderr and "attention: cpu (torch's CPU kernels, deterministic)" in stopped.stderr
    assert final_state(run).step == 2
    # The documented way on: the same run without --deterministic (saved with the run, so it must be switched off).
    monkeypatch.undo()
    resumed = train_here(run, "--resume", "auto", "--no-deterministic")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "deterministic: saved True, now False (ok)" in resumed.stderr and final_state(run).step == 5


def test_such_an_op_in_the_start_up_probe_or_the_update_is_a_clean_stop_too(tmp_path, monkeypatch,
                                                                               deterministic_state_kept):
    # The micro-batch probe (run on the CPU through the out-of-memory injector) meets it: nothing trained.
    monkeypatch.setattr(F, "scaled_dot_product_attention", _alerting(F.scaled_dot_product_attention))
    probed = train_here(tmp_path / "probe", *_flags(tmp_path, 3), "--batch-size", "0",
                        env={"INDEXTTS_TRAIN_OOM_ABOVE": "64"})
    assert probed.returncode == 2, probed.stderr[-3000:]
    assert "met during start-up" in probed.stderr and "nothing was trained" in probed.stderr
    assert "Traceback" not in probed.stderr and not (tmp_path / "probe" / "latest.pth").exists()
    monkeypatch.undo()
    # The optimizer update meets it at step 2: that step may be half applied, so nothing is saved from it.
    monkeypatch.setattr(torch.optim.AdamW, "step", _alerting(torch.optim.AdamW.step, 2, training_only=False))
    updated = train_here(tmp_path / "update", *_flags(tmp_path, 3))
    assert updated.returncode == 2, updated.stderr[-3000:]
    assert "met in the optimizer update of step 2" in updated.stderr
    assert "Nothing was saved from this step; the last checkpoint (none yet) is intact" in updated.stderr
    assert "Traceback" not in updated.stderr and not (tmp_path / "update" / "latest.pth").exists()


def test_the_deterministic_loss_runs_no_nll_loss_and_changes_no_weight(demo_assets, tmp_path, monkeypatch,
                                                                      deterministic_state_kept):
    """torch's documentation lists NLLLoss (F.cross_entropy's kernel) among the ops without a deterministic
    CUDA kernel: made so here, a --deterministic run still trains, with no warning about such an op, and
    ends with the weights of the same run without --deterministic, bit for bit (demo base checkpoint, dropout)."""
    flags = [*demo_assets, "--batch-size", "8", "--max-steps", "3", "--val-interval", "0", "--max-val-batches", "1",
             "--dropout", "0.1"]
    plain = train_here(tmp_path / "plain", *flags)
    assert plain.returncode == 0, plain.stderr[-3000:]
    monkeypatch.setattr(F, "cross_entropy", _alerting(F.cross_entropy, training_only=False))
    monkeypatch.setattr(F, "nll_loss", _alerting(F.nll_loss, training_only=False))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        done = train_here(tmp_path / "run", *flags, "--deterministic")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [w for w in seen if NO_KERNEL in str(w.message)]
    assert "deterministic: on (an op with no deterministic kernel stops the run" in done.stderr
    assert "attention: cpu" in done.stderr
    a, b = final_state(tmp_path / "plain"), final_state(tmp_path / "run")
    for key in a.model:
        assert torch.equal(a.model[key], b.model[key]), key


@pytest.mark.parametrize("rows, classes", [(1, 2), (37, 130), (3000, 8194)])
def test_the_gather_cross_entropy_equals_the_fused_one(rows, classes):
    """Same loss within float rounding (only the final sum's order differs), bit-identical gradients."""
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, classes, generator=gen) * 3).requires_grad_()
    targets = torch.randint(0, classes, (rows,), generator=gen)
    fused = summed_cross_entropy(logits, targets)
    (g_fused,) = torch.autograd.grad(fused * 0.37, logits)
    gathered = summed_cross_entropy(logits, targets, deterministic=True)
    (g_gathered,) = torch.autograd.grad(gathered * 0.37, logits)
    torch.testing.assert_close(gathered, fused, rtol=1e-6, atol=0)
    assert torch.equal(g_gathered, g_fused)


def test_deterministic_mode_raises_and_keeps_the_fused_attention_backends(deterministic_state_kept):
    """warn_only off (an op without a deterministic kernel raises), flash and memory-efficient attention stay
    available (deterministic in this mode), cuDNN attention is off; nothing forces the math backend."""
    make_deterministic()
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    cuda = torch.backends.cuda
    assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
    assert not cuda.cudnn_sdp_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    with pytest.raises(RuntimeError, match=NO_KERNEL):
        _no_deterministic_kernel()


def test_the_attention_backend_is_the_most_memory_efficient_deterministic_one(monkeypatch):
    gpus = [_FakeGpu("NVIDIA A100-SXM4-80GB", 8, 0), _FakeGpu("Tesla T4", 7, 5), _FakeGpu("NVIDIA L4", 8, 9),
            _FakeGpu("Tesla K80", 3, 7)]
    _fake_cuda(monkeypatch, gpus)
    a100, t4, l4, k80 = (detect_hardware(pick_device(f"cuda:{i}")) for i in range(len(gpus)))
    official = 1280 // 20
    assert attention_backend(a100, torch.bfloat16, official).describe() == \
        "flash (deterministic backward; bfloat16, head dim 64, compute 8.0)"
    assert attention_backend(a100, None, official).name == "memory-efficient"  # flash needs fp16/bf16
    assert attention_backend(t4, torch.float16, official).describe() == \
        "memory-efficient (deterministic backward with one key split; float16, head dim 64, compute 7.5)"
    assert attention_backend(l4, torch.bfloat16, 200).name == "memory-efficient"  # flash cannot train 193-224 here
    assert attention_backend(a100, None, 50).name == "math"  # fp32 needs a head dim that is a multiple of 4
    assert attention_backend(k80, None, official).name == "math"
    assert attention_backend(detect_hardware(torch.device("cpu")), None, official).name == "cpu"
    # The figure: the official 20 heads at about 2,450 positions, fp32.
    assert round(math_attention_bytes(2450, 20, None) / 1e9, 2) == 0.48


def test_such_an_op_in_generation_at_validation_stops_keeping_the_steps_before_it(tmp_path, monkeypatch,
                                                                                  deterministic_state_kept):
    """Generation at the final validation (--sample-interval) meets it: the steps trained are saved (the
    weights are at a step boundary) and the stop names generation, not the optimizer update."""
    from trainers.run import validation_generation

    monkeypatch.setattr(validation_generation, "generate_codes",
                        _alerting(validation_generation.generate_codes, from_call=2, training_only=False))
    run = tmp_path / "run"
    stopped = train_here(run, *_flags(tmp_path, 3), "--sample-interval", "3", "--val-batch-size", "64")
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert "met in the generation at validation of step 3; it was not run" in stopped.stderr, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and final_state(run).step == 3
