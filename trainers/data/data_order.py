"""Which samples make up each optimizer step, as a pure function of the run's settings.

Each epoch has one flat order of all sample indices; step k of an epoch takes the samples flat[k*E : (k+1)*E]
for the effective batch E, and the micro-batch size only decides how those samples are cut
into pieces. Resuming at a step slices the flat order directly, so the cost of skipping does
not grow with the position and no skipped sample is ever loaded.

Two orders exist (DataOrder.grouped):

* plain ("random" in the trainer's flags, and the only order before length grouping existed): the flat order is
  a random permutation keyed by (seed, epoch); a step's samples are cut into micro-batches in
  that order. It does not depend on the effective batch or on sample lengths.
* grouped: the flat order is built so that each step holds samples of similar length (see
  grouped_epoch_order), and inside a step the samples are sorted by length before they are
  cut, so each micro-batch pads little. The flat order depends on (seed, epoch, lengths,
  effective batch), never on the micro-batch size.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from trainers.model.layout import PREFIX_LEN


def steps_per_epoch(num_samples: int, effective_batch: int) -> int:
    # The last, smaller step of an epoch is kept: the loss is normalised per token, so a
    # short step is a correct step, and no sample is silently left out.
    return math.ceil(num_samples / effective_batch)


# Grouped order: steps are formed inside windows of this many steps of the shuffled epoch, so
# a step spans about 1/GROUP_WINDOW_STEPS of its window's length quantiles. The window trades
# padding against how random a step's make-up stays; benchmarks/padding.py prints both, for
# synthetic TTS lengths at effective batch 32:
# * padding, real/padded token slots at micro-batch 4 / 8 / 16 / 32: .989 / .974 / .944 / .883
#   (plain order .603 / .491 / - / .358; a window of 32 steps: .995 / .987 / .972 / .941);
# * randomness: a sample's step-mates are its nearest lengths in its window, a fresh random
#   subset of the epoch, so the share of step-mates that meet again next epoch grows like
#   window / epoch: 0.16 for a 2,000-sample corpus (window 32: 0.33; whole epochs sorted: 0.84);
# * the spread of tokens per step, what grouping changes in a step's statistics (coefficient of
#   variation 0.11 plain), is 0.53-0.61 for any window from 4 steps on: no reason to go smaller.
# Changing this value changes every grouped order, so runs that resume depend on it.
GROUP_WINDOW_STEPS = 16


def packed_lengths(text_lens, code_lens) -> np.ndarray:
    """Packed sequence length of each sample (what a micro-batch is padded to): the prefix, then
    text and codes each with a start and a stop token."""
    text = np.asarray(text_lens, dtype=np.int64)
    codes = np.asarray(code_lens, dtype=np.int64)
    return PREFIX_LEN + (text + 2) + (codes + 2)


def _epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, epoch]))


def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """Permutation of sample indices for one epoch (PCG64 keyed by seed and epoch)."""
    return _epoch_rng(seed, epoch).permutation(num_samples)


def grouped_epoch_order(seed: int, epoch: int, lengths: np.ndarray, effective_batch: int,
                        window_steps: int = GROUP_WINDOW_STEPS) -> np.ndarray:
    """Flat order of one epoch whose steps (flat[k*E:(k+1)*E]) each hold samples of similar length.

    1. Shuffle: the same permutation as epoch_order(seed, epoch, N).
    2. Its last N mod E samples form the short step, kept as the epoch's last: a random set,
       not the tail of a sorted window (which would always be that window's longest samples).
    3. The rest is cut into windows of window_steps * E samples; each window is sorted
       by length (stable, so equal lengths keep their random order) and cut into steps of E.
    4. The full steps are shuffled with the same generator, so a step's length band tells
       nothing about where it falls in the epoch.
    """
    n, batch = len(lengths), effective_batch
    rng = _epoch_rng(seed, epoch)
    order = rng.permutation(n)  # drawn first: identical to epoch_order(seed, epoch, n)
    full = n - n % batch
    body, short = order[:full], order[full:]
    window = np.arange(full) // (window_steps * batch)
    body = body[np.lexsort((lengths[body], window))]  # by window, then length; lexsort is stable
    steps = body.reshape(-1, batch)[rng.permutation(full // batch)]
    return np.concatenate([steps.reshape(-1), short])


def step_samples(order: np.ndarray, step_in_epoch: int, effective_batch: int) -> np.ndarray:
    start = step_in_epoch * effective_batch
    return order[start : start + effective_batch]


def split_micro_batches(samples: np.ndarray, micro_batch: int) -> list[list[int]]:
    return [samples[i : i + micro_batch].tolist() for i in range(0, len(samples), micro_batch)]


def longest_first(samples: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A step's samples by length, longest first, equal lengths by sample index.

    Depends on the set of samples only, so cutting the result into micro-batches of any size
    gives the same concatenation. Longest first: a micro-batch that does not fit in memory
    fails on the step's first forward pass, before the others have been computed.
    """
    samples = np.asarray(samples)
    return samples[np.lexsort((samples, -lengths[samples]))]


@dataclass(frozen=True)
class StepPlan:
    epoch: int
    step_in_epoch: int
    micro_batches: list[list[int]]
    # With replay mixing (trainers/data/mixing.py): how many of the samples each replay manifest gave; the
    # others are the epoch's (target) samples.
    replayed: tuple[int, ...] = ()

    @property
    def samples(self) -> list[int]:
        return [i for mb in self.micro_batches for i in mb]


@dataclass(frozen=True)
class DataOrder:
    """The data order of a run.

    DataOrder(seed, num_samples, effective_batch) is the plain order, exactly as before length
    grouping existed. grouped=True needs `lengths`, the packed length of each sample
    (packed_lengths); in the plain order lengths are accepted and ignored.
    """

    seed: int
    num_samples: int
    effective_batch: int
    lengths: np.ndarray | None = field(default=None, compare=False, repr=False)
    grouped: bool = False
    # What equality compares instead of the array itself.
    lengths_digest: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.lengths is None:
            if self.grouped:
                raise ValueError("DataOrder(grouped=True) needs the packed length of every sample (lengths=...)")
            return
        lengths = self.lengths
        frozen = isinstance(lengths, np.ndarray) and lengths.dtype == np.int64 and not lengths.flags.writeable
        if not (frozen and lengths.flags.owndata):  # a read-only array of its own is shared, not copied
            lengths = np.array(lengths, dtype=np.int64)  # a private copy, made read-only
        if lengths.shape != (self.num_samples,):
            raise ValueError(f"lengths has shape {lengths.shape}; expected one length per sample ({self.num_samples},)")
        if self.num_samples and lengths.min() < 1:
            raise ValueError(f"lengths must be positive; sample {int(lengths.argmin())} has {int(lengths.min())}")
        lengths.setflags(write=False)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "lengths_digest", hashlib.sha256(lengths.tobytes()).hexdigest())

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.num_samples, self.effective_batch)

    def flat_order(self, epoch: int) -> np.ndarray:
        """All sample indices of one epoch; step k takes flat[k*E : (k+1)*E]."""
        if self.grouped:
            return grouped_epoch_order(self.seed, epoch, self.lengths, self.effective_batch)
        return epoch_order(self.seed, epoch, self.num_samples)

    def plan_epoch(self, epoch: int, start_step: int, micro_batch: int) -> list[StepPlan]:
        """Plans for steps start_step.. of one epoch; earlier steps are never materialised."""
        return self.plan_rest(epoch, start_step * self.effective_batch, self.effective_batch, micro_batch, start_step)

    def plan_rest(self, epoch: int, offset: int, batch: int, micro_batch: int, first_step: int = 0,
                  chosen: np.ndarray | None = None) -> StepPlans:
        """Plans for the rest of an epoch from sample `offset`, in steps of `batch` samples.

        `batch` differs from this order's effective batch only after an allowed change of the
        effective batch mid-epoch: the epoch keeps the order it was made with and its rest is
        cut anew, so no sample is repeated or skipped. `chosen`: this order numbers a training
        subset; chosen[i] is the sample index of its i-th member.
        """
        return StepPlans(self, epoch, self.flat_order(epoch)[offset:], batch, micro_batch, first_step, chosen)


class StepPlans(Sequence[StepPlan]):
    """The steps of the rest of an epoch, each made when it is reached: an epoch of a million samples is
    one array of indices, not a Python list per step made before the first one."""

    def __init__(self, order: DataOrder, epoch: int, rest: np.ndarray, batch: int, micro_batch: int,
                 first_step: int, chosen: np.ndarray | None = None, steps: int | None = None,
                 then: Callable[[StepPlan], StepPlan] | None = None) -> None:
        self.order, self.epoch, self.rest, self.batch = order, epoch, rest, batch
        self.micro_batch, self.first_step, self.chosen, self.then = micro_batch, first_step, chosen, then
        self.steps = math.ceil(len(rest) / batch) if steps is None else steps

    def _with(self, steps: int, then: Callable[[StepPlan], StepPlan] | None) -> StepPlans:
        return StepPlans(self.order, self.epoch, self.rest, self.batch, self.micro_batch, self.first_step,
                         self.chosen, steps, then)

    def each(self, then: Callable[[StepPlan], StepPlan]) -> StepPlans:
        """The same steps, each passed through `then` when it is made (e.g. one process's share of it)."""
        before = self.then
        return self._with(self.steps, then if before is None else lambda plan: then(before(plan)))

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k):
        if isinstance(k, slice):
            start, stop, stride = k.indices(self.steps)
            if start == 0 and stride == 1:  # a prefix (the steps left in a run) stays lazy
                return self._with(stop, self.then)
            return [self[i] for i in range(start, stop, stride)]
        if k < 0:
            k += self.steps
        if not 0 <= k < self.steps:
            raise IndexError(f"step {k} of {self.steps}")
        samples = self.rest[k * self.batch: (k + 1) * self.batch]
        if self.order.grouped:
            samples = longest_first(samples, self.order.lengths)
        if self.chosen is not None:
            samples = self.chosen[samples]
        plan = StepPlan(self.epoch, self.first_step + k, split_micro_batches(samples, self.micro_batch))
        return plan if self.then is None else self.then(plan)

    def __iter__(self) -> Iterator[StepPlan]:
        return (self[k] for k in range(self.steps))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # compared by contents, like the list it replaces
