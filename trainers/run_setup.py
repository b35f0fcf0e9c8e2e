"""Everything before the first step: settings, data, model, optimizer, and the resume checks.

`setup_run` returns a `Run` that the training loop uses as it is. All checks that can fail
on the user's input run here, before any work is done, so a bad flag or manifest costs
seconds, not hours, and never touches an existing run directory's checkpoints.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from trainers.model.weights import load_base_weights
from trainers.hardware.batch_probe import ProbeCache, ProbeKey, largest_fitting, model_fits
from trainers.checkpoint.files import CheckpointError, CheckpointManager, load_checkpoint
from trainers.data.data_order import DataOrder, Position
from trainers.model.demo_base import ensure_demo_base
from trainers.data.demo_data import DemoCorpusSpec, ensure_demo_assets
from trainers.training.faults import OomInjector
from trainers.data.features import FeatureDataset, FeatureSpec
from trainers.model.frozen_rows import FrozenTextRows
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT, split_state_dict
from trainers.hardware.detect import (
    CPU_MICRO_BATCH, BatchSplit, Hardware, amp_dtype, auto_workers, choose_split, detect_hardware,
    make_deterministic, pick_device, split_for,
)
from trainers.training.lr_schedule import WarmupCosine
from trainers.data.manifest import DataLimits, ManifestError, Sample, load_manifests, manifests_fingerprint, parse_manifest_spec
from trainers.config.settings import CommandLine, TrainConfig, UserError, compare, resolve, save_run_config
from trainers.training.rng import (
    CHECKPOINT_FORMAT, dict_sha256, file_sha256, library_versions, restore_rng_state,
)
from trainers.model.vocabulary import check_extends, checkpoint_text_tokens, tokenizer_size

log = logging.getLogger("train")

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIG_NAME = "run_config.json"


@dataclass
class Run:
    cfg: TrainConfig
    gpt_cfg: GPTConfig
    run_dir: Path
    device: torch.device
    amp_dtype: torch.dtype | None
    model: UnifiedVoiceGPT
    carried: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    param_names: list[str]
    schedule: WarmupCosine
    scaler: torch.amp.GradScaler
    train_samples: list[Sample]
    val_samples: list[Sample]
    train_set: FeatureDataset
    val_set: FeatureDataset | None
    order: DataOrder
    checkpoints: CheckpointManager
    fingerprints: dict[str, str]
    vocab: dict[str, int]
    model_yaml: dict[str, Any]
    hardware: Hardware
    split: BatchSplit  # the current micro-batch split; OOM recovery makes it smaller
    num_workers: int
    oom: OomInjector
    frozen: FrozenTextRows | None = None
    probe: tuple[ProbeCache, ProbeKey] | None = None  # where to record a micro-batch that proved too large
    val_batch: int = 0
    global_step: int = 0
    position: Position = field(default_factory=lambda: Position(0, 0))
    samples_seen: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total_steps(self) -> int:
        """Where this invocation stops: --max-steps or the end of --epochs, whichever is first."""
        return _planned_steps(self.cfg, self.order)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]


def setup_run(cmd: CommandLine) -> Run:
    run_dir, checkpoint_path = _locate_run(cmd)
    ckpt = _load_resume_checkpoint(checkpoint_path) if checkpoint_path else None
    saved = ckpt["config"] if ckpt else _config_of_unsaved_run(run_dir) if cmd.resume == "auto" else None
    cfg = resolve(cmd, saved, REPO_ROOT)
    if ckpt and "output_dir" not in cmd.given:
        cfg = TrainConfig.from_dict({**cfg.to_dict(), "output_dir": str(run_dir)})
    run_dir = Path(cfg.output_dir)
    cfg, model_yaml = _with_demo_assets(cfg, run_dir)
    model_yaml = _read_model_yaml(cfg.config) if model_yaml is None else model_yaml

    vocab_size = tokenizer_size(cfg.tokenizer)
    if ckpt and checkpoint_text_tokens(ckpt) != vocab_size:
        cfg = _weights_only_start(cmd, cfg, ckpt, checkpoint_path, vocab_size)
        ckpt = checkpoint_path = None
    gpt_cfg = _gpt_config(model_yaml, cfg, vocab_size)
    limits = DataLimits(gpt_cfg.max_text_tokens, gpt_cfg.max_mel_tokens)
    try:
        train_specs = [parse_manifest_spec(s) for s in cfg.train_manifests]
        val_specs = [parse_manifest_spec(s) for s in cfg.val_manifests]
        train_samples = load_manifests(train_specs, limits, flag="--train-manifest")
        val_samples = load_manifests(val_specs, limits, flag="--val-manifest") if val_specs else []
    except ManifestError as exc:
        raise UserError(f"the manifests have problems; nothing was trained:\n{exc}") from None
    if not val_samples:
        log.warning("no --val-manifest given: validation is skipped; pass one to track over-fitting")
    log.info("data: %d training samples from %d manifest(s), %d validation samples", len(train_samples),
             len(train_specs), len(val_samples))

    fingerprints = {
        "data": manifests_fingerprint(train_specs),
        "tokenizer": file_sha256(Path(cfg.tokenizer)),
        "model_config": dict_sha256({k: v for k, v in gpt_cfg.to_dict().items() if k != "dropout"}),
    }
    if ckpt:
        _refuse_breaking_changes(cfg, fingerprints, ckpt, cmd, checkpoint_path)
    device = pick_device(cfg.device)
    hardware = detect_hardware(device)
    amp = amp_dtype(hardware, cfg.amp)
    if cfg.deterministic:
        make_deterministic()

    model = UnifiedVoiceGPT(gpt_cfg, gradient_checkpointing=cfg.grad_checkpointing)
    if ckpt:
        carried, base_tokens = _load_model_from_checkpoint(model, ckpt, checkpoint_path)
    elif cfg.base_checkpoint:
        base = load_base_weights(Path(cfg.base_checkpoint), model)
        carried, base_tokens = base.carried, base.base_text_tokens
        log.info("loaded --base-checkpoint %s: %d tensors carried unchanged, %d dropped", cfg.base_checkpoint,
                 len(carried), len(base.dropped))
    else:
        carried, base_tokens = {}, vocab_size
        log.warning("no --base-checkpoint: training from random weights; saved checkpoints will lack the "
                    "conditioning encoders that inference needs")
    model.to(device)
    freeze = cfg.freeze_base_vocab if cfg.freeze_base_vocab is not None else vocab_size > base_tokens
    cfg = TrainConfig.from_dict({**cfg.to_dict(), "freeze_base_vocab": freeze})
    frozen = FrozenTextRows.capture(model, base_tokens) if freeze else None

    optimizer, param_names = _build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    order = DataOrder(cfg.seed, len(train_samples), cfg.effective_batch)
    decay_steps = cfg.lr_decay_steps or _planned_steps(cfg, order)
    cfg = TrainConfig.from_dict({**cfg.to_dict(), "lr_decay_steps": decay_steps})
    schedule = WarmupCosine(cfg.learning_rate, cfg.warmup_steps, decay_steps, cfg.min_lr_ratio)

    oom = OomInjector.from_env()
    split, probe = _batch_split(cfg, hardware, model, amp, train_samples, fingerprints["model_config"], run_dir, oom)
    num_workers, workers_why = (cfg.num_workers, "--num-workers") if cfg.num_workers else auto_workers(hardware)
    feature_spec = FeatureSpec(gpt_cfg.model_dim, gpt_cfg.number_text_tokens, gpt_cfg.start_mel_token)
    run = Run(
        cfg=cfg, gpt_cfg=gpt_cfg, run_dir=run_dir, device=device, amp_dtype=amp, model=model,
        carried=carried, optimizer=optimizer, param_names=param_names, schedule=schedule, scaler=scaler,
        train_samples=train_samples, val_samples=val_samples,
        train_set=FeatureDataset(train_samples, feature_spec),
        val_set=FeatureDataset(val_samples, feature_spec) if val_samples else None,
        order=order, checkpoints=CheckpointManager(run_dir, cfg.keep_checkpoints),
        fingerprints=fingerprints, vocab={"text_tokens": vocab_size, "base_text_tokens": base_tokens},
        model_yaml=model_yaml, hardware=hardware, split=split, num_workers=num_workers, oom=oom, frozen=frozen,
        probe=probe, val_batch=cfg.val_batch_size or split.micro_batch,
    )
    if ckpt:
        _restore_training_state(run, ckpt, cmd, checkpoint_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    removed = run.checkpoints.clean_stale_temporaries()
    if removed:
        log.info("removed %d unfinished checkpoint file(s) left by an interrupted save", len(removed))
    save_run_config(cfg, run_dir / RUN_CONFIG_NAME, {"fingerprints": fingerprints, "vocab": run.vocab,
                                                     "model_config": gpt_cfg.to_dict()})
    _write_model_yaml(run)
    _log_summary(run, workers_why)
    return run


# --- where the run lives ----------------------------------------------------------------------


def _locate_run(cmd: CommandLine) -> tuple[Path, Path | None]:
    """The run directory and the checkpoint to resume (None: start fresh)."""
    given_dir = cmd.given.get("output_dir")
    if cmd.resume not in (None, "auto"):
        path = Path(cmd.resume)
        if not path.is_file():
            raise UserError(f"--resume {cmd.resume}: no such file; use --resume auto to continue OUTPUT_DIR/latest.pth")
        return Path(given_dir) if given_dir else path.resolve().parent, path
    default_dir = "runs/demo" if cmd.given.get("demo") else TrainConfig.output_dir
    run_dir = Path(given_dir or os.path.abspath(default_dir))
    found = CheckpointManager(run_dir, keep=0).find_resume() if run_dir.is_dir() else None
    if cmd.resume == "auto":
        if found is None:
            log.info("--resume auto: no checkpoint in %s, starting fresh", run_dir)
        return run_dir, found
    if found is not None:
        raise UserError(
            f"{run_dir} already holds a run ({found.name}); pass --resume auto to continue it, "
            "or choose another --output-dir (nothing was changed)"
        )
    return run_dir, None


def _config_of_unsaved_run(run_dir: Path) -> dict[str, Any] | None:
    """A run killed before its first checkpoint restarts from step 0 with its saved settings."""
    path = run_dir / RUN_CONFIG_NAME
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{path} is unreadable ({exc}); pass the training flags again, or delete it") from None
    log.info("--resume auto: %s has no checkpoint yet; starting from step 0 with the settings in %s",
             run_dir, RUN_CONFIG_NAME)
    return saved


def _load_resume_checkpoint(path: Path) -> dict[str, Any]:
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    if ckpt.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a checkpoint written by this trainer (format {ckpt.get('format')!r}); "
                        "to start from an official gpt.pth use --base-checkpoint instead of --resume")
    log.info("resuming from %s (step %d, epoch %d, step %d of that epoch)", path, ckpt["step"], ckpt["epoch"],
             ckpt["step_in_epoch"])
    return ckpt


def _weights_only_start(cmd: CommandLine, cfg: TrainConfig, ckpt: dict[str, Any], path: Path,
                        vocab_size: int) -> TrainConfig:
    """A checkpoint of another vocabulary size starts a new run from its weights, at step 0.

    Its optimizer moments, schedule and data position belong to a different set of trained
    rows and a different run, so they are dropped rather than half-reused.
    """
    old = checkpoint_text_tokens(ckpt)
    run_dir = Path(cfg.output_dir)
    found = CheckpointManager(run_dir, keep=0).find_resume() if run_dir.is_dir() else None
    if found is not None:
        raise UserError(
            f"the tokenizer has {vocab_size} pieces but {path} was trained with {old} text tokens, so training starts "
            f"over at step 0 from its weights; {run_dir} already holds a run ({found.name}) that this would "
            "overwrite. Pass a new --output-dir (nothing was changed)")
    check_extends(ckpt["config"].get("tokenizer"), cfg.tokenizer, path)
    log.warning("the tokenizer has %d pieces but %s was trained with %d text tokens: starting a NEW run at step 0 "
                "from its model weights only (fresh optimizer, learning-rate schedule and loss scaler; data order from "
                "the start). If you meant to continue that run, pass the tokenizer it was trained with", vocab_size,
                path, old)
    values = {**cfg.to_dict(), "base_checkpoint": str(path)}
    for key in ("lr_decay_steps", "freeze_base_vocab"):  # re-derived for the new run unless given
        if key not in cmd.given:
            values[key] = TrainConfig.__dataclass_fields__[key].default
    return TrainConfig.from_dict(values)


def _with_demo_assets(cfg: TrainConfig, run_dir: Path) -> tuple[TrainConfig, dict[str, Any] | None]:
    """For --demo, generate (or reuse) the built-in corpus, tokenizer and base checkpoint."""
    if not cfg.demo:
        return cfg, None
    model_yaml = _read_model_yaml(cfg.config)
    if cfg.train_manifests and cfg.val_manifests and cfg.tokenizer and cfg.base_checkpoint:
        return cfg, model_yaml  # everything given (or saved): nothing to generate
    gpt = model_yaml["gpt"]
    spec = DemoCorpusSpec(model_dim=gpt["model_dim"], vocab_size=gpt["number_text_tokens"],
                          num_codes=gpt["start_mel_token"])
    assets = ensure_demo_assets(run_dir / "demo_data", spec)
    base = ensure_demo_base(run_dir / "demo_data", GPTConfig.from_yaml_section(gpt))
    values = cfg.to_dict()
    values["train_manifests"] = values["train_manifests"] or [str(assets.train_manifest)]
    values["val_manifests"] = values["val_manifests"] or [str(assets.val_manifest)]
    values["tokenizer"] = values["tokenizer"] or str(assets.tokenizer)
    values["base_checkpoint"] = values["base_checkpoint"] or str(base)
    return TrainConfig.from_dict(values), model_yaml


def _read_model_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise UserError(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--config {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpt"), dict):
        raise UserError(f"--config {path}: no 'gpt' section; pass the IndexTTS2 config.yaml")
    return data


def _gpt_config(model_yaml: dict[str, Any], cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    section = model_yaml["gpt"]
    try:
        gpt_cfg = GPTConfig.from_yaml_section(section, number_text_tokens=vocab_size, dropout=cfg.dropout)
    except (ValueError, TypeError) as exc:
        raise UserError(f"--config {cfg.config}: {exc}") from None
    configured = section.get("number_text_tokens")
    if configured is not None and configured != vocab_size:
        log.info("the tokenizer has %d pieces, --config says gpt.number_text_tokens %s: the model uses %d",
                 vocab_size, configured, vocab_size)
    return gpt_cfg


def _batch_split(cfg: TrainConfig, hw: Hardware, model: UnifiedVoiceGPT, amp: torch.dtype | None,
                 samples: list[Sample], model_fingerprint: str, run_dir: Path,
                 oom: OomInjector) -> tuple[BatchSplit, tuple[ProbeCache, ProbeKey] | None]:
    """The micro-batch split: as given, else probed on this GPU (cached per machine), else the CPU size."""
    given = choose_split(cfg.effective_batch, cfg.batch_size, cfg.grad_accumulation)
    if given is not None:
        return given, None
    if not (hw.is_cuda or oom.active):
        return split_for(cfg.effective_batch, CPU_MICRO_BATCH, f"auto: CPU, at most {CPU_MICRO_BATCH}"), None
    key = ProbeKey(hardware=hw.cache_key(), model_config=model_fingerprint, amp_dtype=str(amp),
                   grad_checkpointing=cfg.grad_checkpointing, longest_text=max(s.text_len for s in samples),
                   longest_codes=max(s.code_len for s in samples), effective_batch=cfg.effective_batch)
    cache = ProbeCache(run_dir)
    cached = cache.lookup(key)
    if cached is not None:
        return split_for(cfg.effective_batch, cached, f"auto: probed earlier on this machine, {cache.path.name}"), \
            (cache, key)
    fits = model_fits(model, hw.device, amp, key.longest_text, key.longest_codes, oom)
    micro = largest_fitting(fits, cfg.effective_batch)
    if micro == 0:
        log.warning("even a micro-batch of 1 of the longest samples (%d text, %d codes) does not fit in memory; "
                    "trying anyway. Use --grad-checkpointing, --amp, or drop the longest samples from the manifest",
                    key.longest_text, key.longest_codes)
        micro = 1
    detail = f"auto: probed on the longest samples ({key.longest_text} text, {key.longest_codes} codes)"
    cache.store(key, micro, detail)
    return split_for(cfg.effective_batch, micro, detail), (cache, key)


def _planned_steps(cfg: TrainConfig, order: DataOrder) -> int:
    by_epochs = cfg.epochs * order.steps_per_epoch
    return min(cfg.max_steps, by_epochs) if cfg.max_steps > 0 else by_epochs


# --- model and optimizer ----------------------------------------------------------------------


def _build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, list[str]]:
    """AdamW over the parameters that receive gradients; no decay on biases and norms."""
    decay, no_decay, names = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append((name, p))
    groups = []
    for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        names += [n for n, _ in params]
        groups.append({"params": [p for _, p in params], "weight_decay": wd})
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps)
    return optimizer, names


def _load_model_from_checkpoint(model: UnifiedVoiceGPT, ckpt: dict[str, Any], path: Path) -> tuple[dict, int]:
    trained, carried, _ = split_state_dict(ckpt["model"])
    own = model.state_dict()
    problems = [f"  missing: {k}" for k in sorted(set(own) - set(trained))]
    problems += [f"  {k}: checkpoint {tuple(v.shape)}, model {tuple(own[k].shape)}"
                 for k, v in sorted(trained.items()) if k in own and v.shape != own[k].shape]
    if problems:
        raise UserError("\n".join([f"{path} does not fit the model of this run:", *problems,
                                   "resume with the --config and --tokenizer the run was started with"]))
    extra = {k: trained[k] for k in set(trained) - set(own)}
    model.load_state_dict({k: trained[k] for k in own}, strict=True)
    return {**carried, **extra}, int(ckpt.get("vocab", {}).get("base_text_tokens", model.cfg.number_text_tokens))


def _refuse_breaking_changes(cfg: TrainConfig, fingerprints: dict[str, str], ckpt: dict[str, Any], cmd: CommandLine,
                             path: Path) -> None:
    """Log every difference from the saved run; stop on those that would change the result.

    Runs before the model is built, so a wrong flag costs seconds and touches nothing.
    """
    saved_cfg = TrainConfig.from_dict(ckpt["config"])
    changes = compare(saved_cfg, cfg, ckpt.get("fingerprints", {}), fingerprints)
    for change in changes:
        log.info("setting differs from the saved run: %s", change.describe())
    breaking = [c for c in changes if c.breaks_exactness]
    if breaking and not cmd.allow_config_change:
        lines = [f"resuming {path} with these changes would not reproduce the uninterrupted run:",
                 *[f"  {c.describe()}" for c in breaking]]
        if any(c.key == "tokenizer" for c in breaking):
            lines.append(
                f"  the tokenizer file differs from the one this run was trained with: the manifests' text ids and the "
                f"rows of text_embedding mean the pieces of that tokenizer, so training on with another one would "
                f"teach the model wrong text. Pass --tokenizer with the original file (the run used {saved_cfg.tokenizer})")
        if any(c.key == "effective_batch" for c in breaking):
            lines.append(
                f"  the effective batch is a hyperparameter of the run ({saved_cfg.effective_batch} samples per step); "
                "change only --batch-size or --grad-accumulation to fit other hardware, the other one is derived")
        lines.append("restore the original flags/files, or pass --allow-config-change to continue anyway")
        raise UserError("\n".join(lines))


def _restore_training_state(run: Run, ckpt: dict[str, Any], cmd: CommandLine, path: Path) -> None:
    problems = _state_problems(run, ckpt)
    if problems and not cmd.force_resume:
        raise UserError("\n".join([f"{path} fails the resume checks:", *[f"  {p}" for p in problems],
                                   "pass --force-resume to continue anyway (the result will differ)"]))
    for p in problems:
        log.warning("continuing despite a failed resume check (--force-resume): %s", p)
    if not problems:
        run.optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("scaler") and run.scaler.is_enabled():
            run.scaler.load_state_dict(ckpt["scaler"])
    restore_rng_state(ckpt["rng"])
    if ckpt.get("hardware") and ckpt["hardware"] != run.hardware.cache_key():
        log.info("hardware changed: the checkpoint was written on %s, this run is on %s; the split of each step "
                 "into micro-batches may differ, the samples of each step do not", ckpt["hardware"],
                 run.hardware.cache_key())
    run.global_step = int(ckpt["step"])
    run.position = _resume_position(ckpt, run.cfg.effective_batch).normalised(run.order.steps_per_epoch)
    run.samples_seen = int(ckpt.get("samples_seen", 0))
    run.history = list(ckpt.get("metrics", []))
    if ckpt.get("versions") != library_versions():
        log.warning("library versions differ from the saved run (%s now %s): results stay correct but may not be "
                    "bit-identical to an uninterrupted run", ckpt.get("versions"), library_versions())
    if ckpt.get("amp_dtype") != str(run.amp_dtype):
        log.info("mixed precision changed from %s to %s", ckpt.get("amp_dtype"), run.amp_dtype)


def _resume_position(ckpt: dict[str, Any], effective_batch: int) -> Position:
    """The saved position; in samples when an allowed change altered the effective batch."""
    epoch, step = int(ckpt["epoch"]), int(ckpt["step_in_epoch"])
    saved_batch = TrainConfig.from_dict(ckpt["config"]).effective_batch
    if saved_batch == effective_batch:
        return Position(epoch, step)
    samples = int(ckpt.get("samples_in_epoch", step * saved_batch))
    new_step, repeated = divmod(samples, effective_batch)
    log.warning("effective batch changed from %d to %d: resuming epoch %d at sample %d (step %d)%s", saved_batch,
                effective_batch, epoch, new_step * effective_batch, new_step,
                f"; {repeated} samples of this epoch will be seen twice" if repeated else "")
    return Position(epoch, new_step)


def _state_problems(run: Run, ckpt: dict[str, Any]) -> list[str]:
    """What really differs between the checkpoint's optimizer and this run's trainable parameters."""
    saved = ckpt.get("optimizer_params", [])
    now = [[n, list(p.shape)] for n, p in zip(run.param_names, run.trainable)]
    if [list(x) for x in saved] == now:
        return []
    saved_names = {n for n, _ in saved}
    now_names = {n for n, _ in now}
    problems = [f"optimizer has state for {n}, which is not trained now" for n in sorted(saved_names - now_names)]
    problems += [f"{n} is trained now but has no optimizer state" for n in sorted(now_names - saved_names)]
    shapes = {n: s for n, s in saved}
    problems += [f"{n}: optimizer state shape {shapes[n]}, parameter {s}" for n, s in now
                 if n in shapes and list(shapes[n]) != s]
    return problems or ["optimizer parameter order differs from the checkpoint"]


# --- files beside the checkpoints -------------------------------------------------------------


def _write_model_yaml(run: Run) -> None:
    """config.yaml for inference: the user's config with the vocabulary of this run."""
    data = dict(run.model_yaml)
    data["gpt"] = {**data["gpt"], "number_text_tokens": run.gpt_cfg.number_text_tokens}
    path = run.run_dir / "config.yaml"
    tmp = path.with_name(".config.yaml.tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tmp.replace(path)
    bpe = (data.get("dataset") or {}).get("bpe_model")
    if run.vocab["text_tokens"] > run.vocab["base_text_tokens"] and bpe and Path(bpe).name != Path(run.cfg.tokenizer).name:
        log.info("for inference, point dataset.bpe_model in %s (now %s) at the extended tokenizer %s", path, bpe,
                 run.cfg.tokenizer)


def _log_summary(run: Run, workers_why: str) -> None:
    cfg = run.cfg
    n_train = sum(p.numel() for p in run.trainable)
    log.info("model: %d layers, dim %d, %d text tokens; %.1fM trained parameters, %d carried tensors",
             run.gpt_cfg.layers, run.gpt_cfg.model_dim, run.gpt_cfg.number_text_tokens, n_train / 1e6, len(run.carried))
    if run.frozen:
        log.info("vocabulary: %d text tokens, base %d; the %d base rows of text_embedding and text_head are frozen "
                 "(--no-freeze-base-vocab trains them too)", run.vocab["text_tokens"], run.vocab["base_text_tokens"],
                 run.frozen.rows)
    elif run.vocab["text_tokens"] > run.vocab["base_text_tokens"]:
        log.info("vocabulary: %d text tokens, base %d; base rows are trained too (--no-freeze-base-vocab)",
                 run.vocab["text_tokens"], run.vocab["base_text_tokens"])
    log.info("hardware: %s", run.hardware.describe())
    log.info("batch: effective batch %d = micro-batch %d x accumulation %d (%s); %d steps per epoch",
             cfg.effective_batch, run.split.micro_batch, run.split.accumulation, run.split.reason,
             run.order.steps_per_epoch)
    amp_why = ("bf16: supported by this GPU" if run.amp_dtype == torch.bfloat16 else
               "fp16 with loss scaling: this GPU has no bf16" if run.amp_dtype == torch.float16 else
               "pass --amp for bf16/fp16 on CUDA" if run.hardware.is_cuda else "CPU")
    log.info("data workers %d (%s); amp %s (%s)", run.num_workers, workers_why,
             str(run.amp_dtype).replace("torch.", "") if run.amp_dtype else "off", amp_why)
    log.info("run directory %s; training to step %d (lr decay horizon %d)", run.run_dir, run.total_steps,
             cfg.lr_decay_steps)
