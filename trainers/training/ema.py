"""--ema-decay: an exponential moving average (EMA) of the trained weights, a validation listener
(trainers/training/validation_listeners.py).

The averages are fp32 tensors beside the trained parameters, on their device (under LoRA the adapters: what the
run trains). After optimizer step s they are the weights while s <= --ema-start, then average + (1 - decay) x
(weights - average) (torch.lerp). Every validation also validates them in the weights' place, as ema/text_loss,
ema/mel_loss and ema/mel_top1 (ema/LANG/... per language), which --best-metric and --forgetting-metric may name;
while they are the weights, the weights' figures are theirs. They are saved under "ema" in the checkpoint's
progress section, so a resume goes on from them bit for bit, and `indextts-export --ema` exports them. The
processes of a torchrun job hold the same weights, so the same averages. Costs: one fp32 copy of the trained
parameters in memory and in each checkpoint; a pass over them per optimizer step; a second loss pass per validation.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from trainers.checkpoint import schema
from trainers.errors import UserError
from trainers.training.generation_metrics import NO_LANGUAGE
from trainers.training.validation_listeners import Validation, ValidationListener

NAME = "ema"


class WeightsEMA(ValidationListener):
    key = NAME

    def __init__(self, model: torch.nn.Module, decay: float, start: int) -> None:
        self.decay, self.start = decay, start
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.averages = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.step = 0  # of the last weights averaged; up to `start` the averages are the weights

    @torch.no_grad()
    def step_done(self, step: int) -> None:
        weights, averages = [p.detach() for p in self.params.values()], list(self.averages.values())
        if step <= self.start:
            torch._foreach_copy_(averages, weights)
        else:
            torch._foreach_lerp_(averages, weights, 1.0 - self.decay)
        self.step = step

    def validated(self, v: Validation) -> None:
        if self.step > self.start:
            with self.in_place_of_the_weights():
                by_lang = v.again()
        else:
            by_lang = v.by_lang
        v.means.update({f"{NAME}/{k}": x for k, x in v.log.validation(v.step, by_lang, NAME).items()})
        if len(by_lang) > 1:
            v.means.update({f"{NAME}/{lang or NO_LANGUAGE}/{k}": x for lang, m in by_lang.items()
                            for k, x in m.means().items()})

    @contextmanager
    def in_place_of_the_weights(self) -> Iterator[None]:
        """The parameters hold the averages (their storage swapped, nothing copied), then their weights again."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        for name, p in self.params.items():
            p.data, self.averages[name] = self.averages[name], p.data

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "weights": {n: a.detach() for n, a in self.averages.items()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """None: a checkpoint without them (the EMA turned on at this resume): they start from its weights."""
        saved = state["weights"] if state else {n: p.detach() for n, p in self.params.items()}
        for name, average in self.averages.items():
            average.copy_(saved[name])
        self.step = int(state["step"]) if state else 0


def with_averages(ckpt: schema.Checkpoint | None, path: Path) -> schema.Checkpoint:
    """The checkpoint with the EMA of its trained tensors in their place (`indextts-export --ema`)."""
    state = ckpt.section("progress").get(NAME) if ckpt is not None else None
    if state is None:
        raise UserError(f"--ema: {path} holds no moving average of its weights; it was trained without --ema-decay")
    averages = state["weights"]
    model = {k: averages[k].to(v.dtype) if k in averages else v for k, v in ckpt.model.items()}
    return replace(ckpt, sections={**ckpt.sections, "model": model})
