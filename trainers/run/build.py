"""Building the run's components from its resolved configuration."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainers.data.features import FeatureDataset
from trainers.data.train_data import TrainData
from trainers.model.frozen_rows import FrozenTextRows, HeldRows
from trainers.config.settings import TrainConfig
from trainers.model.lora import LoraSettings, add_adapters, is_adapter_key
from trainers.model.weights import GPTWeights, load_base_weights
from trainers.run.inputs import RunInputs
from trainers.run.run_dir import RunConfig
from trainers.training.lr_schedule import LRSchedule
from trainers.training.optimization import Optimization

log = logging.getLogger("train")


def build_weights(cfg: RunConfig, inputs: RunInputs, resuming: bool, device: torch.device) -> GPTWeights:
    """The model, on `device`: with the base checkpoint's weights at step 0; a resume loads its own
    (trainers/run/resume.py restore). A LoRA run loads the base on resume too: its checkpoints hold
    only what it trains (add_lora)."""
    # Random initial weights (no base) come from --seed alone, so two starts with the same flags begin alike; the
    # process's own generators are left as they were (forked).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.settings.seed)
        model = cfg.family.build_model(cfg.gpt, gradient_checkpointing=cfg.settings.grad_checkpointing,
                                       dropout_masks=cfg.settings.dropout_masks,
                                       deterministic_loss=cfg.settings.deterministic)
    weights = GPTWeights(model, {}, layout=cfg.family.layout)
    lora = lora_settings(cfg.settings)
    if inputs.base_state is not None and (not resuming or lora):
        base = load_base_weights(Path(cfg.settings.base_checkpoint), model, inputs.base_state, cfg.family.layout)
        weights.carried = base.carried
        log.info("loaded --base-checkpoint %s: %d tensors carried, %d dropped", cfg.settings.base_checkpoint,
                 len(base.carried), len(base.dropped))
    elif not resuming:
        log.warning("no --base-checkpoint: training from random weights; the checkpoints will lack the")
        log.warning("conditioning encoders that inference needs (pass --base-checkpoint gpt.pth for those)")
    if lora:
        add_lora(weights, lora, cfg)
    model.to(device)
    return weights


def lora_settings(settings: TrainConfig) -> LoraSettings | None:
    """The run's adapters (None: full fine-tuning)."""
    if not settings.lora_rank:
        return None
    assert settings.lora_alpha is not None  # resolved to 2 x rank (trainers/run/resolve.py)
    return LoraSettings(settings.lora_rank, settings.lora_alpha, settings.lora_targets, settings.lora_dropout)


def add_lora(weights: GPTWeights, lora: LoraSettings, cfg: RunConfig) -> None:
    """Adapters on the loaded base (lora_a drawn from the run seed, lora_b zero), and what trains beside them.

    Trains: the adapters; with a tokenizer that extends the base vocabulary, also text_embedding and
    text_head whole, with the base rows held bit-identical by FrozenTextRows (--freeze-base-vocab, on by
    default then): a new language's tokens have no base rows for an adapter to adjust, so their rows must
    be learnt directly. Frozen: everything else, norms and conditioning included, so the base stays
    exact, one base serves many adapters, and merging folds the adapters in with nothing else to carry.
    Checkpoints hold exactly the trained tensors (GPTWeights.trained_keys), never a copy of the base.
    """
    adapted = add_adapters(weights.model, lora, cfg.settings.seed)
    adapters = [k for k, _ in weights.model.named_parameters() if is_adapter_key(k)]
    tables = list(weights.layout.text_row_keys) if cfg.vocab.extended else list(held_rows(cfg) or {})
    for key in tables:
        weights.model.get_parameter(key).requires_grad_(True)
    weights.trained_keys = (*adapters, *tables)
    log.info("LoRA: rank %d, alpha %g (scale %g), adapter dropout %g", lora.rank, lora.alpha, lora.scale, lora.dropout)
    log.info("LoRA: %d projections adapted (%s); the base weights are frozen", len(adapted), ",".join(lora.targets))
    if cfg.vocab.extended:
        log.info("LoRA: text_embedding and text_head train (their base rows held exact)")
    elif tables:
        log.info("LoRA: %s train", ", ".join(tables))
        log.info("LoRA: all their rows but those of --new-language are held exact")


def held_rows(cfg: RunConfig) -> dict[str, list[int]] | None:
    """--new-language: the rows that train, by table (every other row of those tables held); None without it."""
    if not cfg.settings.new_languages or cfg.family.language_rows is None:
        return None
    return cfg.family.language_rows(cfg.gpt.number_text_tokens, cfg.settings.new_languages)


def build_optimization(cfg: RunConfig, weights: GPTWeights, amp_dtype: torch.dtype | None, device: torch.device,
                       schedule: LRSchedule) -> Optimization:
    held = held_rows(cfg)
    if held:
        frozen: FrozenTextRows | HeldRows | None = HeldRows.capture(weights.model, held)
        scaled = frozenset(held)
    elif cfg.settings.freeze_base_vocab:
        frozen, scaled = FrozenTextRows.capture(weights.model, cfg.vocab.base_text_tokens), frozenset(
            weights.layout.text_row_keys)
    else:
        frozen, scaled = None, frozenset()
    return Optimization(weights.model, cfg.settings, amp_dtype == torch.float16, frozen, device.type, schedule,
                        scaled)


def build_data(cfg: RunConfig, inputs: RunInputs) -> tuple[TrainData, FeatureDataset | None]:
    spec = cfg.family.feature_spec(cfg.gpt)
    train = TrainData(inputs.train_samples, spec, cfg.settings.seed, cfg.settings.effective_batch,
                      grouped=cfg.settings.data_order == "grouped", train_samples=cfg.settings.train_samples,
                      mixing=inputs.mixing)
    val = FeatureDataset(inputs.val_samples, spec) if inputs.val_samples else None
    return train, val
