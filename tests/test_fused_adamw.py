"""AdamW's fused kernels on a GPU (trainers/training/optimization.py), never on the CPU: a CPU run's optimizer,
its checkpoint and its updates stay what they were, also when it resumes a GPU run's checkpoint (whose saved
groups say fused)."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import TINY_GPT
from trainers.config.settings import TrainConfig
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.training.optimization import Optimization

CFG = TrainConfig(learning_rate=1e-2, warmup_steps=0, lr_decay_steps=100, weight_decay=0.1, grad_clip=0.5)


def _model(device: str = "cpu") -> UnifiedVoiceGPT:
    torch.manual_seed(0)
    return UnifiedVoiceGPT(TINY_GPT).to(device).train()


def _step(model: UnifiedVoiceGPT, optim: Optimization, seed: int) -> None:
    """One optimizer step on gradients drawn from `seed` (the same for every model given the same seed)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device)
    optim.start_step(seed)
    optim.apply(optim.prepare())


def test_the_cpu_optimizer_is_not_fused_and_saves_the_groups_it_saved_before():
    model = _model()
    optim = Optimization(model, CFG, fp16=False, frozen=None, device_type="cpu")
    assert optim.fused is False
    # The groups a checkpoint saves are those of a plain AdamW (fused None, foreach None), as before fused existed.
    plain = torch.optim.AdamW([{"params": [], "weight_decay": 0.0}], lr=CFG.learning_rate)
    for group in optim.optimizer.state_dict()["param_groups"]:
        assert group["fused"] is None and group["foreach"] is None
        assert set(group) == set(plain.state_dict()["param_groups"][0])
    # Even when the caller names cuda: the parameters' device decides (a test or tool may pass the default).
    assert Optimization(model, CFG, fp16=False, frozen=None, device_type="cuda").fused is False


def test_a_gpu_runs_optimizer_state_resumed_on_the_cpu_trains_as_the_cpu_would():
    """A checkpoint written on a GPU says fused in its groups; resumed on the CPU the update must be the CPU's
    default one, bit for bit, not the fused CPU kernel (which rounds differently)."""
    model = _model()
    optim = Optimization(model, CFG, fp16=False, frozen=None, device_type="cpu")
    for s in range(3):
        _step(model, optim, s)
    saved_weights = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(optim.state_dict())
    from_gpu = copy.deepcopy(saved)
    for group in from_gpu["optimizer"]["param_groups"]:
        group["fused"] = True  # what a GPU run's checkpoint holds

    results = []
    for state in (saved, from_gpu):
        model.load_state_dict(saved_weights)
        resumed = Optimization(model, CFG, fp16=False, frozen=None, device_type="cpu")
        resumed.load_state_dict(state)
        assert all(g["fused"] is None for g in resumed.optimizer.param_groups)
        for s in range(3, 8):
            _step(model, resumed, s)
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    differing = [k for k in results[0] if not torch.equal(results[0][k], results[1][k])]
    assert differing == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused AdamW is chosen on CUDA only")
def test_the_gpu_optimizer_is_fused_and_resumes_earlier_unfused_checkpoints():
    model = _model("cuda")
    optim = Optimization(model, CFG, fp16=False, frozen=None, device_type="cuda")
    assert optim.fused is True and all(g["fused"] for g in optim.optimizer.param_groups)
    _step(model, optim, 0)
    assert all(s["step"].device.type == "cuda" for s in optim.optimizer.state.values())
    # A checkpoint of the trainer before fused AdamW: groups say None, step counts on the CPU.
    earlier = copy.deepcopy(optim.state_dict())
    for group in earlier["optimizer"]["param_groups"]:
        group["fused"] = None
    for state in earlier["optimizer"]["state"].values():
        state["step"] = state["step"].cpu()
    resumed = Optimization(model, CFG, fp16=False, frozen=None, device_type="cuda")
    resumed.load_state_dict(earlier)
    assert all(g["fused"] for g in resumed.optimizer.param_groups)
    assert all(s["step"].device.type == "cuda" for s in resumed.optimizer.state.values())
    _step(model, resumed, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
