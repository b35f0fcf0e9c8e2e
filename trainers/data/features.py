"""Load one sample's precomputed .npy features and pad micro-batches.

Manifest validation (trainers.data.manifest) only proves the files exist; the
contents are checked here, when a sample is first read, and every failure
names the manifest line so the user knows which sample to fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from trainers.data.sample_table import Sample, SampleTable
from trainers.model.layout import CONDITION_LEN

logger = logging.getLogger(__name__)

TRAILING_RUN_WARN = 16  # this many identical final codes looks like saved padding
# Conditioning latents and emotion vectors are normalised encoder outputs; beyond this a value is
# corrupt (e.g. 1e38 makes every loss overflow) rather than an unusual voice.
MAX_ABS_FEATURE = 1e4


class FeatureError(RuntimeError):
    """A feature file does not match its manifest line or the model."""


@dataclass(frozen=True)
class FeatureSpec:
    model_dim: int
    number_text_tokens: int
    max_code: int  # codes must be < max_code (= start_mel_token); larger ids are special tokens


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


def _int_vector(
    sample: Sample,
    what: str,
    path: str,
    array: np.ndarray,
    expected_len: int,
    length_key: str,
    upper: int,
    range_hint: str,
) -> np.ndarray:
    """Check a 1-D integer id array against its manifest length and id range."""
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
        return {
            "index": sample.index,
            "id": sample.id,
            "text_ids": torch.from_numpy(self._text_ids(sample)),
            "codes": torch.from_numpy(self._codes(sample)),
            "condition": torch.from_numpy(self._condition(sample)),
            "emo_vec": torch.from_numpy(self._emo_vec(sample)),
        }

    def _text_ids(self, sample: Sample) -> np.ndarray:
        path = sample.text_ids_path
        hint = (
            f"text ids must be < gpt.number_text_tokens {self.spec.number_text_tokens}; "
            "the tokenizer probably doesn't match the data (or the config's vocabulary size is wrong)"
        )
        array = _load_npy(sample, "text_ids", path)
        return _int_vector(sample, "text_ids", path, array, sample.text_len, "text_len", self.spec.number_text_tokens, hint)

    def _codes(self, sample: Sample) -> np.ndarray:
        path = sample.codes_path
        array = _load_npy(sample, "codes", path)
        if array.ndim == 2 and array.shape[0] == 1:
            array = array[0]  # [1, N] as saved by batch-of-one extractors
        hint = f"semantic codes must be < {self.spec.max_code} (start_mel_token); were stop/special tokens saved as data?"
        # Suspicious trailing runs are reported by the loader in the main process (once per sample).
        return _int_vector(sample, "codes", path, array, sample.code_len, "code_len", self.spec.max_code, hint)

    def _condition(self, sample: Sample) -> np.ndarray:
        path = sample.condition_path
        array = _load_npy(sample, "condition", path)
        return _float_array(sample, "condition", path, array, (CONDITION_LEN, self.spec.model_dim))

    def _emo_vec(self, sample: Sample) -> np.ndarray:
        path = sample.emo_vec_path
        array = _load_npy(sample, "emo_vec", path)
        return _float_array(sample, "emo_vec", path, array, (self.spec.model_dim,))


@dataclass
class Batch:
    indices: torch.Tensor  # [B] int64 sample indices
    ids: list[str]
    text_ids: torch.Tensor  # [B, T] int64, zero padded (the model overwrites padding with stop tokens)
    text_lens: torch.Tensor  # [B] int64
    codes: torch.Tensor  # [B, M] int64, zero padded
    code_lens: torch.Tensor  # [B] int64
    condition: torch.Tensor  # [B, 32, D] float32
    emo_vec: torch.Tensor  # [B, D] float32

    def _map_tensors(self, fn) -> "Batch":
        moved = {f.name: fn(getattr(self, f.name)) for f in fields(self) if f.name != "ids"}
        return replace(self, ids=list(self.ids), **moved)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        # DataLoader(pin_memory=True) calls this on custom batch types.
        return self._map_tensors(lambda t: t.pin_memory())

    def __len__(self) -> int:
        return len(self.ids)


def _pad(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(row.shape[0] for row in rows), dtype=torch.int64)
    for b, row in enumerate(rows):
        out[b, : row.shape[0]] = row
    return out


def collate_batch(items: list[dict]) -> Batch:
    """Stack FeatureDataset items into a zero-padded Batch."""
    if not items:
        raise ValueError("collate_batch needs at least one item")
    text_rows = [item["text_ids"] for item in items]
    code_rows = [item["codes"] for item in items]
    return Batch(
        indices=torch.tensor([item["index"] for item in items], dtype=torch.int64),
        ids=[item["id"] for item in items],
        text_ids=_pad(text_rows),
        text_lens=torch.tensor([row.shape[0] for row in text_rows], dtype=torch.int64),
        codes=_pad(code_rows),
        code_lens=torch.tensor([row.shape[0] for row in code_rows], dtype=torch.int64),
        condition=torch.stack([item["condition"] for item in items]).to(torch.float32),
        emo_vec=torch.stack([item["emo_vec"] for item in items]).to(torch.float32),
    )
