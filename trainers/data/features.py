"""Load one sample's precomputed .npy features and pad micro-batches.

Manifest validation only proves the files exist; the contents are checked here, when a sample is first read,
and every failure names the manifest line so the user knows which sample to fix.

A sample becomes named arrays (`FeatureSpec.read`): its text ids and codes, and its model family's
conditioning inputs (IndexTTS2: `condition` and `emo_vec`); a family with other inputs subclasses
FeatureSpec (trainers/families). A micro-batch is those arrays as named tensors (`Batch.inputs`),
which the model takes by name, so a new input is added in its family only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from trainers.data.sample_table import Sample, SampleTable
from trainers.model.layout import CONDITION_LEN

TRAILING_RUN_WARN = 16  # this many identical final codes looks like saved padding
# Conditioning latents and emotion vectors are normalised encoder outputs; beyond this a value is
# corrupt (e.g. 1e38 makes every loss overflow) rather than an unusual voice.
MAX_ABS_FEATURE = 1e4


class FeatureError(RuntimeError):
    """A feature file does not match its manifest line or the model."""


@dataclass(frozen=True)
class FeatureSpec:
    """What the model accepts of a sample's files, and how they become named arrays: the IndexTTS2 (2.0)
    family's .npy text ids and codes, the prompt's conditioning latents [32, D] and emotion vector [D]."""

    model_dim: int
    number_text_tokens: int
    max_code: int  # codes must be < max_code (= start_mel_token); larger ids are special tokens

    def read(self, sample: Sample) -> dict[str, np.ndarray]:
        """The sample's model inputs by name, each checked against its manifest line and the model."""
        return {"text_ids": self.text_ids(sample), "codes": self.codes(sample), **self.conditioning(sample)}

    def conditioning(self, sample: Sample) -> dict[str, np.ndarray]:
        """The inputs the model's prefix is made of (UnifiedVoiceGPT.CONDITIONING), by name."""
        return {"condition": self._condition(sample), "emo_vec": self._emo_vec(sample)}

    def model_dim_files(self, sample: Sample) -> list[tuple[str, str, tuple[int, ...]]]:
        """(what, path, leading shape) of the sample's files whose last axis is model_dim wide
        (trainers/data/feature_fit.py compares it with the config's before anything is built)."""
        return [("condition", sample.condition_path, (CONDITION_LEN,)), ("emo_vec", sample.emo_vec_path, ())]

    def load(self, sample: Sample, what: str, path: str) -> np.ndarray:
        """The array `what` from one of the sample's files (a family whose files are archives overrides it)."""
        return _load_npy(sample, what, path)

    def text_ids(self, sample: Sample) -> np.ndarray:
        path = sample.text_ids_path
        hint = (
            f"text ids must be < gpt.number_text_tokens {self.number_text_tokens}; "
            "the tokenizer probably doesn't match the data (or the config's vocabulary size is wrong)"
        )
        array = self.load(sample, "text_ids", path)
        return _int_vector(sample, "text_ids", path, array, "text_len", self.number_text_tokens, hint)

    def codes(self, sample: Sample) -> np.ndarray:
        path = sample.codes_path
        array = self.load(sample, "codes", path)
        if array.ndim == 2 and array.shape[0] == 1:
            array = array[0]  # [1, N] as saved by batch-of-one extractors
        hint = f"semantic codes must be < {self.max_code} (start_mel_token); were stop/special tokens saved as data?"
        # Suspicious trailing runs are reported by the loader in the main process (once per sample).
        return _int_vector(sample, "codes", path, array, "code_len", self.max_code, hint)

    def _condition(self, sample: Sample) -> np.ndarray:
        path = sample.condition_path
        array = self.load(sample, "condition", path)
        return _float_array(sample, "condition", path, array, (CONDITION_LEN, self.model_dim))

    def _emo_vec(self, sample: Sample) -> np.ndarray:
        path = sample.emo_vec_path
        array = self.load(sample, "emo_vec", path)
        return _float_array(sample, "emo_vec", path, array, (self.model_dim,))


def _fail(sample: Sample, what: str, path: str, problem: str) -> FeatureError:
    return FeatureError(f"{sample.source}: {what} file {path}: {problem}")


def _load_npy(sample: Sample, what: str, path: str) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except FileNotFoundError as exc:
        raise _fail(sample, what, path, "not found; was it deleted after the manifest was validated?") from exc
    except Exception as exc:  # numpy raises several types for corrupt files; all mean "not a usable .npy"
        raise _fail(sample, what, path, f"cannot be loaded as .npy ({exc}); re-extract this feature") from exc
    if not isinstance(array, np.ndarray):  # an .npz archive loads as NpzFile
        array.close()
        raise _fail(sample, what, path, "is an .npz archive; expected a single array saved with np.save")
    return array


def _int_vector(sample: Sample, what: str, path: str, array: np.ndarray, length_key: str, upper: int,
                range_hint: str) -> np.ndarray:
    """Check a 1-D integer id array against its manifest length (the sample's `length_key`) and id range."""
    expected_len = getattr(sample, length_key)
    if array.ndim != 1:
        raise _fail(sample, what, path, f"expected a 1-D array of {expected_len} ids, found shape {list(array.shape)}")
    if not np.issubdtype(array.dtype, np.integer):
        raise _fail(sample, what, path, f"expected integer ids, found dtype {array.dtype}")
    if array.shape[0] != expected_len:
        raise _fail(
            sample,
            what,
            path,
            f"has {array.shape[0]} ids but the manifest says {length_key} {expected_len}; regenerate the manifest or the feature",
        )
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= upper:
        bad = low if low < 0 else high
        raise _fail(sample, what, path, f"id {bad} is outside [0, {upper}); {range_hint}")
    return array.astype(np.int64)


def _float_array(sample: Sample, what: str, path: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Check a float array's shape (tolerating one leading batch axis) and finiteness."""
    if array.ndim == len(shape) + 1 and array.shape[0] == 1:
        array = array[0]  # some extractors keep the batch axis
    if array.shape != shape:
        raise _fail(
            sample,
            what,
            path,
            f"expected shape {list(shape)}, found {list(array.shape)}; was it extracted for a model with another model_dim?",
        )
    if not np.issubdtype(array.dtype, np.floating):
        raise _fail(sample, what, path, f"expected floating-point values, found dtype {array.dtype}")
    finite = np.isfinite(array)
    if not finite.all():
        raise _fail(sample, what, path, f"contains {int((~finite).sum())} NaN/inf values; re-extract this feature")
    largest = float(np.abs(array).max()) if array.size else 0.0
    if largest > MAX_ABS_FEATURE:
        raise _fail(sample, what, path, f"holds a value of magnitude {largest:.3g}, far beyond what the encoders "
                                        f"produce (|x| <= {MAX_ABS_FEATURE:g}); re-extract this feature")
    return array.astype(np.float32)


def trailing_run_length(codes: np.ndarray) -> int:
    """Number of final entries equal to the last entry (0 for an empty array)."""
    if codes.size == 0:
        return 0
    different = np.flatnonzero(codes != codes[-1])
    return int(codes.size if different.size == 0 else codes.size - 1 - different[-1])


class FeatureDataset(Dataset):
    """Map-style dataset reading each sample's .npy files on demand."""

    def __init__(self, samples: Sequence[Sample], spec: FeatureSpec) -> None:
        # A table stays a table: a list of a million Sample objects is what it exists to avoid.
        self.samples = samples if isinstance(samples, SampleTable) else list(samples)
        self.spec = spec

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = self.samples[i]
        return {"index": sample.index, "id": sample.id,
                **{name: torch.from_numpy(array) for name, array in self.spec.read(sample).items()}}


# The inputs every family's model takes besides its conditioning (Batch.inputs).
SEQUENCE_INPUTS = ("text_ids", "text_lens", "codes", "code_lens")


@dataclass
class Batch:
    """A micro-batch: its samples, and the model's inputs as named tensors, read as `batch.NAME` too:

    text_ids [B, T] int64, zero padded (the model overwrites padding with stop tokens); text_lens [B] int64;
    codes [B, M] int64, zero padded; code_lens [B] int64; and the family's conditioning inputs, each the
    samples' arrays stacked (IndexTTS2: condition [B, 32, D] and emo_vec [B, D], float32).
    """

    indices: torch.Tensor  # [B] int64 sample indices
    ids: list[str]
    inputs: dict[str, torch.Tensor]  # model(**inputs) / model.loss_sums(**inputs)

    def __getattr__(self, name: str) -> torch.Tensor:
        inputs = self.__dict__.get("inputs")  # not self.inputs: unpickling asks before the fields are set
        if inputs is not None and name in inputs:
            return inputs[name]
        raise AttributeError(f"{type(self).__name__} has no input {name!r}")

    @property
    def conditioning(self) -> dict[str, torch.Tensor]:
        """The inputs besides text and codes: what the model's prefix is made of (generation's prompt too)."""
        return {k: v for k, v in self.inputs.items() if k not in SEQUENCE_INPUTS}

    def _map_tensors(self, fn) -> "Batch":
        return Batch(fn(self.indices), list(self.ids), {k: fn(v) for k, v in self.inputs.items()})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        # DataLoader(pin_memory=True) calls this on custom batch types.
        return self._map_tensors(lambda t: t.pin_memory())

    def __len__(self) -> int:
        return len(self.ids)


def collate_batch(items: list[dict]) -> Batch:
    """Stack FeatureDataset items into a zero-padded Batch: text ids and codes padded, with their lengths;
    every other input stacked (floating ones as float32)."""
    if not items:
        raise ValueError("collate_batch needs at least one item")
    inputs: dict[str, torch.Tensor] = {}
    for name, lens in (("text_ids", "text_lens"), ("codes", "code_lens")):
        rows = [item[name] for item in items]
        inputs[name] = pad_sequence(rows, batch_first=True)  # zeros after each row; the ids are int64
        inputs[lens] = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
    for name in items[0]:
        if name not in ("index", "id", "text_ids", "codes"):
            stacked = torch.stack([item[name] for item in items])
            inputs[name] = stacked.to(torch.float32) if stacked.is_floating_point() else stacked
    return Batch(torch.tensor([item["index"] for item in items], dtype=torch.int64), [item["id"] for item in items],
                 inputs)
