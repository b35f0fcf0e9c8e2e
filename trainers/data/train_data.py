"""The training samples and where the data order stands: the "data" section of a checkpoint.

Position is kept in samples: `samples_in_epoch` of epoch `epoch` have been trained. The rest of
the epoch is the epoch's order from that offset, cut into steps of the effective batch, so a
resume never iterates or loads the samples before it, and a resume with another effective
batch (allowed with --allow-config-change) continues at the same sample, none repeated or skipped.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

from trainers.data.data_order import StepPlan, epoch_order, split_micro_batches
from trainers.data.features import FeatureDataset, FeatureSpec
from trainers.data.manifest import Sample

log = logging.getLogger("train")


class TrainData:
    def __init__(self, samples: Sequence[Sample], spec: FeatureSpec, seed: int, effective_batch: int) -> None:
        self.samples = list(samples)
        self.dataset = FeatureDataset(self.samples, spec)
        self.seed = seed
        self.effective_batch = effective_batch
        self.epoch = 0
        self.step_in_epoch = 0  # steps taken in this epoch (a label: the offset is the position)
        self.samples_in_epoch = 0
        self.order_batch = effective_batch  # the effective batch this epoch's order was made for

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.samples) / self.effective_batch)

    def steps_left(self, epochs: int) -> int:
        """Optimizer steps from here to the end of epoch `epochs - 1`."""
        if self.epoch >= epochs:
            return 0
        this_epoch = math.ceil((len(self.samples) - self.samples_in_epoch) / self.effective_batch)
        return this_epoch + (epochs - self.epoch - 1) * self.steps_per_epoch

    def plan_epoch(self, micro_batch: int) -> list[StepPlan]:
        """The remaining steps of the current epoch, each cut into micro-batches."""
        order = epoch_order(self.seed, self.epoch, len(self.samples))[self.samples_in_epoch:]
        e = self.effective_batch
        return [StepPlan(self.epoch, self.step_in_epoch + k, split_micro_batches(order[i: i + e], micro_batch))
                for k, i in enumerate(range(0, len(order), e))]

    def advance(self, plan: StepPlan) -> None:
        """Move past a finished step; the end of an epoch is step 0 of the next."""
        self.samples_in_epoch += len(plan.samples)
        self.step_in_epoch += 1
        if self.samples_in_epoch >= len(self.samples):
            self.epoch, self.step_in_epoch, self.samples_in_epoch = self.epoch + 1, 0, 0
            self.order_batch = self.effective_batch

    def ids(self, plan: StepPlan) -> list[str]:
        return [self.samples[i].id for i in plan.samples]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "samples_in_epoch": self.samples_in_epoch,
                "order_batch": self.order_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.samples_in_epoch = int(state["epoch"]), int(state["samples_in_epoch"])
        self.order_batch = int(state["order_batch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        if self.order_batch != self.effective_batch:
            self.step_in_epoch = self.samples_in_epoch // self.effective_batch
            log.warning("effective batch changed from %d to %d: resuming epoch %d at sample %d (step %d); no sample "
                        "of this epoch is repeated or skipped", self.order_batch, self.effective_batch, self.epoch,
                        self.samples_in_epoch, self.step_in_epoch)
        if self.samples_in_epoch >= len(self.samples):  # a v1 file saved at the very end of an epoch
            self.epoch, self.step_in_epoch, self.samples_in_epoch = self.epoch + 1, 0, 0
            self.order_batch = self.effective_batch
