"""The trainer's main(): what `indextts-train`, `python trainers/train_gpt_v2.py` and trainers.experiment
run. It sets the run up, runs the training loop (trainers/loop.py) and turns how it ends into an exit
status. The command line, its flags and exit statuses: trainers/cli.py and trainers/train_gpt_v2.py.
"""
from __future__ import annotations

import logging

from tqdm import tqdm

from trainers.config.flags import CommandLine, parse_command_line
from trainers.data.features import FeatureError
from trainers.errors import (
    EXIT_DIVERGED, EXIT_HOST_MEMORY, EXIT_OK, EXIT_OUT_OF_MEMORY, EXIT_SAVE_FAILED, EXIT_USAGE, CheckpointWriteError,
    DistributedFailure, HostMemoryError, LogWriteError, TrainingDiverged, UserError,
)
from trainers.faults import Faults
from trainers.hardware.determinism import NO_DETERMINISM_ADVICE, NondeterministicOp
from trainers.hardware.oom_recovery import OutOfMemoryStop, is_out_of_memory, oom_message
from trainers.loop import ended, evaluate, train_steps
from trainers.run.setup import Run, setup_run
from trainers.stop_signals import EarlySignals, StopNow, StopRequest
from trainers.training.distributed import World
from trainers.training.rank_zero import QuietLog
from trainers.training.train_log import TrainLog, setup_logging

log = logging.getLogger("train")


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
        faults.at("setup")
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
            where += ". " + run.hardware.record_out_of_memory(world.rank_batch(run.settings.effective_batch),
                                                              f"step {run.progress.step + 1}, in the gradient sum",
                                                              str(exc))
        log.error("%s%s", exc, where)
        return exc.exit_status
    finally:
        stop.uninstall()
        world.close()  # first: under torchrun it ignores stop signals from here on
        if run is not None:
            run.close()


def train(run: Run, stop: StopRequest, faults: Faults) -> int:
    faults.attach(run.checkpoints, run.hardware.oom, run.optim.params)
    # Under torchrun rank 0 alone writes the log, TensorBoard and sample_ids.tsv (each step's ids, of every process).
    # It adds to the run's history and open log interval, which the checkpoints save (rank 0's under torchrun).
    tlog = (TrainLog if run.world.is_main else QuietLog)(run.cfg.run_dir, run.progress.step,
                                                         history=run.progress.history,
                                                         record_sample_ids=run.settings.log_sample_ids,
                                                         interval=run.progress.interval)
    if run.progress.step >= run.total_steps:
        return nothing_to_do(run, tlog, "the run is already at step %d; pass a larger --max-steps or --epochs to "
                             "continue", run.progress.step)
    halted = run.listeners.halted(run.progress.step)  # a stop made before, at a validation (early stopping, ...)
    if halted:
        return nothing_to_do(run, tlog, "%s", halted)
    bar = tqdm(total=run.total_steps, initial=run.progress.step, unit="step",
               disable=None if run.world.is_main else True, dynamic_ncols=True)
    first_step = run.progress.step
    tlog.scalar("hardware/micro_batch", run.micro_batch, run.progress.step)
    try:
        if run.progress.step == 0:
            evaluate(run, tlog, faults)
        stopped = train_steps(run, tlog, bar, stop, faults)  # closes the bar when the steps end
        if stopped is not None:
            return stopped
        evaluate(run, tlog, faults, final=True)
        run.checkpoints.save(run.progress.step)
        run.checkpoints.wait()  # the final save is complete before the trainer says so, or exits
        log.info("training finished at step %d (epoch %d, step %d of it)", run.progress.step, run.data.epoch,
                 run.data.step_in_epoch)
        log.info("to train longer: --resume auto with a larger --max-steps or --epochs")
        return ended(run, stop)  # a signal during the final validation: 128 + N
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
        return failed_update(run, exc)
    finally:
        bar.close()
        tlog.close()


def nothing_to_do(run: Run, tlog: TrainLog, why: str, *args: object) -> int:
    """A resume that has nothing to train still leaves the run directory as its settings say: a lowered
    --keep-checkpoints applies now, not at a save that will not come. `why`: a log line each."""
    for line in ("nothing to do: " + why % args).split("\n"):
        log.info("%s", line)
    if run.world.is_main:
        run.checkpoints.apply_keep(run.progress.step)
    tlog.close()
    return EXIT_OK


def failed_update(run: Run, exc: RuntimeError) -> int:
    """A RuntimeError the loop did not handle: in the optimizer update, where the weights may be partly
    updated, so nothing is saved (a nondeterministic op or out of memory; anything else is raised)."""
    step = run.progress.step + 1
    nondeterministic = NondeterministicOp.from_error(exc, f"in the optimizer update of step {step}")
    if nondeterministic is not None:
        log.error("%s. Nothing was saved from this step; the last checkpoint (%s) is intact. %s", nondeterministic,
                  run.checkpoints.newest_name(), NO_DETERMINISM_ADVICE)
        return EXIT_USAGE
    if not is_out_of_memory(exc):
        raise exc
    error = oom_message(exc)
    smaller = run.hardware.record_out_of_memory(run.world.rank_batch(run.settings.effective_batch),
                                              f"step {step}, outside forward/backward", error)
    log.error("out of memory outside the forward/backward pass, at step %d: %s. Nothing was saved from this "
              "step; the last checkpoint is intact. %s; continue with --resume auto --output-dir %s", step, error,
              smaller, run.cfg.run_dir)
    return EXIT_OUT_OF_MEMORY


def stop_keeping_progress(run: Run, tlog: TrainLog, first_step: int, error: Exception, advice: str) -> None:
    """Stopping on an error between steps: the weights and optimizer are still at the last step
    boundary, so the steps since the last save are kept (their scalars too: a resume purges none)."""
    log.error("%s", error)
    run.optim.discard_gradients()
    if run.progress.step > first_step:
        tlog.write_steps()
        run.checkpoints.save(run.progress.step)
    log.error("%s, then continue with --resume auto --output-dir %s", advice, run.cfg.run_dir)

