"""How a step's gradients become an update: AdamW, its learning-rate schedule, the loss scaler
and the frozen vocabulary rows. The "optim" section of a checkpoint.

`prepare()` then `apply()` is the trainer's optimizer step, in the one order that keeps frozen
rows exact: unscale (fp16), zero the frozen rows' gradients (so they count neither in the
clipping norm nor in Adam's moments), clip, update, then write the frozen rows back (undoing
AdamW's decoupled weight decay bit for bit). `prepare()` changes no weight, so an out-of-memory
error in it can be recovered from like one in forward/backward.

The learning-rate schedule is decided before the model exists (trainers/run/schedule.py: the
saved one, a changed one or a continuation) and handed to the constructor; without one (tests,
a fresh optimizer) the configured schedule is built here. Either way it is built once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trainers.config.settings import TrainConfig
from trainers.model.frozen_rows import FrozenTextRows, HeldRows
from trainers.model.weights import first_non_finite
from trainers.training.lr_schedule import LRSchedule, WarmupCosine


def configured_schedule(cfg: TrainConfig) -> LRSchedule:
    return LRSchedule(WarmupCosine(cfg.learning_rate, cfg.warmup_steps, cfg.lr_decay_steps, cfg.min_lr_ratio))


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # before clipping; inf/nan when the gradients overflowed
    applied: bool  # False: the update was skipped (non-finite gradients), the weights are unchanged


# AdamW's hyperparameters that come from the run's settings (the learning rate is set by the schedule every step,
# times a group's lr_scale).
_CONFIGURED = ("weight_decay", "betas", "eps", "lr_scale")


class Optimization:
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, fp16: bool, frozen: FrozenTextRows | HeldRows | None,
                 device_type: str = "cuda", schedule: LRSchedule | None = None,
                 scaled: frozenset[str] = frozenset(), fused: bool | None = None) -> None:
        """`scaled`: the parameters whose learning rate is cfg.new_rows_lr_scale times the run's (tables whose rows
        are partly held: only their trained rows move). `fused`: AdamW's fused kernels (None: where every trained
        parameter is on a GPU, see `_wants_fused`)."""
        self.optimizer, self.param_names, self.fused = _adamw(model, cfg, scaled, fused)
        self._configured = [{k: g[k] for k in _CONFIGURED if k in g} for g in self.optimizer.param_groups]
        self.schedule = schedule if schedule is not None else configured_schedule(cfg)
        self.scaler = torch.amp.GradScaler(device_type, enabled=fp16)
        self.frozen = frozen
        self.grad_clip = cfg.grad_clip

    @property
    def fp16(self) -> bool:
        """Gradients are scaled (fp16 autocast): the scaler skips the updates whose gradients overflowed."""
        return self.scaler.is_enabled()

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale()

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def start_step(self, step: int) -> float:
        """Set the learning rate of optimizer step `step` (0-based) and return it."""
        return self.schedule.apply(self.optimizer, step)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def prepare(self) -> float:
        """Unscale, drop the frozen rows' gradients, clip; returns the norm before clipping. Changes no weight."""
        self.scaler.unscale_(self.optimizer)
        if self.frozen:
            self.frozen.zero_grads()
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def apply(self, grad_norm: float) -> StepResult:
        """Update the weights from prepared gradients (skipped when they are not finite)."""
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        if self.scaler.is_enabled() or math.isfinite(grad_norm):
            self.scaler.step(self.optimizer)  # skips the update itself when fp16 gradients overflowed
        if self.frozen:
            self.frozen.restore()
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        # The scaler lowers its scale exactly when it skipped the update.
        applied = self.scaler.get_scale() >= scale if self.scaler.is_enabled() else math.isfinite(grad_norm)
        return StepResult(grad_norm, applied)

    def non_finite(self) -> str | None:
        """The first optimizer state tensor holding a NaN or inf, e.g. "gpt.h.0.ln_1.weight.exp_avg"."""
        names = dict(zip(map(id, self.params), self.param_names))
        return first_non_finite((f"{names.get(id(p), '?')}.{k}", v) for p, state in self.optimizer.state.items()
                                for k, v in state.items() if isinstance(v, torch.Tensor))

    def state_sizes_to_come(self) -> list[tuple[int, torch.device]]:
        """(bytes, device) of the state AdamW creates at its first step for parameters that have none yet: exp_avg
        and exp_avg_sq shaped like the parameter, and a float32 step count on the CPU. For sizing host buffers
        before that step."""
        cpu = torch.device("cpu")
        return [size for p in self.params if not self.optimizer.state.get(p)
                for size in ((p.numel() * p.element_size(), p.device), (p.numel() * p.element_size(), p.device),
                             (4, p.device if self.fused else cpu))]

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "param_shapes": [[n, list(p.shape)] for n, p in zip(self.param_names, self.params)],
            "lr_schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "frozen_rows": self.frozen.state_dict() if self.frozen else None,
        }

    def resume_problems(self, state: dict[str, Any]) -> list[str]:
        """What really differs between a saved optimizer and this run's trainable parameters."""
        saved = [[n, list(s)] for n, s in state["param_shapes"]]
        now = [[n, list(p.shape)] for n, p in zip(self.param_names, self.params)]
        if saved == now:
            return []
        saved_names, now_names = {n for n, _ in saved}, {n for n, _ in now}
        problems = [f"optimizer has state for {n}, which is not trained now" for n in sorted(saved_names - now_names)]
        problems += [f"{n} is trained now but has no optimizer state" for n in sorted(now_names - saved_names)]
        shapes = {n: s for n, s in saved}
        problems += [f"{n}: optimizer state shape {shapes[n]}, parameter {s}" for n, s in now
                     if n in shapes and shapes[n] != s]
        return problems or ["optimizer parameter order differs from the checkpoint"]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore AdamW and the scaler where the saved state fits these parameters (where it does not, the
        caller has refused, or warned under --force-resume, and the optimizer starts fresh); take the frozen
        rows from the model, restored before this section. The saved schedule was read when the run was
        planned, before the model was built (trainers/run/schedule.py), and given to the constructor."""
        if not self.resume_problems(state):
            self.optimizer.load_state_dict(state["optimizer"])
            self._keep_own_kernels()
            self._keep_configured_hyperparameters()
            if state["scaler"] and self.scaler.is_enabled():
                self.scaler.load_state_dict(state["scaler"])
        if self.frozen:
            self.frozen.load_state_dict(state["frozen_rows"])


    def _keep_configured_hyperparameters(self) -> None:
        """AdamW's load_state_dict also takes weight decay, betas and eps from the saved groups: a change accepted
        on resume (--weight-decay X --allow-config-change) was recorded and logged but never trained with. The
        run's resolved settings are the saved ones unless such a change was accepted, so this run's values stay."""
        for group, configured in zip(self.optimizer.param_groups, self._configured):
            group.update(configured)

    def _keep_own_kernels(self) -> None:
        """AdamW's load_state_dict takes `fused` from the saved groups: a GPU run's checkpoint resumed on the CPU
        would run the fused CPU kernels (other rounding than a CPU run), an earlier GPU checkpoint would drop them.
        This machine's choice stays, with each step count where its kernels keep it (fused: on the parameter's
        device; otherwise on the CPU, where reading it costs no synchronisation)."""
        for group in self.optimizer.param_groups:
            if bool(group.get("fused")) == self.fused:
                continue
            group["fused"] = True if self.fused else None
            for p in group["params"]:
                step = self.optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    self.optimizer.state[p]["step"] = step.to(p.device if self.fused else "cpu", torch.float32)


def _wants_fused(params: list[torch.nn.Parameter]) -> bool:
    """Fused AdamW (one kernel launch per group of tensors instead of a dozen passes) where every trained
    parameter is on a GPU. Never on the CPU: its fused kernel rounds differently from the default, and CPU runs
    must keep their results bit for bit."""
    return bool(params) and all(p.device.type == "cuda" for p in params)


def _adamw(model: torch.nn.Module, cfg: TrainConfig, scaled: frozenset[str] = frozenset(),
           fused: bool | None = None) -> tuple[torch.optim.AdamW, list[str], bool]:
    """AdamW over the parameters that receive gradients; no decay on biases and norms. The `scaled` ones, when
    cfg.new_rows_lr_scale is not 1, in groups of their own after those, whose rate the schedule multiplies
    (LRSchedule.apply: the group's lr_scale). Returns it, the parameters' names and whether it is fused."""
    scale = cfg.new_rows_lr_scale
    # The trained parameters by (decayed, scaled), in the groups' order.
    parts: dict[tuple[bool, bool], list[tuple[str, torch.nn.Parameter]]] = {
        (True, False): [], (False, False): [], (True, True): [], (False, True): []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            parts[(p.dim() >= 2, name in scaled and scale != 1.0)].append((name, p))
    groups, names = [], []
    for (decays, alone), part in parts.items():
        if part or not alone:
            names += [n for n, _ in part]
            group = {"params": [p for _, p in part], "weight_decay": cfg.weight_decay if decays else 0.0}
            groups.append({**group, "lr_scale": scale} if alone else group)
    if fused is None:
        fused = _wants_fused([p for g in groups for p in g["params"]])
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps, **({"fused": True} if fused else {}))
    return optimizer, names, fused
