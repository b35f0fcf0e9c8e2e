"""The training loop: optimizer steps, the step's core, validation. trainers/main.py runs it and turns
how it ends into an exit status.

Fault injection has one seam, `faults.at(POINT, ...)` (trainers/faults.py names the points); the
agreements of the processes of a torchrun job are World's verbs (trainers/training/distributed.py),
each the identity or nothing for a single process.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Iterator

from tqdm import tqdm

from trainers import PROCESS_START
from trainers.data.data_order import StepPlan
from trainers.data.features import Batch
from trainers.errors import EXIT_DIVERGED, EXIT_OK, TrainingDiverged
from trainers.faults import Faults
from trainers.hardware.cuda_alloc import fragmentation_advice
from trainers.hardware.determinism import nondeterministic_or
from trainers.hardware.oom_recovery import StepOutOfMemory, is_out_of_memory, oom_message, release_memory
from trainers.model.gpt_model import dropout_keys, packed_length
from trainers.run.setup import Run
from trainers.stop_signals import StopRequest
from trainers.training.evaluation import autocast_for, batch_loss_sums
from trainers.training.optimization import StepResult
from trainers.training.step_failures import StepFailures
from trainers.training.train_log import StepMetrics, TrainLog
from trainers.training.validation_listeners import Validation

log = logging.getLogger("train")

MAX_BAD_STEPS = 5  # consecutive non-finite steps before giving up
# With fp16 the loss scaler skips steps by design while it finds its scale (each skip halves it),
# so more skips in a row are normal; this many mean the gradients overflow at any scale.
MAX_SKIPPED_FP16 = 25


def train_steps(run: Run, tlog: TrainLog, bar: tqdm, stop: StopRequest, faults: Faults) -> int | None:
    """Optimizer steps until the planned end (returns None) or an early stop (returns its exit status)."""
    settings, progress = run.settings, run.progress
    run.model.train()
    skipped, first_step = 0, progress.step  # skipped: updates skipped in a row (non-finite gradients)
    while progress.step < run.total_steps:
        plans = run.data.plan_epoch(run.micro_batch)[: run.total_steps - progress.step]
        batches = run.train_loader.batches(run.world.own_parts(plans, run.micro_batch))
        for plan in plans:
            t0 = time.perf_counter()
            try:
                metrics, lr, result = train_step(run, plan, batches, faults)
            except StepOutOfMemory as exc:
                shrink_micro_batch(run, tlog, str(exc))
                break  # re-plan from the same step: same samples, smaller pieces
            skipped = 0 if result.applied else skipped + 1
            if skipped and diverged(run, result, skipped):
                return EXIT_DIVERGED
            progress.step_done(metrics.samples)
            run.listeners.step_done(progress.step)
            run.data.advance(plan)
            log_step(run, tlog, bar, plan, metrics, lr, result, time.perf_counter() - t0, first_step)
            last = progress.step == run.total_steps  # the caller validates and saves at the end
            if settings.val_interval and progress.step % settings.val_interval == 0 and not last:
                validation = evaluate(run, tlog, faults)
                why = run.listeners.stop(validation) if validation else None
                if why:
                    bar.close()
                    return stop_after_validation(run, tlog, why, stop)
                run.model.train()
            stopping = run.world.agree_to_stop(stop)
            if (progress.step % settings.save_interval == 0 and not last) or stopping:
                save_unless_skipping(run, tlog, skipped)
            if stopping:  # a signal's save is complete (under torchrun every process learns how it ended)
                run.checkpoints.wait()
            faults.at("step", progress.step)
            if stopping:
                bar.close()  # before the last lines: the bar is not drawn again under them
                log.info("stopped by signal at step %d; resume with --resume auto --output-dir %s", progress.step,
                         run.cfg.run_dir)
                return stop.exit_status
    show_on_bar(bar, tlog.flush_interval(progress.step, run.data.epoch, run.total_steps))  # the last steps' lines
    bar.close()
    return None


def ended(run: Run, stop: StopRequest) -> int:
    """The status of a run that ended where it should (its end, early stopping, the forgetting guard), its state
    saved: 128 + N when a stop signal came during its last validation or save, as in every other phase, else 0."""
    return stop.exit_status if run.world.agree_to_stop(stop) else EXIT_OK


def stop_after_validation(run: Run, tlog: TrainLog, why: str, stop: StopRequest) -> int:
    """A listener ends the run after a validation (early stopping, the forgetting guard): the final checkpoint,
    then `why` is said, a log line each; then `ended`."""
    progress = run.progress
    tlog.flush_interval(progress.step, run.data.epoch, run.total_steps)
    tlog.write_steps()
    run.checkpoints.save(progress.step)
    run.checkpoints.wait()  # complete before the trainer says so, or exits
    for line in why.splitlines():
        log.info("%s", line)
    return ended(run, stop)


def train_step(run: Run, plan: StepPlan, batches: Iterator[Batch],
               faults: Faults) -> tuple[StepMetrics, float, StepResult]:
    """One optimizer step over the plan's micro-batches, with the loss normalised per step."""
    settings, step = run.settings, run.progress.step + 1  # step: 1-based, as logged
    lr = run.optim.start_step(step - 1)
    own = run.world.own_part(plan, run.micro_batch)  # the plan itself without torchrun
    # Divide by the token count of the whole step so the gradient does not depend on the split (nor, under
    # torchrun, on the number of processes: every process divides by the whole step's count).
    text_total, mel_total = run.data.token_counts(plan)
    failures, totals, grad_norm = StepFailures(step), {}, math.nan
    with failures.held("in the forward/backward pass"), run.world.without_gradient_sum():
        for j, (batch, packed_len) in enumerate(device_batches(run, own, batches)):
            faults.at("forward", step, j, size=len(batch.ids))
            with autocast_for(run.hardware.device, run.hardware.amp_dtype):
                sums = run.model.loss_sums(**batch.inputs, packed_len=packed_len,
                                           dropout_keys=dropout_keys(settings.seed, step - 1, batch.indices))
                loss = (settings.text_loss_weight * sums["text_ce"] / text_total
                        + settings.mel_loss_weight * sums["mel_ce"] / mel_total)
            run.optim.backward(loss)
            totals = {k: v.detach() + totals[k] if k in totals else v.detach() for k, v in sums.items()}
            faults.at("micro", step, j)
    run.world.sum_gradients()  # every process, also after a failure: the others wait for it
    with failures.held("in the gradient clipping"):
        if failures.none:
            faults.at("clip", step)
            grad_norm = run.optim.prepare()  # changes no weight: an out-of-memory error here is recoverable too
    metrics = StepMetrics()
    if failures.none and totals:
        metrics.add(totals, len(own.samples))  # stays on the device: read once per log interval
    oom, metrics = run.world.agree_on_step_outcome(failures, metrics)
    if oom is not None:
        raise StepOutOfMemory(oom)
    faults.at("update", step)
    result = run.optim.apply(grad_norm)
    faults.at("updated", step)
    return metrics, lr, result


def device_batches(run: Run, own: StepPlan, batches: Iterator[Batch]) -> Iterator[tuple[Batch, int]]:
    """This process's micro-batches of the step, on the device, each with its packed length."""
    for expected in own.micro_batches:
        host_batch = next(batches)
        if host_batch.indices.tolist() != expected:  # the one invariant everything rests on; checked on the host
            raise RuntimeError(f"data loader returned samples {host_batch.indices.tolist()} instead of {expected}")
        # From the host copy: no sync.
        packed_len = packed_length(host_batch.text_lens, host_batch.code_lens, run.model.prefix_len)
        yield host_batch.to(run.hardware.device, non_blocking=True), packed_len


def diverged(run: Run, result: StepResult, skipped: int) -> bool:
    """After an update skipped for non-finite gradients, `skipped` in a row: said, and whether to give up."""
    fp16, step = run.optim.fp16, run.progress.step + 1
    if fp16 and skipped < MAX_BAD_STEPS:  # the scaler finding its scale
        log.info("step %d: fp16 gradients overflowed, update skipped; the loss scale is lowered to %g (normal in "
                 "the first steps of an fp16 run; %d in a row)", step, run.optim.loss_scale, skipped)
    else:
        log.warning("step %d: non-finite gradients (norm %s), update skipped (%d in a row);", step, result.grad_norm,
                    skipped)
        log.warning("if this repeats, lower --learning-rate or check the data")
    if skipped < (MAX_SKIPPED_FP16 if fp16 else MAX_BAD_STEPS):
        return False
    log.error("training diverged: %d steps in a row with non-finite gradients%s; the last checkpoint (%s) is intact",
              skipped, " at every loss scale" if fp16 else "", run.checkpoints.newest_name())
    return True


def log_step(run: Run, tlog: TrainLog, bar: tqdm, plan: StepPlan, metrics: StepMetrics, lr: float,
             result: StepResult, seconds: float, first_step: int) -> None:
    step = run.progress.step
    if step == first_step + 1:
        log.info("first optimizer step finished %.2f s after process start", time.monotonic() - PROCESS_START)
    tlog.sample_ids(step, plan.epoch, run.data.ids(plan))
    tlog.train_step(step, metrics, lr, result.grad_norm, seconds)
    if step % run.settings.log_interval == 0:
        show_on_bar(bar, tlog.flush_interval(step, plan.epoch, run.total_steps))
    bar.update(1)  # after the postfix: the redraw this update makes shows the interval just logged


def show_on_bar(bar: tqdm, means: dict[str, float] | None) -> None:
    """The progress bar's mel_loss: the last logged interval's (None: nothing logged, as under torchrun
    processes other than rank 0, or no step since the last line)."""
    if means:
        bar.set_postfix(mel_loss=f"{means['mel_loss']:.3f}", refresh=False)


def save_unless_skipping(run: Run, tlog: TrainLog, skipped: int) -> None:
    if skipped:  # the newest checkpoint stays the last one from before the streak
        log.warning("step %d: not saving during a streak of skipped steps", run.progress.step)
        log.warning("the newest checkpoint is %s", run.checkpoints.newest_name())
    else:
        tlog.write_steps()  # the saved step's scalars are in TensorBoard before it is resumable
        run.checkpoints.save(run.progress.step)


def shrink_micro_batch(run: Run, tlog: TrainLog, error: str) -> None:
    """After an out-of-memory error in forward/backward: halve the micro-batch, or stop at 1."""
    run.optim.discard_gradients()  # partial gradients of the abandoned attempt
    release_memory(run.hardware.device)
    step, effective = run.progress.step + 1, run.settings.effective_batch
    old = run.hardware.halve_micro_batch(run.world.rank_batch(effective), f"step {step}", error)  # every process
    new = run.hardware.split
    log.warning("out of memory at step %d with micro-batch %d: redone with micro-batch %d x accumulation %d", step,
                old.micro_batch, new.micro_batch, new.accumulation)
    log.warning("cause: %s", error)
    log.warning("same samples and effective batch %d; pass --batch-size %d to start there next time", effective,
                new.micro_batch)
    for line in fragmentation_advice(os.environ).splitlines():
        log.warning("%s", line)
    tlog.scalar("hardware/micro_batch", new.micro_batch, run.progress.step)


def evaluate(run: Run, tlog: TrainLog, faults: Faults, final: bool = False) -> Validation | None:
    """Validation on a fixed set of samples, handed to the run's listeners (None: no validation set)."""
    if run.val_loader is None:
        return None
    step = run.progress.step
    faults.at("validation", step)
    by_lang = validation_losses(run, tlog, faults)
    means = tlog.validation(step, by_lang)
    bad = sorted(k for k, v in means.items() if not math.isfinite(v))
    if bad:
        raise TrainingDiverged(f"validation {', '.join(bad)} is {means[bad[0]]}")
    validation = Validation(step, final, by_lang, means, tlog, faults, run.checkpoints.save_best,
                            lambda: validation_losses(run, tlog, faults))
    run.listeners.validated(validation)
    return validation


def validation_losses(run: Run, tlog: TrainLog, faults: Faults) -> dict[str, StepMetrics]:
    """The loss sums per language of the validated samples; on out-of-memory, again with half the batch."""
    count = run.settings.validated_samples(len(run.val_loader.dataset))
    while True:
        metrics, error = validation_pass(run, count, faults)
        if error is None:
            return metrics
        release_memory(run.hardware.device)
        run.hardware.halve_val_batch(error)
        val_batch = run.hardware.val_batch
        log.warning("out of memory in validation: again with batch %d; pass --val-batch-size %d to start there",
                    val_batch, val_batch)
        log.warning("cause: %s", error)
        tlog.scalar("hardware/val_batch", val_batch, run.progress.step)


def validation_pass(run: Run, count: int, faults: Faults) -> tuple[dict[str, StepMetrics], str | None]:
    """Metrics per language over the first `count` validation samples (one language per batch)."""
    size, plan = run.hardware.val_batch, run.hardware
    by_lang = run.validation_sets(count)
    mine = {lang: run.world.own_items(ids) for lang, ids in by_lang.items()}  # under torchrun: every N-th sample
    chunks = [(lang, ids[i: i + size]) for lang, ids in sorted(mine.items()) for i in range(0, len(ids), size)]
    run.model.eval()
    metrics = {lang: StepMetrics() for lang in by_lang}
    error = None
    try:
        batches = run.val_loader.batches([StepPlan(0, 0, [ids for _, ids in chunks])])
        for (lang, _), batch in zip(chunks, batches):
            faults.at("validation-batch", size=len(batch.ids))
            metrics[lang].add(batch_loss_sums(run.model, batch, plan.device, plan.amp_dtype), len(batch.ids))
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise nondeterministic_or(exc, f"in the validation at step {run.progress.step}")
        error = oom_message(exc)
    return run.world.sum_validation(metrics, error)
