"""The learning-rate schedule of this invocation: the saved one, a changed one, or a continuation.

Decided before the model is built, together with where this invocation stops, so that a plan
that would train at a learning rate of 0 is refused in seconds instead of running for hours
without changing a weight.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from trainers.config.flags import CommandLine
from trainers.errors import UserError
from trainers.run.resolve import RunConfig
from trainers.training.lr_schedule import LRSchedule
from trainers.training.optimization import configured_schedule

log = logging.getLogger("train")


def plan_schedule(cfg: RunConfig, saved: LRSchedule | None, step: int, end: int, cmd: CommandLine) -> LRSchedule:
    schedule = adopt_schedule(saved, configured_schedule(cfg.train), step) if saved else configured_schedule(cfg.train)
    if cmd.reconfigure_scheduler:
        if saved is None:
            log.info("--reconfigure-scheduler applies when resuming; this run starts at step 0 with its planned "
                     "schedule")
        elif end > step:
            schedule = schedule.continued(step, end)
            log.info("learning rate: a new cosine from step %d (%.4g, the rate of the last step) down to %.4g at step "
                     "%d (--reconfigure-scheduler)", step, schedule.lr_at(step), schedule.floor, end)
        return schedule
    if end > schedule.end_step:
        if schedule.floor == 0.0:
            raise UserError(
                f"this run would train to step {end}, but its learning-rate schedule ends at step {schedule.end_step} "
                f"and stays at 0 after it (--min-lr-ratio 0): those steps would change no weight. Choose one:\n"
                f"  --reconfigure-scheduler: a new cosine from the current learning rate "
                f"({schedule.lr_at(max(0, step - 1)):.4g}) down to 0 at step {end}\n"
                f"  --min-lr-ratio R --allow-config-change: train past step {schedule.end_step} at R x the peak rate\n"
                f"  --lr-decay-steps {end} --allow-config-change: the original cosine stretched to step {end} "
                f"({_jump(schedule.lr_at(step), _stretched(cfg, end).lr_at(step))})\n"
                "or a smaller --max-steps / --epochs (nothing was changed)")
        log.info("training past the end of the learning-rate schedule (step %d): the rate stays at its floor %.4g; "
                 "pass --reconfigure-scheduler for a new decay to step %d", schedule.end_step, schedule.floor, end)
    return schedule


def adopt_schedule(saved: LRSchedule, configured: LRSchedule, step: int) -> LRSchedule:
    """The saved schedule (with its continuations) unless the settings changed it, which is said, with the jump."""
    if saved.base == configured.base:
        return saved
    before, after = saved.lr_at(step), configured.lr_at(step)
    log.warning("the learning-rate schedule differs from the saved one (%s, now %s): the learning rate of the next "
                "step is %.4g instead of %.4g (x%.3g)%s", saved.base, configured.base, after, before,
                after / before if before else float("inf"),
                "; the saved continuation of the schedule is dropped" if saved.continuations else "")
    return configured


def _jump(before: float, after: float) -> str:
    """The change of the next step's rate, as printed: equal rates (say, both in the warmup) are no jump."""
    if f"{before:.4g}" == f"{after:.4g}":
        return f"no jump: the next step's rate stays {before:.4g}"
    return f"the next step's rate jumps from {before:.4g} to {after:.4g}"


def _stretched(cfg: RunConfig, end: int) -> LRSchedule:
    return configured_schedule(replace(cfg.train, lr_decay_steps=end))
