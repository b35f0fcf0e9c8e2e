"""Building the run's components from its resolved configuration."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainers.data.features import FeatureDataset, FeatureSpec
from trainers.data.train_data import TrainData
from trainers.model.frozen_rows import FrozenTextRows
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.model.weights import GPTWeights, load_base_weights
from trainers.run.inputs import RunInputs
from trainers.run.resolve import RunConfig
from trainers.training.lr_schedule import LRSchedule
from trainers.training.optimization import Optimization

log = logging.getLogger("train")


def build_weights(cfg: RunConfig, inputs: RunInputs, resuming: bool, device: torch.device) -> GPTWeights:
    """The model, on `device`: with the base checkpoint's weights at step 0; a resume loads its own
    (trainers/run/resume.py restore)."""
    model = UnifiedVoiceGPT(cfg.gpt, gradient_checkpointing=cfg.settings.grad_checkpointing,
                            dropout_masks=cfg.settings.dropout_masks, deterministic_loss=cfg.settings.deterministic)
    weights = GPTWeights(model, {})
    if inputs.base_state is not None and not resuming:
        base = load_base_weights(Path(cfg.settings.base_checkpoint), model, inputs.base_state)
        weights.carried = base.carried
        log.info("loaded --base-checkpoint %s: %d tensors carried unchanged, %d dropped", cfg.settings.base_checkpoint,
                 len(base.carried), len(base.dropped))
    elif not resuming:
        log.warning("no --base-checkpoint: training from random weights; saved checkpoints will lack the "
                    "conditioning encoders that inference needs")
    model.to(device)
    return weights


def build_optimization(cfg: RunConfig, weights: GPTWeights, amp_dtype: torch.dtype | None, device: torch.device,
                       schedule: LRSchedule) -> Optimization:
    frozen = FrozenTextRows.capture(weights.model, cfg.vocab.base_text_tokens) if cfg.settings.freeze_base_vocab \
        else None
    return Optimization(weights.model, cfg.settings, amp_dtype == torch.float16, frozen, device.type, schedule)


def build_data(cfg: RunConfig, inputs: RunInputs) -> tuple[TrainData, FeatureDataset | None]:
    spec = FeatureSpec(cfg.gpt.model_dim, cfg.gpt.number_text_tokens, cfg.gpt.start_mel_token)
    train = TrainData(inputs.train_samples, spec, cfg.settings.seed, cfg.settings.effective_batch,
                      grouped=cfg.settings.data_order == "grouped", train_samples=cfg.settings.train_samples)
    val = FeatureDataset(inputs.val_samples, spec) if inputs.val_samples else None
    return train, val
