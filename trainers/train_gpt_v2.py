#!/usr/bin/env python3
"""Fine-tune the IndexTTS2 GPT ("UnifiedVoice" v2) with exact, interruption-proof resume.

    python trainers/train_gpt_v2.py --demo
    python trainers/train_gpt_v2.py --train-manifest train.jsonl --val-manifest val.jsonl \
        --tokenizer checkpoints/bpe.model --config checkpoints/config.yaml \
        --base-checkpoint checkpoints/gpt.pth --output-dir runs/my_voice
    python trainers/train_gpt_v2.py --resume auto --output-dir runs/my_voice

Exit status: 0 finished; 1 unexpected error; 2 bad flags, data or run directory (nothing was
trained); 3 training diverged (non-finite loss); 4 a checkpoint could not be written (the previous
one is intact); 5 out of memory even at micro-batch 1 (progress saved at the last step boundary);
130 / 143 stopped by SIGINT / SIGTERM after saving a checkpoint at the last optimizer-step boundary.
"""
from __future__ import annotations

import time

PROCESS_START = time.monotonic()

import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm import tqdm  # noqa: E402

from trainers.data.data_order import MicroBatchSampler, Position, StepPlan  # noqa: E402
from trainers.training.faults import KillPoint  # noqa: E402
from trainers.data.features import FeatureError, collate_batch  # noqa: E402
from trainers.model.gpt_model import dropout_keys  # noqa: E402
from trainers.hardware.detect import split_for  # noqa: E402
from trainers.hardware.oom_recovery import OutOfMemoryStop, StepOutOfMemory, halved, oom_message, release_memory  # noqa: E402
from trainers.config.settings import UserError, parse_command_line  # noqa: E402
from trainers.run_setup import Run, setup_run  # noqa: E402
from trainers.training.stop_signals import StopRequest, ignore_stop_signals  # noqa: E402
from trainers.training.train_log import StepMetrics, TrainLog, setup_logging  # noqa: E402
from trainers.training.rng import CHECKPOINT_FORMAT, capture_rng_state, library_versions  # noqa: E402

log = logging.getLogger("train")

EXIT_OK, EXIT_USAGE, EXIT_DIVERGED, EXIT_SAVE_FAILED, EXIT_OUT_OF_MEMORY, EXIT_ABANDONED = 0, 2, 3, 4, 5, 130
MAX_BAD_STEPS = 5  # consecutive non-finite steps before giving up


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    try:
        run = setup_run(parse_command_line(argv))
    except UserError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    try:
        return train(run)
    except KeyboardInterrupt:  # a second stop signal: the step is abandoned, the last checkpoint stands
        return EXIT_ABANDONED


def train(run: Run) -> int:
    kill = KillPoint.from_env()
    run.checkpoints.on_event = kill.on_checkpoint_event
    tlog = TrainLog(run.run_dir, run.global_step, history=run.history, record_sample_ids=run.cfg.log_sample_ids)
    if run.global_step >= run.total_steps:
        log.info("nothing to do: the run is already at step %d; pass a larger --max-steps or --epochs to continue",
                 run.global_step)
        tlog.close()
        return EXIT_OK
    stop = StopRequest().install()
    bar = tqdm(total=run.total_steps, initial=run.global_step, unit="step", disable=None, dynamic_ncols=True)
    first_step = run.global_step
    tlog.scalar("hardware/micro_batch", run.split.micro_batch, run.global_step)
    try:
        if run.global_step == 0:
            evaluate(run, tlog)
        stopped = train_steps(run, tlog, bar, stop, kill)
        if stopped is not None:
            return stopped
        tlog.flush_interval(run.global_step, run.position.epoch, run.total_steps)
        evaluate(run, tlog)
        save(run, tlog)
        log.info("training finished at step %d (epoch %d, step %d of it); to train longer, resume with a larger "
                 "--max-steps or --epochs", run.global_step, run.position.epoch, run.position.step_in_epoch)
        return EXIT_OK
    except CheckpointWriteError as exc:
        log.error("%s", exc)
        return EXIT_SAVE_FAILED
    except FeatureError as exc:
        stop_keeping_progress(run, tlog, first_step, exc, "fix or drop that sample")
        log.error("(add --allow-config-change to the resume if you edited the training manifest)")
        return EXIT_USAGE
    except OutOfMemoryStop as exc:
        stop_keeping_progress(run, tlog, first_step, exc, "free GPU memory (other processes), use "
                              "--grad-checkpointing, or drop the longest samples")
        return EXIT_OUT_OF_MEMORY
    except torch.OutOfMemoryError as exc:
        # Outside forward/backward (the optimizer step): the weights may be partly updated, so save nothing.
        log.error("out of memory outside the forward/backward pass, at step %d: %s. Nothing was saved from this "
                  "step; the last checkpoint is intact. Free GPU memory and continue with --resume auto --output-dir "
                  "%s", run.global_step + 1, oom_message(exc), run.run_dir)
        return EXIT_OUT_OF_MEMORY
    finally:
        bar.close()
        tlog.close()
        stop.uninstall()


def train_steps(run: Run, tlog: TrainLog, bar: tqdm, stop: StopRequest, kill: KillPoint) -> int | None:
    """Optimizer steps until the planned end (returns None) or an early stop (returns its exit status)."""
    cfg, model = run.cfg, run.model
    model.train()
    bad_steps, first_step = 0, run.global_step
    while run.global_step < run.total_steps:
        epoch = run.position.epoch
        plans = run.order.plan_epoch(epoch, run.position.step_in_epoch, run.split.micro_batch)
        plans = plans[: run.total_steps - run.global_step]
        batches = iter(make_loader(run, run.train_set, plans))
        for plan in plans:
            t0 = time.perf_counter()
            try:
                metrics, lr, grad_norm = train_step(run, plan, batches, kill)
            except StepOutOfMemory as exc:
                shrink_micro_batch(run, tlog, str(exc))
                break  # re-plan from the same step: same samples, smaller pieces
            # With fp16 the GradScaler skips overflowing steps by design while it finds its scale.
            if not run.scaler.is_enabled() and not math.isfinite(grad_norm):
                bad_steps += 1
                log.warning("step %d: non-finite gradient norm, update skipped (%d in a row); if this repeats, "
                            "lower --learning-rate or check the data", run.global_step + 1, bad_steps)
                if bad_steps >= MAX_BAD_STEPS:
                    log.error("training diverged: %d non-finite steps in a row; the last checkpoint is intact",
                              bad_steps)
                    return EXIT_DIVERGED
            else:
                bad_steps = 0
            run.global_step += 1
            run.samples_seen += metrics.samples
            run.position = Position(epoch, plan.step_in_epoch + 1).normalised(run.order.steps_per_epoch)
            if run.global_step == first_step + 1:
                log.info("first optimizer step finished %.2f s after process start", time.monotonic() - PROCESS_START)
            tlog.sample_ids(run.global_step, epoch, [run.train_samples[i].id for i in plan.samples])
            tlog.train_step(run.global_step, metrics, lr, grad_norm, time.perf_counter() - t0)
            bar.update(1)
            bar.set_postfix(mel_loss=f"{metrics.means()['mel_loss']:.3f}", refresh=False)
            if run.global_step % cfg.log_interval == 0:
                tlog.flush_interval(run.global_step, epoch, run.total_steps)
            last = run.global_step == run.total_steps  # the caller validates and saves at the end
            if cfg.val_interval and run.global_step % cfg.val_interval == 0 and not last:
                evaluate(run, tlog)
                model.train()
            if (run.global_step % cfg.save_interval == 0 and not last) or stop.requested:
                save(run, tlog)
            kill.check("step", run.global_step)
            if stop.requested:
                log.info("stopped by signal at step %d; resume with --resume auto --output-dir %s",
                         run.global_step, run.run_dir)
                return stop.exit_status
        del batches  # shut its workers down before the next epoch's (or the re-planned) loader starts
    return None


def shrink_micro_batch(run: Run, tlog: TrainLog, error: str) -> None:
    """After an out-of-memory error in forward/backward: halve the micro-batch, or stop at 1."""
    run.optimizer.zero_grad(set_to_none=True)  # partial gradients of the abandoned attempt
    release_memory(run.device)
    old = run.split
    micro = halved(old.micro_batch, f"step {run.global_step + 1}", error)
    run.split = split_for(run.cfg.effective_batch, micro, "halved after running out of memory")
    log.warning("out of memory at step %d with micro-batch %d (%s): redoing the step with micro-batch %d x "
                "accumulation %d; the samples and the effective batch %d are unchanged. Pass --batch-size %d to "
                "start there next time", run.global_step + 1, old.micro_batch, error, run.split.micro_batch,
                run.split.accumulation, run.cfg.effective_batch, run.split.micro_batch)
    tlog.scalar("hardware/micro_batch", run.split.micro_batch, run.global_step)
    if run.probe is not None:  # auto mode: the next resume on this machine starts at the size that worked
        cache, key = run.probe
        cache.store(key, run.split.micro_batch, f"halved after running out of memory at step {run.global_step + 1}")


def train_step(run: Run, plan: StepPlan, batches, kill: KillPoint) -> tuple[StepMetrics, float, float]:
    """One optimizer step over the plan's micro-batches, with the loss normalised per step."""
    cfg, opt = run.cfg, run.optimizer
    lr = run.schedule.apply(opt, run.global_step)
    oom = None
    try:
        totals = accumulate_gradients(run, plan, batches, kill)
    except torch.OutOfMemoryError as exc:
        # Keep only the text: leaving this handler drops the failed pass's frames, graph and tensors.
        oom = oom_message(exc)
    if oom is not None:
        raise StepOutOfMemory(oom)
    metrics = StepMetrics()
    metrics.add(totals, len(plan.samples))  # one device sync per step, not per micro-batch
    run.scaler.unscale_(opt)
    if run.frozen:
        run.frozen.zero_grads()  # before clipping: frozen rows neither count in the norm nor touch the moments
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.trainable, max_norm))
    if run.scaler.is_enabled() or torch.isfinite(torch.tensor(grad_norm)):
        run.scaler.step(opt)  # skips the update itself when fp16 gradients overflowed
    if run.frozen:
        run.frozen.restore()  # undoes AdamW's decoupled weight decay on the frozen rows, bit for bit
    run.scaler.update()
    opt.zero_grad(set_to_none=True)
    return metrics, lr, grad_norm


def accumulate_gradients(run: Run, plan: StepPlan, batches, kill: KillPoint) -> dict[str, torch.Tensor]:
    """Forward and backward of every micro-batch of the step; returns the summed loss terms."""
    cfg, model = run.cfg, run.model
    # Divide by the token count of the whole step so the gradient does not depend on the split.
    text_total = sum(run.train_samples[i].text_len + 1 for i in plan.samples)
    mel_total = sum(run.train_samples[i].code_len + 1 for i in plan.samples)
    totals: dict[str, torch.Tensor] = {}
    for j, expected in enumerate(plan.micro_batches):
        batch = next(batches).to(run.device, non_blocking=True)
        if batch.indices.tolist() != expected:  # cheap guard on the one invariant everything rests on
            raise RuntimeError(f"data loader returned samples {batch.indices.tolist()} instead of {expected}")
        run.oom.check(len(expected), run.global_step + 1, j)
        keys = dropout_keys(cfg.seed, run.global_step, batch.indices)
        with autocast(run):
            sums = model.loss_sums(batch.condition, batch.emo_vec, batch.text_ids, batch.text_lens, batch.codes,
                                   batch.code_lens, dropout_keys=keys)
            loss = cfg.text_loss_weight * sums["text_ce"] / text_total + cfg.mel_loss_weight * sums["mel_ce"] / mel_total
        run.scaler.scale(loss).backward()
        totals = {k: v.detach() + totals[k] if k in totals else v.detach() for k, v in sums.items()}
        kill.check("micro", run.global_step + 1, j)
    return totals


def evaluate(run: Run, tlog: TrainLog) -> dict[str, float] | None:
    """Validation on a fixed set of samples; on out-of-memory, again from the start with half the batch."""
    if run.val_set is None:
        return None
    cfg = run.cfg
    count = len(run.val_set)
    if cfg.max_val_batches:  # the set depends on settings only, never on the hardware's batch size
        count = min(count, cfg.max_val_batches * (cfg.val_batch_size or cfg.effective_batch))
    while True:
        metrics, error = validation_pass(run, count)
        if error is None:
            return tlog.validation(run.global_step, metrics)
        release_memory(run.device)
        run.val_batch = halved(run.val_batch, "validation", error)
        log.warning("out of memory in validation (%s): validating again with batch %d; pass --val-batch-size %d to "
                    "start there", error, run.val_batch, run.val_batch)
        tlog.scalar("hardware/val_batch", run.val_batch, run.global_step)


@torch.no_grad()
def validation_pass(run: Run, count: int) -> tuple[StepMetrics, str | None]:
    size = run.val_batch
    chunks = [list(range(i, min(i + size, count))) for i in range(0, count, size)]
    run.model.eval()
    metrics = StepMetrics()
    try:
        for batch in make_loader(run, run.val_set, [StepPlan(0, 0, chunks)]):
            batch = batch.to(run.device, non_blocking=True)
            run.oom.check(len(batch.ids))
            with autocast(run):
                sums = run.model.loss_sums(batch.condition, batch.emo_vec, batch.text_ids, batch.text_lens,
                                           batch.codes, batch.code_lens)
            metrics.add(sums, len(batch.ids))
    except torch.OutOfMemoryError as exc:
        return metrics, oom_message(exc)
    return metrics, None


def make_loader(run: Run, dataset, plans: list[StepPlan]) -> DataLoader:
    # A private generator keeps DataLoader's worker seeding off the global RNG, so creating a
    # loader mid-epoch on resume draws nothing the uninterrupted run would not have drawn.
    return DataLoader(
        dataset,
        batch_sampler=MicroBatchSampler(plans),
        num_workers=run.num_workers,
        collate_fn=collate_batch,
        pin_memory=run.device.type == "cuda",
        generator=torch.Generator().manual_seed(run.cfg.seed),
        worker_init_fn=ignore_stop_signals if run.num_workers else None,
    )


def autocast(run: Run):
    if run.amp_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=run.device.type, dtype=run.amp_dtype)


def save(run: Run, tlog: TrainLog) -> Path:
    """Checkpoint at an optimizer-step boundary; everything needed to continue exactly."""
    model_state = {k: v.detach().cpu() for k, v in run.model.state_dict().items()}
    model_state.update(run.carried)
    state = {
        "format": CHECKPOINT_FORMAT,
        "model": model_state,
        "optimizer": run.optimizer.state_dict(),
        "optimizer_params": [[n, list(p.shape)] for n, p in zip(run.param_names, run.trainable)],
        "scheduler": run.schedule.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else {},
        "step": run.global_step,
        "epoch": run.position.epoch,
        "step_in_epoch": run.position.step_in_epoch,
        "samples_in_epoch": min(run.position.step_in_epoch * run.cfg.effective_batch, len(run.train_samples)),
        "samples_seen": run.samples_seen,
        "rng": capture_rng_state(),
        "config": run.cfg.to_dict(),
        "model_config": run.gpt_cfg.to_dict(),
        "fingerprints": dict(run.fingerprints),
        "vocab": dict(run.vocab),
        "versions": library_versions(),
        "amp_dtype": str(run.amp_dtype),
        "hardware": run.hardware.cache_key(),
        "micro_batch": run.split.micro_batch,
        "metrics": list(tlog.history),
    }
    try:
        path = run.checkpoints.save(state, run.global_step)
    except OSError as exc:
        previous = run.checkpoints.find_resume()
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {run.global_step} in {run.run_dir}: {exc}. "
            f"The previous checkpoint ({previous.name if previous else 'none'}) is intact; free disk space or fix "
            f"permissions, then continue with --resume auto --output-dir {run.run_dir}") from None
    log.info("saved checkpoint %s (step %d)", path, run.global_step)
    return path


def stop_keeping_progress(run: Run, tlog: TrainLog, first_step: int, error: Exception, advice: str) -> None:
    """Stopping on an error between steps: the weights and optimizer are still at the last step
    boundary, so the steps since the last save are kept."""
    log.error("%s", error)
    run.optimizer.zero_grad(set_to_none=True)
    if run.global_step > first_step:
        save(run, tlog)
    log.error("%s, then continue with --resume auto --output-dir %s", advice, run.run_dir)


class CheckpointWriteError(RuntimeError):
    """Saving failed (disk full, permissions); training stops rather than run on unsaved."""


if __name__ == "__main__":
    sys.exit(main())
