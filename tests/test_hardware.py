"""Hardware detection, the micro-batch split, the memory probe and its cache (in-process, no GPU)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_GPT
from trainers.data.sample_table import Sample, SampleTable
from trainers.faults import OomInjector
from trainers.hardware.batch_probe import ProbeCache, ProbeKey, largest_fitting, model_fits
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.hardware.detect import (
    auto_workers, choose_split, configure_device, detect_hardware, pick_device,
)
from trainers.config.flags import CommandLine
from trainers.config.settings import saved_settings
from trainers.errors import UserError
from trainers.hardware.precision import amp_dtype, choose_amp
from trainers.run.resolve import merge_settings
from trainers.run.run_dir import SavedRun
from trainers.training.rng import ProcessRNG

REPO = Path(__file__).resolve().parents[1]


def test_cpu_is_detected_with_cores_and_memory():
    hw = detect_hardware(torch.device("cpu"))
    assert not hw.is_cuda and hw.gpu is None and hw.cache_key() == "cpu"
    assert hw.cpu_cores >= 1 and hw.ram_bytes > 0
    assert "CPU only" in hw.describe()
    assert amp_dtype(hw, "auto") is None  # auto is fp32 on the CPU
    assert auto_workers(hw)[0] == 0


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="--device cuda"):
        pick_device("cuda")
    with pytest.raises(UserError, match="--device banana"):
        pick_device("banana")


@pytest.mark.parametrize("effective, micro, accum, expected", [
    (32, 8, 0, (8, 4)),
    (32, 0, 16, (2, 16)),
    (32, 32, 0, (32, 1)),
    (32, 64, 0, (32, 1)),   # never more than one step's samples
    (32, 6, 0, (6, 6)),     # 6+6+6+6+6+2: the last piece is short, the step is still 32 samples
])
def test_split_keeps_the_effective_batch(effective, micro, accum, expected):
    split = choose_split(effective, micro, accum)
    assert (split.micro_batch, split.accumulation) == expected
    assert choose_split(effective, 0, 0) is None  # auto: proposed from the hardware


def _cmd(**given) -> CommandLine:
    return CommandLine(given={"train_manifests": ("x.jsonl",), "tokenizer": "t.model", **given}, resume=None)


def resolve(cmd: CommandLine, saved: dict | None) -> object:
    """The settings merged on this (CPU) machine, from a saved run written on the same one."""
    return merge_settings(cmd, SavedRun(saved_settings(saved), "cpu") if saved else None, REPO / "runs" / "x", "cpu")


def test_batch_flags_resolve_to_an_effective_batch():
    assert resolve(_cmd(), None).effective_batch == 32  # the default
    both = resolve(_cmd(batch_size=4, grad_accumulation=4), None)
    assert (both.effective_batch, both.batch_size, both.grad_accumulation) == (16, 4, 4)  # community semantics
    assert resolve(_cmd(effective_batch=64, batch_size=8), None).effective_batch == 64
    with pytest.raises(UserError, match="give two of the three"):
        resolve(_cmd(effective_batch=64, batch_size=8, grad_accumulation=4), None)


def test_resume_keeps_the_saved_effective_batch_and_rederives_the_split():
    saved = resolve(_cmd(batch_size=8, grad_accumulation=4), None).to_dict()
    cmd = CommandLine(given={"batch_size": 2}, resume="auto")
    cfg = resolve(cmd, saved)
    assert (cfg.effective_batch, cfg.batch_size, cfg.grad_accumulation) == (32, 2, 0)
    cfg = resolve(CommandLine(given={"grad_accumulation": 1}, resume="auto"), saved)
    assert (cfg.effective_batch, cfg.batch_size, cfg.grad_accumulation) == (32, 0, 1)
    # A configuration saved before --effective-batch existed.
    old = {k: v for k, v in saved.items() if k not in ("effective_batch", "freeze_base_vocab")}
    cfg = resolve(CommandLine(given={}, resume="auto"), old)
    assert cfg.effective_batch == 32 and cfg.freeze_base_vocab is False


@pytest.mark.parametrize("limit, upper, expected", [(12, 32, 12), (5, 16, 5), (100, 24, 24), (0, 8, 0), (1, 1, 1)])
def test_probe_finds_the_largest_fitting_micro_batch(limit, upper, expected):
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= limit

    assert largest_fitting(fits, upper) == expected
    assert max(tried) <= upper and len(tried) <= 10


def test_probe_runs_the_model_without_changing_it():
    torch.manual_seed(0)
    model = UnifiedVoiceGPT(TINY_GPT)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    fits = model_fits(model, torch.device("cpu"), None, longest_text=8, longest_codes=10, oom=OomInjector(above=4))
    assert largest_fitting(fits, 16) == 4
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())  # the data order and dropout masks cannot have moved


def _key(**changed) -> ProbeKey:
    fields = dict(hardware="cuda|NVIDIA L4|22478MiB|sm89", model_config="abc", amp_dtype="torch.bfloat16",
                  grad_checkpointing=False, deterministic=False, dropout=0.1, dropout_masks="v2", world_size=1,
                  longest_text=120, longest_codes=600, effective_batch=32)
    return ProbeKey(**{**fields, **changed})


def test_probe_cache_is_reused_only_for_the_same_key(tmp_path):
    key = _key()
    cache = ProbeCache(tmp_path)
    assert cache.lookup(key) is None
    cache.store(key, 12, "probed")
    assert cache.lookup(key) == 12 and cache.failed_size(key) is None
    assert cache.lookup(_key(hardware="cuda|NVIDIA A100-SXM4-80GB|81153MiB|sm80")) is None
    assert cache.lookup(_key(method=1)) is None  # answers of the earlier probe, which under-budgeted
    cache.store(key, 6, "halved after running out of memory at step 5", out_of_memory_at=12)
    assert cache.lookup(key) == 6 and cache.failed_size(key) == (12, "halved after running out of memory at step 5")
    (tmp_path / cache.path.name).write_text("{not json")
    assert cache.lookup(key) is None


def _samples(text_len: int, code_len: int) -> SampleTable:
    return SampleTable.of([Sample(0, "a", "m.jsonl:1", "", "", "", "", text_len, code_len, None, None)])


@pytest.mark.parametrize("changed", [{"deterministic": True}, {"world_size": 2}, {"dropout": 0.0},
                                     {"grad_checkpointing": True}])
def test_probe_cache_is_keyed_by_every_setting_that_changes_memory(tmp_path, monkeypatch, changed):
    """A probe answer found with another setting that changes memory is not reused: probing again finds
    the size that fits now (injected out-of-memory errors stand for the memory that setting takes)."""
    from trainers.config.settings import TrainConfig
    from trainers.hardware.plan import plan_hardware

    torch.manual_seed(0)
    model = UnifiedVoiceGPT(TINY_GPT)
    cpu, samples = detect_hardware(torch.device("cpu")), _samples(8, 10)
    monkeypatch.setenv("INDEXTTS_TRAIN_OOM_ABOVE", "4")
    first = plan_hardware(TrainConfig(effective_batch=16), cpu, model, samples, "abc", tmp_path)
    assert first.split.micro_batch == 4 and first.split.reason.startswith("auto: probed on the longest")
    monkeypatch.setenv("INDEXTTS_TRAIN_OOM_ABOVE", "2")
    world_size = changed.get("world_size", 1)
    settings = {k: v for k, v in changed.items() if k != "world_size"}
    again = plan_hardware(TrainConfig(effective_batch=16, **settings), cpu, model, samples, "abc", tmp_path,
                          world_size=world_size)
    assert again.split.micro_batch == 2 and again.split.reason.startswith("auto: probed on the longest")


class _FakeMeasurement:
    """The probe's GPU measurement on a machine without a GPU: each pass's peak grows with the micro-batch."""

    def __init__(self, monkeypatch, free: int, peak_of) -> None:
        from trainers.hardware import batch_probe

        self.passes: dict[int, int] = {}
        self.peak_of = peak_of
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free + 2 ** 30))
        monkeypatch.setattr(batch_probe, "_forward_backward", self.measure)

    def measure(self, model, n, device, amp_dtype, text_len, code_len, passes=1) -> int:
        self.passes[n] = passes
        return self.peak_of(n)


def _official_model_on_meta() -> UnifiedVoiceGPT:
    import yaml

    from trainers.model.gpt_model import GPTConfig

    gpt = yaml.safe_load((REPO / "checkpoints" / "config.yaml").read_text(encoding="utf-8"))["gpt"]
    with torch.device("meta"):
        return UnifiedVoiceGPT(GPTConfig.from_yaml_section(gpt))


GIB = 2 ** 30


def _pass_peak(trained: int):
    """A pass of n longest samples peaks at the gradients (the trained weights' size) + 0.4 GiB x n."""
    return lambda n: trained + int(0.4 * GIB * n)


def test_probe_leaves_room_for_the_optimizer_update(monkeypatch):
    """The official model (2.11 GB of trained fp32 weights, T) with 9 GiB free: a pass of 1 sample (2.5 GiB)
    fits beside AdamW's moments (2T), but the update holds the gradients, the moments and a temporary of the
    weights' size (4T = 7.9 GiB > 85% of 9 GiB) at any micro-batch. The probe used to choose 4."""
    model = _official_model_on_meta()
    trained = sum(p.numel() * 4 for p in model.parameters())
    assert trained / 1e9 == pytest.approx(2.108, abs=0.001)
    _FakeMeasurement(monkeypatch, 9 * GIB, _pass_peak(trained))
    assert largest_fitting(model_fits(model, torch.device("cuda", 0), None, 600, 1815, OomInjector()), 32) == 0


def test_probe_leaves_room_for_ddp_buckets_and_nccl_under_torchrun(monkeypatch):
    """20 GiB free (17 GiB usable): alone, n fits while T + 0.4 GiB x n + 2T <= 17 GiB (n <= 27; the bisection
    stops at 26). Under torchrun DDP adds a copy of the gradients and NCCL its buffers (1 GiB budgeted):
    n <= 20. The probe used to answer 26 under torchrun too."""
    model = _official_model_on_meta()
    trained = sum(p.numel() * 4 for p in model.parameters())
    fake = _FakeMeasurement(monkeypatch, 20 * GIB, _pass_peak(trained))
    cuda = torch.device("cuda", 0)
    assert largest_fitting(model_fits(model, cuda, None, 600, 1815, OomInjector(), world_size=1, upper=32), 32) == 26
    assert largest_fitting(model_fits(model, cuda, None, 600, 1815, OomInjector(), world_size=2, upper=32), 32) == 20
    assert fake.passes[20] == 2 and fake.passes[32] == 1  # below the step's samples two passes accumulate


@pytest.mark.parametrize("error", ["CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                                   "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"])
def test_a_library_allocation_failure_in_the_probe_means_does_not_fit(error):
    """cuBLAS and cuDNN report a failed allocation as a RuntimeError, not torch.OutOfMemoryError; in the probe
    it used to end start-up with a traceback."""
    torch.manual_seed(0)
    model = UnifiedVoiceGPT(TINY_GPT)
    real = model.loss_sums

    def loss_sums(condition, *args, **kwargs):
        if condition.shape[0] > 4:
            raise RuntimeError(error)
        return real(condition, *args, **kwargs)

    model.loss_sums = loss_sums
    fits = model_fits(model, torch.device("cpu"), None, longest_text=8, longest_codes=10, oom=OomInjector())
    assert largest_fitting(fits, 16) == 4
    assert all(p.grad is None for p in model.parameters())

    def broken(*args, **kwargs):
        raise RuntimeError("expected all tensors to be on the same device")

    model.loss_sums = broken  # any other error is not "does not fit"
    with pytest.raises(RuntimeError, match="same device"):
        model_fits(model, torch.device("cpu"), None, 8, 10, OomInjector())(1)


def test_oom_injection_raises_the_cuda_error_type():
    oom = OomInjector(above=4, at="3:1")
    oom.check(4)
    with pytest.raises(torch.OutOfMemoryError):
        oom.check(5)
    with pytest.raises(torch.OutOfMemoryError):
        oom.check(2, 3, 1)
    oom.check(2, 3, 1)  # once only: the redone step succeeds


def test_cuda_rng_states_from_another_machine_are_reported_not_fatal(caplog):
    state = ProcessRNG().state_dict()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]
    with caplog.at_level(logging.INFO):
        ProcessRNG().load_state_dict(state)
    if torch.cuda.is_available() and torch.cuda.device_count() != 2:
        assert "checkpoint has CUDA RNG states for 2 devices" in caplog.text
    elif not torch.cuda.is_available():
        assert "CUDA RNG states for 2 device(s) and this machine has no CUDA" in caplog.text
    else:  # two GPUs here too: restored without a word
        assert "CUDA RNG" not in caplog.text


@pytest.mark.parametrize("effective, expected", [(32, (16, 2)), (8, (8, 1)), (40, (16, 3))])
def test_cpu_auto_split_is_at_most_16_and_never_more_than_a_step(tmp_path, effective, expected):
    from trainers.config.settings import TrainConfig
    from trainers.hardware.plan import plan_hardware

    hw = plan_hardware(TrainConfig(effective_batch=effective), detect_hardware(torch.device("cpu")), model=None,
                       samples=[], model_fingerprint="", run_dir=tmp_path)
    assert (hw.split.micro_batch, hw.split.accumulation) == expected and hw.split.reason.startswith("auto: CPU")
    assert not list(tmp_path.iterdir())  # no probe, no cache on a CPU


def test_cuda_detection_and_proposals_with_a_faked_gpu(monkeypatch):
    # No GPU here: fake the few torch.cuda calls detection makes, to exercise the CUDA branch.
    class Props:
        name, major, minor = "NVIDIA L4", 8, 9

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (20 * 2 ** 30, 22 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    hw = detect_hardware(torch.device("cuda"))
    assert hw.is_cuda and hw.gpu.tf32 and hw.gpu.bf16 and hw.gpu_count == 1
    assert hw.cache_key() == "cuda|NVIDIA L4|22528MiB|sm89"
    assert "NVIDIA L4 (22.0 GiB, 20.0 GiB free, compute 8.9, bf16 yes, TF32 yes" in hw.describe()
    assert amp_dtype(hw, "auto") is torch.bfloat16 and amp_dtype(hw, "off") is None
    workers, why = auto_workers(hw)
    assert 1 <= workers <= 4 and "cores" in why


def test_halving_stops_below_one():
    from trainers.hardware.oom_recovery import OutOfMemoryStop, halved, oom_message

    assert halved(8, "validation", "x") == 4 and halved(3, "step 2", "x") == 1
    with pytest.raises(OutOfMemoryStop, match="out of memory in step 7 even with a batch of 1"):
        halved(1, "step 7", "CUDA out of memory")
    assert oom_message(torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB\nstats...")) == \
        "CUDA out of memory. Tried 2 GiB"


class _FakeGpu:
    def __init__(self, name: str, major: int, minor: int) -> None:
        self.name, self.major, self.minor = name, major, minor


def _fake_cuda(monkeypatch, gpus: list[_FakeGpu]) -> list:
    """Two-or-more-GPU machine without a GPU: torch.cuda answers for `gpus`; the current device is 0."""
    set_device_calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpus[index])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (14 * 2 ** 30, 16 * 2 ** 30))
    # What emulation reports for the current device (a T4): bf16 "supported", but slow.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device_calls.append)
    return set_device_calls


@pytest.fixture
def tf32_flags_kept():
    """The process-wide TF32 switches as they were before the test. Saved and assigned back by hand:
    they are properties computed by torch, which monkeypatch's undo cannot restore (pytest 9 deletes
    the attribute instead, and the teardown fails)."""
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    saved = [flag.allow_tf32 for flag in flags]
    yield
    for flag, value in zip(flags, saved):
        flag.allow_tf32 = value


def test_bf16_and_tf32_follow_the_chosen_gpus_compute_capability(monkeypatch, tf32_flags_kept):
    calls = _fake_cuda(monkeypatch, [_FakeGpu("Tesla T4", 7, 5), _FakeGpu("NVIDIA A100-SXM4-80GB", 8, 0)])
    t4 = detect_hardware(pick_device("cuda"))
    assert t4.device == torch.device("cuda", 0) and not t4.gpu.bf16 and not t4.gpu.tf32
    assert amp_dtype(t4, "auto") is torch.float16  # emulated bf16 is not used: fp16 with a loss scaler
    assert configure_device(t4, tf32=True) is False and calls == [torch.device("cuda", 0)]
    a100 = detect_hardware(pick_device("cuda:1"))  # not the current device
    assert a100.gpu.index == 1 and a100.gpu.bf16 and amp_dtype(a100, "auto") is torch.bfloat16
    assert configure_device(a100, tf32=True) is True and calls[-1] == torch.device("cuda", 1)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert configure_device(a100, tf32=False) is False and not torch.backends.cuda.matmul.allow_tf32


def test_amp_modes_on_each_kind_of_machine(monkeypatch):
    """auto is mixed precision wherever it is safe: bf16 on GPUs with bf16, fp16 with a loss scaler on
    older GPUs, fp32 on the CPU; bf16 and fp16 run on the CPU too; bf16 is refused where it would be emulated."""
    cpu = detect_hardware(torch.device("cpu"))
    assert [amp_dtype(cpu, m) for m in ("auto", "bf16", "fp16", "off")] == [None, torch.bfloat16, torch.float16, None]
    assert "fp32 on the CPU" in choose_amp(cpu, "auto").reason
    _fake_cuda(monkeypatch, [_FakeGpu("Tesla V100-SXM2-16GB", 7, 0), _FakeGpu("NVIDIA H100 80GB HBM3", 9, 0)])
    v100, h100 = detect_hardware(pick_device("cuda:0")), detect_hardware(pick_device("cuda:1"))
    assert [amp_dtype(h100, m) for m in ("auto", "bf16", "fp16", "off")] == \
        [torch.bfloat16, torch.bfloat16, torch.float16, None]
    auto = choose_amp(v100, "auto")
    assert auto.dtype is torch.float16 and auto.name == "fp16"
    assert "has no bf16, so fp16 with a loss scaler; --amp off for fp32" in auto.reason
    with pytest.raises(UserError, match=r"--amp bf16: Tesla V100-SXM2-16GB \(compute 7.0\) has no bf16 tensor cores"):
        choose_amp(v100, "bf16")


@pytest.mark.parametrize("saved, expected", [(True, "auto"), (False, "off"), ("bf16", "bf16")])
def test_a_saved_amp_switch_resumes_as_the_mode_it_computed_in(saved, expected):
    """Runs saved when --amp was a switch: on was bf16 where supported, else fp16, fp32 on the CPU (auto);
    off was fp32 everywhere. A resume keeps that choice."""
    assert saved_settings({"amp": saved})["amp"] == expected
