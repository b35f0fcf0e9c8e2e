"""How a step's gradients become an update: AdamW, its learning-rate schedule, the loss scaler
and the frozen vocabulary rows. The "optim" section of a checkpoint.

`step()` is the trainer's optimizer step, in the one order that keeps frozen rows exact:
unscale (fp16), zero the frozen rows' gradients (so they count neither in the clipping norm nor
in Adam's moments), clip, update, then write the frozen rows back (undoing AdamW's decoupled
weight decay bit for bit).
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from trainers.config.settings import TrainConfig
from trainers.model.frozen_rows import FrozenTextRows
from trainers.training.lr_schedule import WarmupCosine

log = logging.getLogger("train")


class Optimization:
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, fp16: bool, frozen: FrozenTextRows | None) -> None:
        self.optimizer, self.param_names = _adamw(model, cfg)
        self.schedule = WarmupCosine(cfg.learning_rate, cfg.warmup_steps, cfg.lr_decay_steps, cfg.min_lr_ratio)
        self.scaler = torch.amp.GradScaler("cuda", enabled=fp16)
        self.frozen = frozen
        self.grad_clip = cfg.grad_clip

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def start_step(self, step: int) -> float:
        """Set the learning rate of optimizer step `step` (0-based) and return it."""
        return self.schedule.apply(self.optimizer, step)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self) -> float:
        """Apply the accumulated gradients; returns the gradient norm before clipping.

        A non-finite norm skips the update (with fp16 the GradScaler decides that itself).
        """
        self.scaler.unscale_(self.optimizer)
        if self.frozen:
            self.frozen.zero_grads()
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if self.scaler.is_enabled() or math.isfinite(grad_norm):
            self.scaler.step(self.optimizer)
        if self.frozen:
            self.frozen.restore()
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

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

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Restore AdamW and the scaler; `step` is where training continues (for the LR comparison)."""
        self.optimizer.load_state_dict(state["optimizer"])
        if state["scaler"] and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        saved = WarmupCosine.from_state_dict(state["lr_schedule"])
        if saved != self.schedule:
            before, after = saved.lr_at(step), self.schedule.lr_at(step)
            log.warning("the learning-rate schedule differs from the saved one (%s, now %s): the learning rate of the "
                        "next step is %.4g instead of %.4g", saved, self.schedule, after, before)


def _adamw(model: torch.nn.Module, cfg: TrainConfig) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over the parameters that receive gradients; no decay on biases and norms."""
    decay, no_decay, names = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append((name, p))
    groups = []
    for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        names += [n for n, _ in params]
        groups.append({"params": [p for _, p in params], "weight_decay": wd})
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps)
    return optimizer, names
