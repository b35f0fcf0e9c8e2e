"""The training samples and where the data order stands: the "data" section of a checkpoint.

Position is kept in samples: `samples_in_epoch` of epoch `epoch` have been trained. The rest of
the epoch is the epoch's order from that offset, cut into steps of the effective batch, so a
resume never iterates or loads the samples before it. An allowed change of the effective batch
or of the data order mid-epoch keeps the order the epoch was made with and cuts its rest anew:
no sample is repeated or skipped, and the change shapes the epochs after it.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

from trainers.data.data_order import DataOrder, StepPlan, packed_lengths
from trainers.data.features import FeatureDataset, FeatureSpec
from trainers.data.manifest import Sample

log = logging.getLogger("train")

ORDER_NAMES = {True: "grouped", False: "random"}  # the --data-order choices


class TrainData:
    def __init__(self, samples: Sequence[Sample], spec: FeatureSpec, seed: int, effective_batch: int,
                 grouped: bool) -> None:
        self.samples = list(samples)
        self.dataset = FeatureDataset(self.samples, spec)
        self.seed = seed
        self.effective_batch = effective_batch
        self.grouped = grouped
        self.lengths = packed_lengths([s.text_len for s in self.samples], [s.code_len for s in self.samples])
        self.epoch = 0
        self.step_in_epoch = 0  # steps taken in this epoch (a label: the offset is the position)
        self.samples_in_epoch = 0
        # How the current epoch's order was made.
        self.order_batch = effective_batch
        self.order_grouped = grouped

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
        order = DataOrder(self.seed, len(self.samples), self.order_batch, self.lengths, self.order_grouped)
        return order.plan_rest(self.epoch, self.samples_in_epoch, self.effective_batch, micro_batch,
                               self.step_in_epoch)

    def advance(self, plan: StepPlan) -> None:
        """Move past a finished step; the end of an epoch is step 0 of the next."""
        self.samples_in_epoch += len(plan.samples)
        self.step_in_epoch += 1
        if self.samples_in_epoch >= len(self.samples):
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch, self.step_in_epoch, self.samples_in_epoch = self.epoch + 1, 0, 0
        self.order_batch, self.order_grouped = self.effective_batch, self.grouped

    def ids(self, plan: StepPlan) -> list[str]:
        return [self.samples[i].id for i in plan.samples]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "samples_in_epoch": self.samples_in_epoch,
                "order_batch": self.order_batch, "order": ORDER_NAMES[self.order_grouped]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.samples_in_epoch = int(state["epoch"]), int(state["samples_in_epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.order_batch, self.order_grouped = int(state["order_batch"]), state["order"] == ORDER_NAMES[True]
        if self.samples_in_epoch >= len(self.samples):  # a format-1 file saved at the very end of an epoch
            self._next_epoch()
        if self.order_batch != self.effective_batch:
            self.step_in_epoch = self.samples_in_epoch // self.effective_batch
            log.warning("effective batch changed from %d to %d: resuming epoch %d at sample %d (step %d); no sample "
                        "of this epoch is repeated or skipped", self.order_batch, self.effective_batch, self.epoch,
                        self.samples_in_epoch, self.step_in_epoch)
        if self.order_grouped != self.grouped:
            log.warning("data order changed from %s to %s: the rest of epoch %d keeps its order, later epochs are %s",
                        ORDER_NAMES[self.order_grouped], ORDER_NAMES[self.grouped], self.epoch,
                        ORDER_NAMES[self.grouped])
