"""The trainer's main() and its training loop: what `indextts-train`, `python trainers/train_gpt_v2.py`
and trainers.experiment run. The command line, its flags and exit statuses: trainers/cli.py and
trainers/train_gpt_v2.py.
"""
from __future__ import annotations

import logging
import math
import os
import time

import torch
from tqdm import tqdm

from trainers import PROCESS_START
from trainers.config.flags import CommandLine, parse_command_line
from trainers.data.data_order import StepPlan
from trainers.data.features import FeatureError
from trainers.errors import (
    EXIT_DIVERGED, EXIT_HOST_MEMORY, EXIT_OK, EXIT_OUT_OF_MEMORY, EXIT_SAVE_FAILED, EXIT_USAGE, CheckpointWriteError,
    DistributedFailure, HostMemoryError, LogWriteError, TrainingDiverged, UserError,
)
from trainers.faults import Faults
from trainers.hardware.cuda_alloc import fragmentation_advice
from trainers.hardware.determinism import NO_DETERMINISM_ADVICE, NondeterministicOp, nondeterministic_or
from trainers.hardware.oom_recovery import (
    OutOfMemoryStop, StepOutOfMemory, is_out_of_memory, oom_message, release_memory,
)
from trainers.model.gpt_model import dropout_keys, packed_length
from trainers.run.setup import Run, setup_run
from trainers.stop_signals import EarlySignals, StopNow, StopRequest
from trainers.training.distributed import World
from trainers.training.evaluation import autocast_for, batch_loss_sums
from trainers.training.optimization import StepResult
from trainers.training.rank_zero import QuietLog
from trainers.training.train_log import StepMetrics, TrainLog, setup_logging

log = logging.getLogger("train")

MAX_BAD_STEPS = 5  # consecutive non-finite steps before giving up
# With fp16 the loss scaler skips steps by design while it finds its scale (each skip halves it),
# so more skips in a row are normal; this many mean the gradients overflow at any scale.
MAX_SKIPPED_FP16 = 25


def main(argv: list[str] | None = None, command: CommandLine | None = None,
         early: EarlySignals | None = None) -> int:
    cmd = command or parse_command_line(argv)
    setup_logging()
    stop = StopRequest().install()
    if early and early.received:  # a signal during the imports
        stop.signum = early.received[0]
    faults = Faults.from_env()
    run, world = None, World()
    try:
        stop.check()
        world = World.from_env(timeout_s=cmd.dist_timeout).start(stop)  # under torchrun: join the other processes
        stop.check()
        run = setup_run(cmd, world)
        faults.kill.check("setup")
        stop.check()
        stop.training = True
        return train(run, stop, faults)
    except UserError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    except CheckpointWriteError as exc:  # the log could not even be opened
        log.error("%s", exc)
        return EXIT_SAVE_FAILED
    except HostMemoryError as exc:  # a save while stopping on another error (see stop_keeping_progress)
        log.error("%s", exc)
        return EXIT_HOST_MEMORY
    except StopNow as exc:
        if not stop.training:
            log.warning("stopped by %s during start-up: nothing was trained, no checkpoint was changed", exc)
        return exc.exit_status  # during training: a second signal abandoned the step, the last checkpoint stands
    except RuntimeError as exc:  # before training: the micro-batch probe's passes
        nondeterministic = NondeterministicOp.from_error(exc, "during start-up")
        if nondeterministic is None:
            raise
        log.error("%s; nothing was trained. %s", nondeterministic, NO_DETERMINISM_ADVICE)
        return EXIT_USAGE
    except DistributedFailure as exc:  # torchrun: another process failed, or this one cannot go on with them
        if run is not None:  # rank 0's background write in flight ends first: it may be the newest checkpoint
            run.checkpoints.finish_own_write()
        where = f"; the newest complete checkpoint ({run.checkpoints.newest_name()}) stands: continue with " \
            f"--resume auto --output-dir {run.cfg.run_dir}" if run is not None else ""
        if run is not None and exc.exit_status == EXIT_OUT_OF_MEMORY:  # in the gradient sum: start smaller next time
            where += ". " + run.hw.record_out_of_memory(world.rank_batch(run.cfg.train.effective_batch),
                                                        f"step {run.progress.step + 1}, in the gradient sum", str(exc))
        log.error("%s%s", exc, where)
        return exc.exit_status
    finally:
        stop.uninstall()
        world.close()  # first: under torchrun it ignores stop signals from here on
        if run is not None:
            run.close()


def train(run: Run, stop: StopRequest, faults: Faults) -> int:
    run.checkpoints.files.on_event = faults.kill.on_checkpoint_event
    cfg = run.cfg.train
    # Under torchrun rank 0 alone writes the log, TensorBoard and sample_ids.tsv (each step's ids, of every process).
    # It adds to the run's history and open log interval, which the checkpoints save (rank 0's under torchrun).
    tlog = (TrainLog if run.world.is_main else QuietLog)(run.cfg.run_dir, run.progress.step,
                                                         history=run.progress.history,
                                                         record_sample_ids=cfg.log_sample_ids,
                                                         interval=run.progress.interval)
    if run.progress.step >= run.total_steps:
        log.info("nothing to do: the run is already at step %d; pass a larger --max-steps or --epochs to continue",
                 run.progress.step)
        tlog.close()
        return EXIT_OK
    bar = tqdm(total=run.total_steps, initial=run.progress.step, unit="step",
               disable=None if run.world.is_main else True, dynamic_ncols=True)
    first_step = run.progress.step
    tlog.scalar("hardware/micro_batch", run.hw.split.micro_batch, run.progress.step)
    try:
        if run.progress.step == 0:
            evaluate(run, tlog, faults)
        stopped = train_steps(run, tlog, bar, stop, faults)
        if stopped is not None:
            return stopped
        tlog.flush_interval(run.progress.step, run.data.epoch, run.total_steps)
        evaluate(run, tlog, faults)
        run.checkpoints.save(run.progress.step)
        run.checkpoints.wait()  # the final save is complete before the trainer says so, or exits
        log.info("training finished at step %d (epoch %d, step %d of it); to train longer, resume with a larger "
                 "--max-steps or --epochs", run.progress.step, run.data.epoch, run.data.step_in_epoch)
        return stop.exit_status if run.world.agree_to_stop(stop) else EXIT_OK  # a signal during the final validation
    except CheckpointWriteError as exc:
        log.error("%s%s", exc, f" (the last checkpoint, {run.checkpoints.newest_name()}, is intact)"
                  if isinstance(exc, LogWriteError) else "")
        return EXIT_SAVE_FAILED
    except TrainingDiverged as exc:
        log.error("training diverged at step %d: %s. Nothing was saved from it; the last checkpoint (%s) is intact. "
                  "Lower --learning-rate, check the data, or resume from an earlier model_step*.pth",
                  run.progress.step, exc, run.checkpoints.newest_name())
        return EXIT_DIVERGED
    except FeatureError as exc:
        stop_keeping_progress(run, tlog, first_step, exc, "fix or drop that sample")
        log.error("(add --allow-config-change to the resume if you edited the training manifest)")
        return EXIT_USAGE
    except HostMemoryError as exc:  # a save's host copy: never "free GPU memory"
        log.error("%s", exc)
        return EXIT_HOST_MEMORY
    except OutOfMemoryStop as exc:
        stop_keeping_progress(run, tlog, first_step, exc, "free GPU memory (other processes), use --grad-checkpointing, "
                              "or drop the longest samples")
        return EXIT_OUT_OF_MEMORY
    except NondeterministicOp as exc:  # in forward, backward, clipping or validation: the weights are at a step boundary
        stop_keeping_progress(run, tlog, first_step, exc, NO_DETERMINISM_ADVICE)
        return EXIT_USAGE
    except RuntimeError as exc:
        nondeterministic = NondeterministicOp.from_error(exc, f"in the optimizer update of step {run.progress.step + 1}")
        if nondeterministic is not None:  # the weights may be partly updated: save nothing
            log.error("%s. Nothing was saved from this step; the last checkpoint (%s) is intact. %s", nondeterministic,
                      run.checkpoints.newest_name(), NO_DETERMINISM_ADVICE)
            return EXIT_USAGE
        if not is_out_of_memory(exc):
            raise
        # In the optimizer update: the weights may be partly updated, so save nothing.
        step, error = run.progress.step + 1, oom_message(exc)
        smaller = run.hw.record_out_of_memory(run.world.rank_batch(cfg.effective_batch),
                                            f"step {step}, outside forward/backward", error)
        log.error("out of memory outside the forward/backward pass, at step %d: %s. Nothing was saved from this "
                  "step; the last checkpoint is intact. %s; continue with --resume auto --output-dir %s", step, error,
                  smaller, run.cfg.run_dir)
        return EXIT_OUT_OF_MEMORY
    finally:
        bar.close()
        tlog.close()


def train_steps(run: Run, tlog: TrainLog, bar: tqdm, stop: StopRequest, faults: Faults) -> int | None:
    """Optimizer steps until the planned end (returns None) or an early stop (returns its exit status)."""
    cfg, progress = run.cfg.train, run.progress
    run.model.train()
    bad_steps, first_step = 0, progress.step
    while progress.step < run.total_steps:
        plans = run.data.plan_epoch(run.hw.split.micro_batch)[: run.total_steps - progress.step]
        batches = run.train_loader.batches(run.world.share_plans(plans, run.hw.split.micro_batch))  # this process's
        for plan in plans:
            t0 = time.perf_counter()
            try:
                metrics, lr, result = train_step(run, plan, batches, faults)
            except StepOutOfMemory as exc:
                shrink_micro_batch(run, tlog, str(exc))
                break  # re-plan from the same step: same samples, smaller pieces
            bad_steps = 0 if result.applied else bad_steps + 1
            if bad_steps:
                limit = MAX_SKIPPED_FP16 if run.optim.scaler.is_enabled() else MAX_BAD_STEPS
                if run.optim.scaler.is_enabled() and bad_steps < MAX_BAD_STEPS:  # the scaler finding its scale
                    log.info("step %d: fp16 gradients overflowed, update skipped; the loss scale is lowered to %g "
                             "(normal in the first steps of an fp16 run; %d in a row)", progress.step + 1,
                             run.optim.scaler.get_scale(), bad_steps)
                else:
                    log.warning("step %d: non-finite gradients (norm %s), update skipped (%d in a row); if this "
                                "repeats, lower --learning-rate or check the data", progress.step + 1,
                                result.grad_norm, bad_steps)
                if bad_steps >= limit:
                    log.error("training diverged: %d steps in a row with non-finite gradients%s; the last checkpoint "
                              "(%s) is intact", bad_steps, " at every loss scale" if run.optim.scaler.is_enabled()
                              else "", run.checkpoints.newest_name())
                    return EXIT_DIVERGED
            progress.step_done(metrics.samples)
            run.data.advance(plan)
            if progress.step == first_step + 1:
                log.info("first optimizer step finished %.2f s after process start", time.monotonic() - PROCESS_START)
            tlog.sample_ids(progress.step, plan.epoch, run.data.ids(plan))
            tlog.train_step(progress.step, metrics, lr, result.grad_norm, time.perf_counter() - t0)
            bar.update(1)
            if progress.step % cfg.log_interval == 0:
                means = tlog.flush_interval(progress.step, plan.epoch, run.total_steps)
                if means:  # None where nothing is logged (torchrun processes other than rank 0)
                    bar.set_postfix(mel_loss=f"{means['mel_loss']:.3f}", refresh=False)
            last = progress.step == run.total_steps  # the caller validates and saves at the end
            if cfg.val_interval and progress.step % cfg.val_interval == 0 and not last:
                evaluate(run, tlog, faults)
                run.model.train()
            stopping = run.world.agree_to_stop(stop)  # under torchrun: a signal to any process stops all of them here
            if (progress.step % cfg.save_interval == 0 and not last) or stopping:
                if bad_steps:  # the newest checkpoint stays the last one from before the streak
                    log.warning("step %d: not saving during a streak of skipped steps; the newest checkpoint is %s",
                                progress.step, run.checkpoints.newest_name())
                else:
                    tlog.write_steps()  # the saved step's scalars are in TensorBoard before it is resumable
                    run.checkpoints.save(progress.step)
            if stopping:  # a signal's save is complete (under torchrun every process learns how it ended)
                run.checkpoints.wait()
            elif faults.kill.armed("step", progress.step):  # "after step N and any checkpoint it saves"
                run.checkpoints.wait_own()
            faults.kill.check("step", progress.step)
            if stopping:
                log.info("stopped by signal at step %d; resume with --resume auto --output-dir %s", progress.step,
                         run.cfg.run_dir)
                return stop.exit_status
    return None


def shrink_micro_batch(run: Run, tlog: TrainLog, error: str) -> None:
    """After an out-of-memory error in forward/backward: halve the micro-batch, or stop at 1."""
    run.optim.discard_gradients()  # partial gradients of the abandoned attempt
    release_memory(run.hw.device)
    step, effective = run.progress.step + 1, run.cfg.train.effective_batch
    old = run.hw.halve_micro_batch(run.world.rank_batch(effective), f"step {step}", error)  # every process halves
    new = run.hw.split
    log.warning("out of memory at step %d with micro-batch %d (%s): redoing the step with micro-batch %d x "
                "accumulation %d; the samples and the effective batch %d are unchanged. Pass --batch-size %d to "
                "start there next time%s", step, old.micro_batch, error, new.micro_batch, new.accumulation,
                effective, new.micro_batch, fragmentation_advice(os.environ))
    tlog.scalar("hardware/micro_batch", new.micro_batch, run.progress.step)


def train_step(run: Run, plan: StepPlan, batches, faults: Faults) -> tuple[StepMetrics, float, StepResult]:
    """One optimizer step over the plan's micro-batches, with the loss normalised per step."""
    step = run.progress.step
    lr = run.optim.start_step(step)
    share = run.world.share_plan(plan, run.hw.split.micro_batch)  # under torchrun this process's part, else the plan
    oom, bad_sample, totals = None, None, {}
    try:
        with run.world.accumulating():  # under torchrun: no communication until sync_gradients
            totals = accumulate_gradients(run, plan, share, batches, faults)
    except FeatureError as exc:
        bad_sample = exc
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise nondeterministic_or(exc, f"in the forward/backward pass of step {step + 1}")
        # Keep only the text: leaving this handler drops the failed pass's frames, graph and tensors.
        oom = oom_message(exc)
    try:
        run.world.sync_gradients()  # under torchrun every process takes part, also after a failure: the others wait
        if oom is None and bad_sample is None:
            run.hw.oom.check(0, step + 1, "clip")
            grad_norm = run.optim.prepare()  # changes no weight: an out-of-memory error here is recoverable too
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise nondeterministic_or(exc, f"in the gradient clipping of step {step + 1}")
        oom = oom_message(exc)
    metrics = StepMetrics()
    if oom is None and bad_sample is None and totals:
        metrics.add(totals, len(share.samples))  # stays on the device: read once per log interval
    oom, metrics = run.world.agree_on_step(oom, bad_sample, metrics)  # under torchrun: over all processes
    if oom is not None:
        raise StepOutOfMemory(oom)
    run.hw.oom.check(0, step + 1, "update")
    result = run.optim.apply(grad_norm)
    faults.nan.after_update(step + 1, run.optim.params)
    return metrics, lr, result


def accumulate_gradients(run: Run, plan: StepPlan, share: StepPlan, batches,
                         faults: Faults) -> dict[str, torch.Tensor]:
    """Forward and backward of this process's micro-batches of the step (`share`: all of them without torchrun);
    returns the summed loss terms."""
    cfg, step = run.cfg.train, run.progress.step
    # Divide by the token count of the whole step so the gradient does not depend on the split (nor, under
    # torchrun, on the number of processes: every process divides by the whole step's count).
    text_total, mel_total = run.data.token_counts(plan)
    totals: dict[str, torch.Tensor] = {}
    for j, expected in enumerate(share.micro_batches):
        host_batch = next(batches)
        if host_batch.indices.tolist() != expected:  # the one invariant everything rests on; checked on the host
            raise RuntimeError(f"data loader returned samples {host_batch.indices.tolist()} instead of {expected}")
        packed_len = packed_length(host_batch.text_lens, host_batch.code_lens)  # from the host copy: no sync
        batch = host_batch.to(run.hw.device, non_blocking=True)
        run.hw.oom.check(len(expected), step + 1, j)
        keys = dropout_keys(cfg.seed, step, batch.indices)
        with autocast_for(run.hw.device, run.hw.amp_dtype):
            sums = run.model.loss_sums(batch.condition, batch.emo_vec, batch.text_ids, batch.text_lens, batch.codes,
                                       batch.code_lens, dropout_keys=keys, packed_len=packed_len)
            loss = cfg.text_loss_weight * sums["text_ce"] / text_total + cfg.mel_loss_weight * sums["mel_ce"] / mel_total
        run.optim.backward(faults.nan.corrupt_loss(loss, step + 1))
        totals = {k: v.detach() + totals[k] if k in totals else v.detach() for k, v in sums.items()}
        faults.kill.check("micro", step + 1, j)
    return totals


def evaluate(run: Run, tlog: TrainLog, faults: Faults) -> dict[str, float] | None:
    """Validation on a fixed set of samples; on out-of-memory, again from the start with half the batch."""
    if run.val_loader is None:
        return None
    faults.kill.check("validation", run.progress.step)
    cfg = run.cfg.train
    count = len(run.val_loader.dataset)
    if cfg.max_val_batches:  # the set depends on settings only, never on the hardware's batch size
        count = min(count, cfg.max_val_batches * (cfg.val_batch_size or cfg.effective_batch))
    while True:
        metrics, error = validation_pass(run, count)
        if error is None:
            means = tlog.validation(run.progress.step, metrics)
            bad = sorted(k for k, v in means.items() if not math.isfinite(v))
            if bad:
                raise TrainingDiverged(f"validation {', '.join(bad)} is {means[bad[0]]}")
            keep_if_best(run, means)
            return means
        release_memory(run.hw.device)
        run.hw.halve_val_batch(error)
        log.warning("out of memory in validation (%s): validating again with batch %d; pass --val-batch-size %d to "
                    "start there", error, run.hw.val_batch, run.hw.val_batch)
        tlog.scalar("hardware/val_batch", run.hw.val_batch, run.progress.step)


def keep_if_best(run: Run, means: dict[str, float]) -> None:
    """best.pth: the checkpoint of the best validation so far (compared across resumes too)."""
    metric, progress = run.cfg.train.best_metric, run.progress
    if progress.improves(metric, means):
        progress.best = {"metric": metric, "value": means[metric], "step": progress.step}
        run.checkpoints.save_best(progress.step, metric, means[metric])


def validation_pass(run: Run, count: int) -> tuple[dict[str, StepMetrics], str | None]:
    """Metrics per language over the first `count` validation samples (one language per batch)."""
    size = run.hw.val_batch
    by_lang = run.val_loader.dataset.samples.languages(count)
    mine = {lang: run.world.share(ids) for lang, ids in by_lang.items()}  # under torchrun: every N-th sample
    chunks = [(lang, ids[i: i + size]) for lang, ids in sorted(mine.items()) for i in range(0, len(ids), size)]
    run.model.eval()
    metrics = {lang: StepMetrics() for lang in by_lang}
    error = None
    try:
        batches = run.val_loader.batches([StepPlan(0, 0, [ids for _, ids in chunks])])
        for (lang, _), batch in zip(chunks, batches):
            run.hw.oom.check(len(batch.ids))
            metrics[lang].add(batch_loss_sums(run.model, batch, run.hw.device, run.hw.amp_dtype), len(batch.ids))
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise nondeterministic_or(exc, f"in the validation at step {run.progress.step}")
        error = oom_message(exc)
    return run.world.reduce_validation(metrics, error)  # under torchrun: the sums of all processes


def stop_keeping_progress(run: Run, tlog: TrainLog, first_step: int, error: Exception, advice: str) -> None:
    """Stopping on an error between steps: the weights and optimizer are still at the last step
    boundary, so the steps since the last save are kept (their scalars too: a resume purges none)."""
    log.error("%s", error)
    run.optim.discard_gradients()
    if run.progress.step > first_step:
        tlog.write_steps()
        run.checkpoints.save(run.progress.step)
    log.error("%s, then continue with --resume auto --output-dir %s", advice, run.cfg.run_dir)

