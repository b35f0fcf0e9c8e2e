"""Everything before the first step: `setup_run` turns the command line into a ready `Run`.

Every check that can fail on the user's input runs before the model is built, so a bad flag,
manifest or resume costs seconds and never touches an existing run directory's checkpoints.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.disk_space import GROWTH, DiskRoom, checkpoint_bytes
from trainers.checkpoint.recovery import repair_latest, set_aside
from trainers.config.flags import CommandLine
from trainers.config.settings import TrainConfig
from trainers.data.loader import StepLoader
from trainers.errors import CheckpointWriteError
from trainers.data.train_data import TrainData
from trainers.hardware.cuda_alloc import allocator_line
from trainers.hardware.detect import Hardware, busy_cpu_note, detect_hardware, pick_device
from trainers.hardware.determinism import log_determinism, make_deterministic
from trainers.hardware.plan import HardwarePlan, plan_hardware
from trainers.hardware.precision import AmpChoice, choose_amp
from trainers.log_lines import log_fitting
from trainers.model.frozen_rows import HeldRows
from trainers.model.weights import GPTWeights
from trainers.run.build import build_data, build_optimization, build_weights
from trainers.run.listeners import run_listeners
from trainers.run.lock import RunLock
from trainers.run.inputs import DEMO_DATA_DIR
from trainers.run.resolve import Resolution, resolve_run
from trainers.run.resume import refuse_breaking_changes, restore
from trainers.run.sample_sets import refuse_unusable_folder
from trainers.run.schedule import plan_schedule
from trainers.run.run_dir import (
    RunConfig, locate_run, read_saved_run, refuse_another_runs_checkpoint, run_dir_of, warn_new_run,
    write_start_files,
)
from trainers.training.lr_schedule import LRSchedule
from trainers.training.optimization import Optimization
from trainers.training.distributed import World
from trainers.training.torchrun_env import batch_summary
from trainers.training.rank_zero import NoLock
from trainers.training.progress import TrainingProgress
from trainers.training.validation_listeners import Listeners
from trainers.training.rng import ProcessRNG

log = logging.getLogger("train")


@dataclass
class Run:
    """The run's components; each owns its state and its section of the checkpoint."""

    cfg: RunConfig
    weights: GPTWeights
    optim: Optimization
    data: TrainData
    train_loader: StepLoader
    val_loader: StepLoader | None
    progress: TrainingProgress
    hardware: HardwarePlan  # device, precision, the split of a step into micro-batches
    checkpoints: Checkpointer
    total_steps: int  # where this invocation stops: --max-steps or the end of --epochs, whichever is first
    lock: RunLock | NoLock
    world: World = field(default_factory=World)  # the processes of a torchrun job; one without torchrun

    @property
    def model(self) -> torch.nn.Module:
        return self.weights.model

    @property
    def settings(self) -> TrainConfig:
        return self.cfg.settings

    @property
    def micro_batch(self) -> int:
        """This process's micro-batch now (out-of-memory recovery lowers it)."""
        return self.hardware.split.micro_batch

    @property
    def listeners(self) -> Listeners:
        """What acts on validations and steps (trainers/run/listeners.py); their state is saved with the progress."""
        return self.progress.listeners

    def validation_sets(self, count: int) -> dict[str, list[int]]:
        """The first `count` validation samples' indices, by language."""
        assert self.val_loader is not None
        return self.val_loader.dataset.samples.languages(count)

    def close(self) -> None:
        """Finish the save in flight, then let go of the loader processes and the run directory."""
        try:
            self.checkpoints.close()
        except CheckpointWriteError as exc:  # only on a path that is already ending with another error
            log.error("%s", exc)
        finally:
            for loader in (self.train_loader, self.val_loader):
                if loader is not None:
                    loader.close()
            self.lock.release()


def setup_run(cmd: CommandLine, world: World | None = None) -> Run:
    world = world or World()
    # torchrun: rank 0 sets itself up first, then the others; all start, from the same place, or none does.
    try:
        with world.main_first():
            run = _locked_run(cmd, world)
    except BaseException:
        world.agree_to_start(None)
        raise
    try:
        world.agree_to_start(run)
        world.attach(run)  # one split for all processes, DDP, rank 0 writes the checkpoints
        # Background saves only if their host copy fits; measured now that a resumed checkpoint's host copy is gone.
        # Under torchrun the other processes of this machine start their loader processes too.
        workers = run.hardware.num_workers * sum(loader is not None for loader in (run.train_loader, run.val_loader))
        run.checkpoints.fit_to_host_memory(workers * world.local_size, world.local_size)
    except BaseException:
        run.close()
        raise
    log_summary(run)
    return run


def _locked_run(cmd: CommandLine, world: World) -> Run:
    # Locked before the directory is read: a trainer still reading its inputs there keeps a second one out
    # (which would otherwise find no run yet). Under torchrun rank 0 alone locks and writes it.
    run_dir = run_dir_of(cmd)
    lock = RunLock(run_dir).acquire() if world.is_main else NoLock()
    demo_corpus = run_dir / DEMO_DATA_DIR
    made_here = world.is_main and not demo_corpus.exists()  # --demo's corpus, if this start generates it
    try:
        run_dir, checkpoint = locate_run(cmd)
        saved = read_saved_run(run_dir, checkpoint, cmd.resume)
        if saved and saved.path:
            refuse_another_runs_checkpoint(run_dir, saved)
        if cmd.resume == "auto" and saved is None and world.is_main:
            warn_new_run(run_dir, existed=lock.existed)
        machine = detect_hardware(world.place(pick_device(cmd.given.get("device", "auto"))))
        resolution = resolve_run(cmd, run_dir, saved, machine.cache_key(), world.size)
        return _start_run(cmd, resolution, machine, lock, world)
    except BaseException:
        if made_here and demo_corpus.is_dir():  # a refused start says "nothing was written": the corpus goes too
            shutil.rmtree(demo_corpus, ignore_errors=True)
        lock.abandon()  # a start that wrote nothing else leaves no lock file or new directory behind
        raise


def _start_run(cmd: CommandLine, resolution: Resolution, machine: Hardware, lock: RunLock | NoLock,
               world: World) -> Run:
    cfg, inputs, resume = resolution.cfg, resolution.inputs, resolution.resume
    run_dir = cfg.run_dir
    ckpt = resume.checkpoint if resume else None
    changes = refuse_breaking_changes(cfg, ckpt, resume.path, cmd, inputs.train_samples) if ckpt else []
    if cfg.settings.sample_interval and cfg.settings.val_manifests:
        refuse_unusable_folder(run_dir)

    # Where this invocation stops and its learning rates: decided before any model is built, from the
    # checkpoint's position and schedule (read here; the one restore below loads them).
    data, val_set = build_data(cfg, inputs)
    step = ckpt.step if ckpt else 0
    end_of_epochs = step + data.steps_left(cfg.settings.epochs, ckpt.section("data") if ckpt else None)
    total = min(cfg.settings.max_steps, end_of_epochs) if cfg.settings.max_steps else end_of_epochs
    saved_schedule = LRSchedule.from_state_dict(ckpt.lr_schedule) if ckpt else None
    schedule = plan_schedule(cfg, saved_schedule, step, total, cmd)

    if resume and resume.damaged and world.is_main:  # every refusal is behind us: move damaged newer checkpoints aside
        set_aside(run_dir, list(resume.damaged), resume.path)
    if resume and resume.path and cmd.resume == "auto" and world.is_main:  # latest.pth names what was resumed
        repair_latest(run_dir, resume.path)
    same_device = cfg.settings.device in ("auto", cmd.given.get("device"))
    chosen = machine if same_device else detect_hardware(world.place(pick_device(cfg.settings.device)))
    precision = choose_amp(chosen, cfg.settings.amp)  # refuses bf16 on a GPU without it, before the model is built
    if cfg.settings.deterministic:
        make_deterministic()
    weights = build_weights(cfg, inputs, ckpt is not None, chosen.device)
    # Room for the checkpoints the run keeps, before anything is trained or written (rank 0 alone writes them).
    room = disk_room(cfg, weights, val_set is not None, total, resume.path if resume else None) \
        if world.is_main else None
    if room is not None:
        room.refuse_if_short(step)
    # Under torchrun the split is each process's, of its share of a step.
    rank_cfg = replace(cfg.settings, effective_batch=world.rank_batch(cfg.settings.effective_batch))
    hardware = plan_hardware(rank_cfg, chosen, weights.model, inputs.train_samples, cfg.fingerprints["model_config"],
                       run_dir, write_cache=world.is_main, world_size=world.size, precision=precision)
    optim = build_optimization(cfg, weights, hardware.amp_dtype, hardware.device, schedule)
    loaders = [StepLoader(ds, hardware.num_workers, hardware.device.type == "cuda", cfg.settings.seed)
               if ds else None for ds in (data.dataset, val_set)]  # no process starts before the first batch
    replayed = data.mixing.languages if data.mixing else ()
    progress = TrainingProgress(listeners=run_listeners(cfg.settings, run_dir, weights.model, loaders[1], hardware,
                                                        world, tuple(replayed)))
    background = cfg.settings.background_saves
    background = hardware.machine.is_cuda if background is None else background
    # Under torchrun rank 0 alone writes; every process learns how its writes end (rank_zero.MainRankCheckpoints).
    rng = ProcessRNG()
    checkpoints = Checkpointer(run_dir, cfg.settings.keep_checkpoints, {
        "model": weights, "optim": optim, "data": data, "progress": progress, "rng": rng, "run": cfg,
        "hardware": hardware}, background=background and world.is_main, room=room)
    if ckpt:
        restore(checkpoints, ckpt, resume.path, cmd.force_resume)
    else:  # the global generators' states are the run's, as a resume's restored ones are (trainers/training/rng.py)
        rng.seed(cfg.settings.seed)
    progress.record_start(resume.path if ckpt else None, machine.cache_key(),
                          [*([resolution.branch["history"]] if resolution.branch else []), *changes])

    if world.is_main:
        # The plan accepted for the checkpoint continued (trainers/run/run_plan.py): durable before the first step.
        continued = resume.plan_key if resume else None
        plan = {"continues": continued, "lr_schedule": schedule.state_dict()} if continued else None
        write_start_files(cfg, machine.cache_key(), plan, resolution.branch)
        for manifests in inputs.checked:  # before the other processes of a torchrun job read them: main_first
            manifests.save()
    return Run(cfg, weights, optim, data, *loaders, progress, hardware, checkpoints, total, lock, world)


def disk_room(cfg: RunConfig, weights: GPTWeights, validates: bool, total: int,
              resumed: Path | None) -> DiskRoom:
    """What the run's checkpoints need on its disk: one checkpoint's size from the model and the trained
    parameters, or the size of the checkpoint `resumed` (with room for its history to grow)."""
    if resumed is not None:
        size = resumed.stat().st_size + GROWTH
    else:
        trained = [p for p in weights.model.parameters() if p.requires_grad]
        size = checkpoint_bytes(weights.saved_tensors().values(), trained)
    return DiskRoom(cfg.run_dir, cfg.settings.keep_checkpoints, validates, size, total, cfg.settings.save_interval)


def count_text(n: int) -> str:
    """A count in three significant figures: 950, 12.3K, 1.23M, 1.5B (a LoRA run of a small model trains
    thousands, which "0.0M" hid)."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= 0.9995 * size:  # 999,600 is 1M, not 1e+03K
            return f"{n / size:.3g}{unit}"
    return str(n)


def log_summary(run: Run) -> None:
    cfg, vocab, plan = run.cfg.settings, run.cfg.vocab, run.hardware
    n_train = sum(p.numel() for p in run.optim.params)
    log.info("model: %d layers, dim %d, %d text tokens; %s trained parameters, %d carried tensors",
             run.cfg.gpt.layers, run.cfg.gpt.model_dim, run.cfg.gpt.number_text_tokens, count_text(n_train),
             len(run.weights.carried))
    if isinstance(run.optim.frozen, HeldRows):
        parts, langs = run.optim.frozen.parts(), ",".join(cfg.new_languages)
        for first in range(0, len(parts), 2):  # two tables a line
            log.info("--new-language %s: rows %s", langs, ", ".join(parts[first:first + 2]))
        log.info("--new-language %s: these rows train, every other row of their tables is held bit-identical", langs)
        if cfg.new_rows_lr_scale != 1.0:
            log.info("--new-language %s; their learning rate x%g", langs, cfg.new_rows_lr_scale)
    elif run.optim.frozen:
        log.info("vocabulary: %d text tokens, base %d", vocab.text_tokens, vocab.base_text_tokens)
        log.info("vocabulary: the %d base rows of text_embedding and text_head are frozen", run.optim.frozen.rows)
        log.info("vocabulary: --no-freeze-base-vocab trains them too")
    elif vocab.extended:
        log.info("vocabulary: %d text tokens, base %d; base rows are trained too (--no-freeze-base-vocab)",
                 vocab.text_tokens, vocab.base_text_tokens)
    log.info("hardware: %s", plan.machine.describe())
    for line in busy_cpu_note(plan.machine, torch.get_num_threads()):
        log.warning("%s", line)
    if plan.machine.is_cuda:
        log.info("%s", allocator_line(os.environ))
    if run.world.distributed:
        split = batch_summary(run.world, cfg.effective_batch, plan.split.micro_batch, plan.split.accumulation)
        log.info("batch: %s (%s)", split, plan.split.reason)
        log.info("batch: process r takes samples r, r+%d, r+%d, ... of each step", run.world.size, 2 * run.world.size)
    else:
        split = f"batch: effective batch {cfg.effective_batch} = micro-batch {plan.split.micro_batch} x accumulation " \
            f"{plan.split.accumulation}"
        log_fitting(log, f"{split} ({plan.split.reason})", split, f"batch: ({plan.split.reason})")
    steps = run.data.steps_per_epoch
    log.info("epoch: %d step%s, %s order", steps, "" if steps == 1 else "s", cfg.data_order)
    amp = AmpChoice(plan.amp_dtype, plan.amp_reason)
    log.info("data workers %d (%s)", plan.num_workers, plan.workers_reason)
    log.info("amp %s (%s); TF32 %s", amp.name, amp.reason,
             "on" if plan.tf32 else "off" + (" (--no-tf32)" if plan.machine.is_cuda and not cfg.tf32 else ""))
    if cfg.deterministic:
        gpt = run.cfg.gpt
        log_determinism(plan.machine, plan.amp_dtype, gpt.heads, gpt.model_dim // gpt.heads,
                        run.model.prefix_len + gpt.max_text_tokens + 2 + gpt.max_mel_tokens + 2)
    schedule = run.optim.schedule
    log.info("run directory %s", run.cfg.run_dir)
    log.info("training to step %d", run.total_steps)
    for line in schedule.describe(run.progress.step):  # a resume's part in force, not the history
        log.info("learning rate: %s", line)
    if run.total_steps > schedule.end_step:
        log.info("learning rate: the floor %.4g from step %d on", schedule.floor, schedule.end_step)
