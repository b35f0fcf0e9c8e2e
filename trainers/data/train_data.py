"""The training samples and where the data order stands: the "data" section of a checkpoint.

Position is kept in samples: `samples_in_epoch` of epoch `epoch` have been trained. The rest of
the epoch is the epoch's order from that offset, cut into steps of the effective batch, so a
resume never iterates or loads the samples before it. An epoch keeps the order it was made with
(its effective batch, data order and training subset): an allowed change of those mid-epoch
takes effect at the next epoch (at once at an epoch boundary), so no sample is repeated or
skipped within an epoch.

--train-samples N trains on a fixed subset: the first N of a seed-keyed permutation of all
samples, in manifest order. A larger N keeps every sample of a smaller one.

With replay mixing (trainers/data/mixing.py) the epoch, its order and the subset are the target
manifests' samples only, each step takes `epoch_batch` of them (the effective batch less the replay
samples), and the replay manifests' draws are added to each step; how many each has given so far is
saved beside the position (`replayed`).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence

import numpy as np

from trainers.data.data_order import DataOrder, StepPlan, StepPlans, longest_first, packed_lengths, split_micro_batches
from trainers.data.features import FeatureDataset, FeatureSpec
from trainers.data.mixing import Mixing
from trainers.data.sample_table import Sample, SampleTable

log = logging.getLogger("train")

ORDER_NAMES = {True: "grouped", False: "random"}  # the --data-order choices
_SUBSET_KEY = 0x5B5E7  # keys the subset's permutation apart from every epoch's order
# (epoch, step in epoch, samples in epoch, order's batch, order grouped, order's samples)
Position = tuple[int, int, int, int, bool, int]


class TrainData:
    def __init__(self, samples: Sequence[Sample], spec: FeatureSpec, seed: int, effective_batch: int,
                 grouped: bool, train_samples: int = 0, mixing: Mixing | None = None) -> None:
        self.samples = SampleTable.of(samples)
        self.dataset = FeatureDataset(self.samples, spec)
        self.seed = seed
        self.effective_batch = effective_batch
        self.mixing = mixing
        # The samples the epochs are made of, and how many of them a step takes: all of them and the effective
        # batch, or with replay mixing the target manifests' samples and the effective batch less the replays.
        self.pool = mixing.target if mixing else np.arange(len(self.samples))
        self.epoch_batch = mixing.target_per_step if mixing else effective_batch
        self.replayed = [0] * (len(mixing.replays) if mixing else 0)  # samples drawn from each replay manifest
        self.grouped = grouped
        self.subset_size = train_samples or len(self.pool)
        self.lengths = packed_lengths(self.samples.text_len, self.samples.code_len)
        self.lengths.setflags(write=False)  # shared with each epoch's DataOrder instead of copied
        self.epoch = 0
        self.step_in_epoch = 0  # steps taken in this epoch (a label: the offset is the position)
        self.samples_in_epoch = 0
        # How the current epoch's order was made.
        self.order_batch, self.order_grouped, self.order_samples = self.epoch_batch, grouped, self.subset_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.subset_size / self.epoch_batch)

    def steps_left(self, epochs: int, saved: dict[str, Any] | None = None) -> int:
        """Optimizer steps to the end of epoch `epochs - 1`: from here, or from the position a checkpoint's
        data section `saved` holds (read, not restored: the run's plan is decided before its restore)."""
        epoch, _, samples_in_epoch, _, _, order_samples = self._position(saved or self.state_dict())
        if epoch >= epochs:
            return 0
        this_epoch = math.ceil((order_samples - samples_in_epoch) / self.epoch_batch)
        return this_epoch + (epochs - epoch - 1) * self.steps_per_epoch

    def subset(self, size: int) -> np.ndarray:
        """The indices of the `size` samples trained on, in manifest order."""
        if size >= len(self.pool):
            return self.pool
        chosen = np.random.Generator(np.random.PCG64([self.seed, _SUBSET_KEY])).permutation(len(self.pool))
        return self.pool[np.sort(chosen[:size])]

    def plan_epoch(self, micro_batch: int) -> StepPlans:
        """The remaining steps of the current epoch, each cut into micro-batches (of sample indices)."""
        chosen = self.subset(self.order_samples)
        lengths = self.lengths if len(chosen) == len(self.samples) else self.lengths[chosen]
        order = DataOrder(self.seed, len(chosen), self.order_batch, lengths, self.order_grouped)
        plans = order.plan_rest(self.epoch, self.samples_in_epoch, self.epoch_batch, micro_batch,
                                self.step_in_epoch, chosen if len(chosen) < len(self.samples) else None)
        return plans.each(self._with_replay(plans.first_step, micro_batch)) if self.mixing else plans

    def _with_replay(self, first_step: int, micro_batch: int) -> Callable[[StepPlan], StepPlan]:
        """Adds each replay manifest's samples to a step of the plans made now (every step before it is full)."""
        mixing, start, grouped = self.mixing, list(self.replayed), self.order_grouped
        assert mixing is not None

        def mix(plan: StepPlan) -> StepPlan:
            target = np.asarray(plan.samples, dtype=np.int64)
            counts = mixing.counts(len(target), self.epoch_batch)
            done = plan.step_in_epoch - first_step
            drawn = [r.take(self.seed, start[i] + done * r.per_step, counts[i]) for i, r in enumerate(mixing.replays)]
            samples = np.concatenate([target, *drawn])
            if grouped:
                samples = longest_first(samples, self.lengths)
            return StepPlan(plan.epoch, plan.step_in_epoch, split_micro_batches(samples, micro_batch), counts)
        return mix

    def advance(self, plan: StepPlan) -> None:
        """Move past a finished step; the end of an epoch is step 0 of the next."""
        self.samples_in_epoch += len(plan.samples) - sum(plan.replayed)
        if plan.replayed:
            self.replayed = [drawn + n for drawn, n in zip(self.replayed, plan.replayed)]
        self.step_in_epoch += 1
        if self.samples_in_epoch >= self.order_samples:
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch, self.step_in_epoch, self.samples_in_epoch = self.epoch + 1, 0, 0
        self.order_batch, self.order_grouped, self.order_samples = self.epoch_batch, self.grouped, self.subset_size

    def ids(self, plan: StepPlan) -> list[str]:
        return [self.samples.ids[i] for i in plan.samples]

    def token_counts(self, plan: StepPlan) -> tuple[int, int]:
        """Text and mel target tokens of a step (each sequence plus its stop token)."""
        samples = np.asarray(plan.samples, dtype=np.int64)
        return (int(self.samples.text_len[samples].sum()) + len(samples),
                int(self.samples.code_len[samples].sum()) + len(samples))

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "samples_in_epoch": self.samples_in_epoch,
                 "order_batch": self.order_batch, "order": ORDER_NAMES[self.order_grouped],
                 "order_samples": self.order_samples}
        if self.mixing:  # by the manifest's place among the --train-manifest flags
            state["replayed"] = {str(r.manifest): n for r, n in zip(self.mixing.replays, self.replayed)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        (self.epoch, self.step_in_epoch, self.samples_in_epoch, self.order_batch, self.order_grouped,
         self.order_samples) = self._position(state)
        if self.mixing:  # a replay manifest new to the run (an allowed change of the shares) starts at its first cycle
            saved = state.get("replayed") or {}
            self.replayed = [int(saved.get(str(r.manifest), 0)) for r in self.mixing.replays]
        self._report_changes()

    def _position(self, state: dict[str, Any]) -> Position:
        """The position a saved data section continues at, with today's settings; changes nothing."""
        epoch, samples_in_epoch = int(state["epoch"]), int(state["samples_in_epoch"])
        step_in_epoch = int(state["step_in_epoch"])
        order_batch, order_grouped = int(state["order_batch"]), state["order"] == ORDER_NAMES[True]
        # Files written before training subsets existed trained every sample.
        order_samples = min(int(state.get("order_samples") or len(self.pool)), len(self.pool))
        if samples_in_epoch >= order_samples:  # a format-1 file saved at the very end of an epoch
            epoch, samples_in_epoch = epoch + 1, 0
        if samples_in_epoch == 0:  # nothing of this epoch trained yet: it takes today's settings
            step_in_epoch = 0
            order_batch, order_grouped, order_samples = self.epoch_batch, self.grouped, self.subset_size
        if order_batch != self.epoch_batch:  # the epoch goes on with today's batch, from the same sample
            step_in_epoch = samples_in_epoch // self.epoch_batch
        return epoch, step_in_epoch, samples_in_epoch, order_batch, order_grouped, order_samples

    def _report_changes(self) -> None:
        if self.order_batch != self.epoch_batch:
            what = "target samples per step (the effective batch less the replay shares)" if self.mixing else \
                "effective batch"
            log.warning("%s changed from %d to %d", what, self.order_batch, self.epoch_batch)
            log.warning("resuming epoch %d at sample %d (step %d); no sample of this epoch is repeated or skipped",
                        self.epoch, self.samples_in_epoch, self.step_in_epoch)
        if self.order_grouped != self.grouped:
            log.warning("data order changed from %s to %s: the rest of epoch %d keeps its order",
                        ORDER_NAMES[self.order_grouped], ORDER_NAMES[self.grouped], self.epoch)
            log.warning("later epochs are %s", ORDER_NAMES[self.grouped])
        if self.order_samples != self.subset_size:
            log.warning("training samples changed from %d to %d: the rest of epoch %d keeps its %d samples",
                        self.order_samples, self.subset_size, self.epoch, self.order_samples)
            log.warning("(none repeated or skipped); from epoch %d on each epoch has %d", self.epoch + 1,
                        self.subset_size)
