"""The learning-rate schedule of this invocation: the saved one, a changed one, or a continuation.

Decided before the model is built, together with where this invocation stops, so that a plan
that would train at a learning rate of 0 is refused in seconds instead of running for hours
without changing a weight, and a plan that trains on at the floor says so before it starts.

A continuation (--rewarm, --reconfigure-scheduler) is saved with the schedule. Passing the
same flags again on a resume of that extension keeps the saved continuation instead of
starting another one from the resume step, so re-running the command that was interrupted
resumes exactly.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from trainers.config.flags import CommandLine
from trainers.errors import UserError
from trainers.run.run_dir import RunConfig
from trainers.training.lr_schedule import Continuation, LRSchedule, Rewarm
from trainers.training.optimization import configured_schedule

log = logging.getLogger("train")


def plan_schedule(cfg: RunConfig, saved: LRSchedule | None, step: int, end: int, cmd: CommandLine) -> LRSchedule:
    configured = configured_schedule(cfg.settings)
    schedule = adopt_schedule(saved, configured, step) if saved else configured
    if cmd.rewarm or cmd.reconfigure_scheduler:
        flag = "--rewarm" if cmd.rewarm else "--reconfigure-scheduler"
        if saved is None:
            log.info("%s applies when resuming; this run starts at step 0 with its planned schedule", flag)
        elif end > step and _already_planned(schedule, step, end, cmd):
            log.info("learning rate: the saved schedule already holds this %s continuation; it goes on as saved", flag)
        elif end > step:
            schedule = _extended(schedule, step, end, cmd)
        return schedule
    if end > schedule.end_step:
        if schedule.floor == 0.0:
            raise UserError(
                f"this run would train to step {end}, but its learning-rate schedule ends at step {schedule.end_step} "
                f"and stays at 0 after it (--min-lr-ratio 0): those steps would change no weight. Choose one:\n"
                f"{_choices(cfg, schedule, step, end)}\n"
                f"  --min-lr-ratio R --allow-config-change: train past step {schedule.end_step} at R x the peak rate\n"
                "or a smaller --max-steps / --epochs (nothing was changed)")
        first = max(step, schedule.end_step) + 1
        log.warning("training past the end of the learning-rate schedule, step %d:", schedule.end_step)
        log.warning("steps %d to %d train at its floor %.4g (--min-lr-ratio %g), the lowest rate of the run", first,
                    end, schedule.floor, schedule.base.min_lr_ratio)
        log.warning("to train them at a higher rate, stop now (Ctrl-C) and resume with one of:")
        for line in _choices(cfg, schedule, step, end).splitlines():
            log.warning("%s", line)
    return schedule


def _choices(cfg: RunConfig, schedule: LRSchedule, step: int, end: int) -> str:
    """The continuations offered for an extension past the schedule's end, each with what it does to the rate."""
    last = schedule.lr_at(max(0, step - 1))
    peak, rise = schedule.base.base_lr, default_rewarm_steps(schedule, step, end)
    stretched = configured_schedule(replace(cfg.settings, lr_decay_steps=end))
    jump = _jump(schedule.lr_at(step), stretched.lr_at(step))
    return (f"  --rewarm: the rate rises from its current {last:.4g} back to the peak {peak:.4g} over {rise} steps,\n"
            f"    then a cosine takes it down to {schedule.floor:.4g} at step {end} (the usual way to train a finished run\n"
            f"    further; --rewarm-lr and --rewarm-steps change the peak and the rise)\n"
            f"  --reconfigure-scheduler: no warmup, a cosine from the current {last:.4g} down to {schedule.floor:.4g}\n"
            f"    at step {end}: the rate never rises above {last:.4g}\n"
            f"  --lr-decay-steps {end} --allow-config-change: the original cosine stretched to step {end}\n"
            f"    ({jump})")


def default_rewarm_steps(schedule: LRSchedule, step: int, end: int) -> int:
    """The run's --warmup-steps, but at most a quarter of the extension, so most of it is the decay."""
    return min(schedule.base.warmup_steps, (end - step) // 4)


def _extended(schedule: LRSchedule, step: int, end: int, cmd: CommandLine) -> LRSchedule:
    if cmd.reconfigure_scheduler:
        schedule = schedule.continued(step, end)  # the start-up summary states it (trainers/run/setup.py)
        log.info("learning rate: the first step after the resume trains at %.4g, the rate of the last step",
                 schedule.lr_at(step))
        return schedule
    peak = cmd.rewarm_lr if cmd.rewarm_lr is not None else schedule.base.base_lr
    rise = cmd.rewarm_steps if cmd.rewarm_steps is not None else default_rewarm_steps(schedule, step, end)
    if rise >= end - step:
        raise UserError(f"--rewarm-steps {rise}: this invocation trains {end - step} steps (step {step} to {end}), "
                        f"so the rate would never come down from its peak; pass --rewarm-steps below {end - step}, or "
                        "leave it out for the default (the run's --warmup-steps, at most a quarter of the extension)")
    schedule = schedule.rewarmed(step, end, peak, rise)  # the start-up summary states it (trainers/run/setup.py)
    log.info("learning rate: the first step after the resume trains at %.4g", schedule.lr_at(step))
    return schedule


def _already_planned(schedule: LRSchedule, step: int, end: int, cmd: CommandLine) -> bool:
    """The saved schedule's last continuation is the one this command asks for (a resume of that extension)."""
    if not schedule.continuations:
        return False
    last = schedule.continuations[-1]
    if last.end_step != end or last.start_step > step:
        return False
    if cmd.reconfigure_scheduler:
        return isinstance(last, Continuation)
    return (isinstance(last, Rewarm) and cmd.rewarm_lr in (None, last.peak_lr)
            and cmd.rewarm_steps in (None, last.warmup_steps))


def adopt_schedule(saved: LRSchedule, configured: LRSchedule, step: int) -> LRSchedule:
    """The saved schedule (with its continuations) unless the settings changed it, which is said, with the jump."""
    if saved.base == configured.base:
        return saved
    before, after = saved.lr_at(step), configured.lr_at(step)
    log.warning("the learning-rate schedule differs from the saved one%s",
                "; its saved continuation is dropped" if saved.continuations else "")
    log.warning("saved: %s", "; ".join(saved.base.describe()))
    log.warning("now: %s", "; ".join(configured.base.describe()))
    log.warning("the learning rate of the next step is %.4g instead of %.4g (x%.3g)", after, before,
                after / before if before else float("inf"))
    return configured


def _jump(before: float, after: float) -> str:
    """The change of the next step's rate, as printed: equal rates (say, both in the warmup) are no jump."""
    if f"{before:.4g}" == f"{after:.4g}":
        return f"no jump: the next step's rate stays {before:.4g}"
    return f"the next step's rate jumps from {before:.4g} to {after:.4g}"
