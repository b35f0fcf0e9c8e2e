"""Keep the base vocabulary's rows of the text embedding and text head bit-identical (FrozenTextRows), or every row
of some tables but a new language's (HeldRows).

Zeroing their gradients is not enough: AdamW's decoupled weight decay shrinks every row of a
decayed matrix, and moments left from earlier updates keep moving a row after its gradient
is gone. So the trainer (1) zeroes the frozen rows' gradients after unscaling and before
clipping, so they neither move the moments nor count in the clipping norm, and (2) writes
the saved rows back after every optimizer step, which undoes the decay exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.model.gpt_model import UnifiedVoiceGPT


@dataclass
class FrozenTextRows:
    """Rows 0..base_tokens-1 (the base ids) and the last row (the extra row moved from base row Nt)."""

    base_tokens: int
    params: list[torch.nn.Parameter]
    saved_ids: list[torch.Tensor]
    saved_extra: list[torch.Tensor]

    @classmethod
    def capture(cls, model: UnifiedVoiceGPT, base_tokens: int) -> "FrozenTextRows":
        params = [model.text_embedding.weight, model.text_head.weight, model.text_head.bias]
        rows = params[0].shape[0]
        if not 0 < base_tokens < rows:
            raise ValueError(f"base vocabulary of {base_tokens} tokens does not fit a text table of {rows} rows")
        return cls(base_tokens, params, [p.detach()[:base_tokens].clone() for p in params],
                   [p.detach()[-1:].clone() for p in params])

    @property
    def rows(self) -> int:
        return self.base_tokens + 1

    def state_dict(self) -> dict[str, int]:
        # The rows' values live in the model section; which rows are frozen is the state here.
        return {"base_tokens": self.base_tokens}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        """After the model section is restored: the rows to hold are the restored model's (the base
        vocabulary's, kept exact since the run began). Which rows are frozen follows this run's vocabulary."""
        self.saved_ids = [p.detach()[: self.base_tokens].clone() for p in self.params]
        self.saved_extra = [p.detach()[-1:].clone() for p in self.params]

    def zero_grads(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad[: self.base_tokens].zero_()
                p.grad[-1:].zero_()

    @torch.no_grad()
    def restore(self) -> None:
        for p, ids, extra in zip(self.params, self.saved_ids, self.saved_extra):
            p[: self.base_tokens].copy_(ids)
            p[-1:].copy_(extra)


@dataclass
class HeldRows:
    """Every row of some tables held bit-identical but the rows that train: a new language's lang_embedding row and
    its <|xx|> token's text rows (IndexTTS-2.5, --new-language), in the order FrozenTextRows keeps (gradients
    zeroed before clipping, the saved rows written back after each update). Masks and whole-table copies, not
    index copies: elementwise, so deterministic on every device."""

    names: list[str]
    params: list[torch.nn.Parameter]
    trained: list[list[int]]  # per table, the rows that train
    held: list[torch.Tensor]  # per table, a bool mask over its rows, shaped to broadcast over the table
    saved: list[torch.Tensor]

    @classmethod
    def capture(cls, model: torch.nn.Module, trained: dict[str, list[int]]) -> "HeldRows":
        names = list(trained)
        params = [model.get_parameter(name) for name in names]
        held = []
        for name, p in zip(names, params):
            mask = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
            rows = trained[name]
            if any(not 0 <= r < p.shape[0] for r in rows):
                raise ValueError(f"rows {rows} do not fit {name} of {p.shape[0]} rows")
            mask[rows] = False
            held.append(mask.view(-1, *([1] * (p.dim() - 1))))
        return cls(names, params, [list(trained[n]) for n in names], held, [p.detach().clone() for p in params])

    def parts(self) -> list[str]:
        """The rows that train, a table each: 'lang_embedding.weight[9, 99]'."""
        return [f"{name}{rows}" for name, rows in zip(self.names, self.trained)]

    def state_dict(self) -> dict[str, dict[str, list[int]]]:
        # The rows' values live in the model section; which rows train is the state here.
        return {"trained_rows": dict(zip(self.names, self.trained))}

    def load_state_dict(self, state: dict | None) -> None:
        """After the model section is restored: the rows to hold are the restored model's."""
        self.saved = [p.detach().clone() for p in self.params]

    def zero_grads(self) -> None:
        for p, held in zip(self.params, self.held):
            if p.grad is not None:
                p.grad.masked_fill_(held, 0)

    @torch.no_grad()
    def restore(self) -> None:
        for p, held, saved in zip(self.params, self.held, self.saved):
            p.copy_(torch.where(held, saved, p))
