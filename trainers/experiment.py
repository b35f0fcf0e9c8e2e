"""A small Python API for notebooks and scripts over the code the command line runs.

    from trainers.experiment import ExperimentManager
    exp = ExperimentManager.load("runs/my_voice")
    exp.history["val"]                       # validation metrics per step
    exp.forgetting["val"]                    # per validation language: the change from the base model's figures
    exp.metadata["resumes"]                  # every start and resume: when, where, what changed
    exp.resume_training()                    # continue the original plan, exactly
    exp.resume_training(num_epochs=10)       # 10 more epochs of data from here
    exp.resume_training(batch_size=64, scale_lr="linear", reconfigure_scheduler=True)
    exp.resume_training(train_samples=50_000)
    best = ExperimentManager.load_best_model("runs/my_voice")
    best.evaluate("data/test_pairs.jsonl")   # {"text_loss", "mel_loss", "mel_top1", "samples"}

`resume_training` builds the flags of the equivalent command and runs the trainer's own
`main()` in this process, so the API and the command line train identically (nothing is
trained twice, there is no second loop); it returns the trainer's exit status. Each keyword has
the meaning of its flag: num_epochs -> --additional-epochs, batch_size -> --effective-batch
(with --allow-config-change), scale_lr -> --scale-lr, reconfigure_scheduler ->
--reconfigure-scheduler, train_samples -> --train-samples (with --allow-config-change); further
flags can be passed as extra_flags.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from trainers.checkpoint import schema
from trainers.checkpoint.step_files import CheckpointManager
from trainers.config.settings import TrainConfig, saved_settings
from trainers.data.data_order import StepPlan
from trainers.data.features import FeatureDataset
from trainers.data.loader import StepLoader
from trainers.data.manifest import ManifestError, load_manifests, parse_manifest_spec
from trainers.errors import UserError
from trainers.families import FAMILIES, ModelFamily, family_named
from trainers.main import main
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.weights import GPTWeights
from trainers.checkpoint.lora_export import merged_state
from trainers.training.evaluation import batch_loss_sums
from trainers.training.train_log import StepMetrics

log = logging.getLogger("train")


class ExperimentManager:
    """One run directory: its settings, history and checkpoints, and ways to continue it."""

    def __init__(self, run_dir: Path, checkpoint: schema.Checkpoint) -> None:
        self.run_dir = Path(run_dir)
        self.checkpoint = checkpoint

    @classmethod
    def load(cls, run_dir: str | Path) -> "ExperimentManager":
        run_dir = Path(run_dir)
        newest = CheckpointManager(run_dir, keep=0).find_resume() if run_dir.is_dir() else None
        if newest is None:
            raise UserError(f"{run_dir} holds no checkpoint of this trainer")
        return cls(run_dir, schema.read(newest, mmap=True))  # metadata only: tensors stay on disk

    @property
    def config(self) -> TrainConfig:
        return TrainConfig.from_dict(saved_settings(self.checkpoint.settings))

    @property
    def history(self) -> dict[str, list[dict[str, Any]]]:
        """The run's history by kind: "train" (per log interval), "val", "resumes" (starts and resumes)."""
        entries = self.checkpoint.history
        return {"train": [e for e in entries if e["kind"] == "train"], "val": [e for e in entries if e["kind"] == "val"],
                "resumes": [e for e in entries if e["kind"] in ("start", "resume")]}

    @property
    def forgetting(self) -> dict[str, Any]:
        """The forgetting measure: "base", each validation language's base figures ({"step", metric: value});
        "val", per validation {"step", "langs": {language: {"base_step", metric: change, metric_rel: relative
        change}}, "guard": the --forgetting-limit verdict or None} (trainers/training/forgetting.py)."""
        state = self.checkpoint.forgetting or {}
        return {"base": {k: dict(v) for k, v in (state.get("base") or {}).items()},
                "val": [{"step": e["step"], "langs": e["forgetting"], "guard": e.get("forgetting_guard")}
                        for e in self.history["val"] if "forgetting" in e]}

    @property
    def metadata(self) -> dict[str, Any]:
        c = self.checkpoint
        return {"run_id": c.run_id, "step": c.step, "epoch": c.epoch, "settings": c.settings,
                "model_config": c.model_config, "fingerprints": c.fingerprints,
                "vocab": {"text_tokens": c.text_tokens, "base_text_tokens": c.base_text_tokens},
                "versions": c.versions, "machine": c.machine, "best": c.best, "resumes": self.history["resumes"],
                "lora": c.lora}  # a LoRA run's adapter settings and base; None for full fine-tuning

    @property
    def checkpoints(self) -> list[Path]:
        files = CheckpointManager(self.run_dir, keep=0)
        found = [path for _, path in files.step_files()]
        return found + [p for p in (files.latest_path(), files.best_path()) if p.exists()]

    def resume_training(self, num_epochs: int | None = None, batch_size: int | None = None,
                        scale_lr: str | None = None, reconfigure_scheduler: bool = False,
                        train_samples: int | None = None, extra_flags: Sequence[str] = ()) -> int:
        """Continue the run through the trainer's own main(); returns its exit status (0: finished)."""
        argv = ["--resume", "auto", "--output-dir", str(self.run_dir)]
        if num_epochs is not None:
            argv += ["--additional-epochs", str(num_epochs)]
        changes = False
        if batch_size is not None and batch_size != self.config.effective_batch:
            argv += ["--effective-batch", str(batch_size)]
            changes = True
        if scale_lr is not None:
            argv += ["--scale-lr", scale_lr]
        if reconfigure_scheduler:
            argv += ["--reconfigure-scheduler"]
        if train_samples is not None and train_samples != self.config.train_samples:
            argv += ["--train-samples", str(train_samples)]
            changes = True
        if changes:
            argv += ["--allow-config-change"]
        status = main([*argv, *extra_flags])
        newest = CheckpointManager(self.run_dir, keep=0).find_resume()
        if newest is not None:
            self.checkpoint = schema.read(newest, mmap=True)
        return status

    @staticmethod
    def load_best_model(run_dir: str | Path, device: str = "cpu") -> "LoadedModel":
        """The model of best.pth (the newest checkpoint if the run never validated), in eval mode, with its tokenizer."""
        files = CheckpointManager(Path(run_dir), keep=0)
        path = files.best_path() if files.best_path().is_file() else files.find_resume()
        if path is None:
            raise UserError(f"{run_dir} holds no checkpoint of this trainer")
        ckpt = schema.read(path)
        family = family_named(ckpt.model_family, str(path))
        gpt = family.config(**ckpt.model_config)
        model = family.build_model(gpt)
        # A LoRA checkpoint holds adapters only: its model is the base it names with them merged (same logits).
        GPTWeights(model, {}, layout=family.layout).load_state_dict(
            merged_state(ckpt, path, None) if ckpt.lora else ckpt.model, path)
        tokenizer = family.tokenizer.load(str(ckpt.settings["tokenizer"]))
        return LoadedModel(model.to(device).eval(), tokenizer, gpt, ckpt.step, path, torch.device(device), family)


@dataclass
class LoadedModel:
    model: UnifiedVoiceGPT
    tokenizer: Any  # the family's tokenizer object (IndexTTS2: sentencepiece.SentencePieceProcessor)
    config: GPTConfig
    step: int
    path: Path
    device: torch.device
    family: ModelFamily = FAMILIES["indextts2"]

    def evaluate(self, manifest: str | Path, batch_size: int = 8) -> dict[str, float]:
        """Text and mel loss and mel top-1 accuracy on a manifest, as validation computes them."""
        limits = self.family.data_limits(self.config)
        try:
            samples = load_manifests([parse_manifest_spec(str(manifest))], limits, flag="manifest")
        except ManifestError as exc:
            raise UserError(f"{manifest} has problems:\n{exc}") from None
        dataset = FeatureDataset(samples, self.family.feature_spec(self.config))
        chunks = [list(range(i, min(i + batch_size, len(samples)))) for i in range(0, len(samples), batch_size)]
        metrics = StepMetrics()
        for batch in StepLoader(dataset, workers=0, pin_memory=False, seed=0).batches([StepPlan(0, 0, chunks)]):
            metrics.add(batch_loss_sums(self.model, batch, self.device, None), len(batch.ids))
        return {**metrics.means(), "samples": metrics.samples}
