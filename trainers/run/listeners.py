"""The run's validation listeners, in their order (trainers/training/validation_listeners.py): what generates
first, what judges next, best.pth and early stopping last. A new listener is one more entry here."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from trainers.config.settings import TrainConfig
from trainers.run.validation_generation import ValidationGeneration
from trainers.training.best_checkpoint import BestCheckpoint, EarlyStopping
from trainers.training.ema import WeightsEMA
from trainers.training.forgetting import Forgetting, Guard
from trainers.training.validation_listeners import Listeners


def run_listeners(settings: TrainConfig, run_dir: Path, model: Any, val_loader: Any, hardware: Any, world: Any,
                  replayed: tuple[str, ...]) -> Listeners:
    """`replayed`: the languages of the replay manifests (the forgetting guard's base languages by default)."""
    generation = ValidationGeneration.for_run(settings, run_dir, val_loader, model, hardware, world)
    best = BestCheckpoint(settings.best_metric)
    return Listeners([
        *([generation] if generation else []),
        *([WeightsEMA(model, settings.ema_decay, settings.ema_start)] if settings.ema_decay else []),
        Forgetting(guard=Guard.of(settings, replayed), best_metric=settings.best_metric),
        best,
        EarlyStopping(settings.early_stop_patience, best),
    ])
