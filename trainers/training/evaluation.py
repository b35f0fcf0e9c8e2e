"""The summed losses of a batch without gradients: what validation reports, in the trainer and in the
experiment API alike."""
from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

from trainers.data.features import Batch
from trainers.model.gpt_model import UnifiedVoiceGPT, packed_length


def autocast_for(device: torch.device, amp_dtype: torch.dtype | None) -> ContextManager:
    return nullcontext() if amp_dtype is None else torch.autocast(device_type=device.type, dtype=amp_dtype)


@torch.no_grad()
def batch_loss_sums(model: UnifiedVoiceGPT, batch: Batch, device: torch.device,
                    amp_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Summed text/mel cross-entropies, token counts and correct mel predictions of one batch."""
    packed_len = packed_length(batch.text_lens, batch.code_lens, model.prefix_len)  # from the host copy: no sync
    batch = batch.to(device, non_blocking=True)
    with autocast_for(device, amp_dtype):
        return model.loss_sums(**batch.inputs, packed_len=packed_len)
