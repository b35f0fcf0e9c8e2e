"""Generation metrics: what the codes generated at validation say that teacher-forced loss does not.

Pure functions of (codes, stopped, reference lengths, languages); no torch, no state. The names are
TensorBoard tags and run-history keys; each is given overall and, when the samples have more than
one language, per language as gen/<language>/<name> (samples without a language: "unknown", as the
validation's per-language losses name them). Which direction is better, for a later --best-metric:

  gen/samples                 how many samples the figures cover                     (no direction)
  gen/stop_rate               share that emitted the stop code within the limit      higher (1.0)
  gen/length_ratio_median     median of generated / reference length                 closest to 1.0
  gen/length_ratio_p10, _p90  the spread of that ratio (10th and 90th percentile)    closest to 1.0
  gen/length_error_median     median of |ln(generated / reference)|: the ratio's     lower (0.0)
                              distance from 1 as one number a best can be kept for
  gen/longest_run_median      median over samples of the longest run of one code     lower
                              repeated back to back: a babbling model repeats one
                              code for long stretches
  gen/repeated_ngram_share    mean over samples of the share of codes that lie in    lower
                              an n-gram (n = REPEAT_N) seen earlier in the sample

"Lower" for the two babbling signals means lower down to what real speech has: silence repeats codes
too, so compare with the reference's own values rather than aim at zero. A sample that did not stop
counts with the codes it made up to the limit; its ratio is then a lower bound of the true one.
A sample with no codes counts as one code in length_error (ln 0 is not a number).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

PREFIX = "gen/"
REPEAT_N = 4
NO_LANGUAGE = "unknown"
HIGHER_IS_BETTER = frozenset({"gen/stop_rate"})
LOWER_IS_BETTER = frozenset({"gen/length_error_median", "gen/longest_run_median", "gen/repeated_ngram_share"})


def longest_run(codes: np.ndarray) -> int:
    """The length of the longest stretch of one code repeated back to back (0 for no codes)."""
    if codes.size == 0:
        return 0
    edges = np.flatnonzero(np.diff(codes) != 0)  # the last index of every run but the final one
    bounds = np.concatenate(([-1], edges, [codes.size - 1]))
    return int(np.diff(bounds).max())


def repeated_ngram_share(codes: np.ndarray, n: int = REPEAT_N) -> float:
    """The share of codes covered by an n-gram that already occurred earlier in the same sequence."""
    if codes.size < n:
        return 0.0
    windows = np.lib.stride_tricks.sliding_window_view(codes, n)
    base = int(codes.max()) + 1
    if codes.min() >= 0 and base ** n < 2 ** 63:  # one int64 per n-gram: a 1-D unique, ten times faster
        keys = windows @ (base ** np.arange(n - 1, -1, -1, dtype=np.int64))
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(windows, axis=0, return_index=True, return_inverse=True)
    repeats = np.flatnonzero(first[inverse.reshape(-1)] != np.arange(len(windows)))
    covered = np.zeros(codes.size, dtype=bool)
    for offset in range(n):
        covered[repeats + offset] = True
    return float(covered.mean())


def _group(lengths: np.ndarray, stopped: np.ndarray, ref: np.ndarray, runs: np.ndarray,
           shares: np.ndarray) -> dict[str, float]:
    ratio = lengths / ref
    error = np.abs(np.log(np.maximum(lengths, 1.0) / ref))
    p10, median, p90 = np.percentile(ratio, [10, 50, 90])
    return {
        "samples": float(len(lengths)),
        "stop_rate": float(stopped.mean()),
        "length_ratio_median": float(median),
        "length_ratio_p10": float(p10),
        "length_ratio_p90": float(p90),
        "length_error_median": float(np.median(error)),
        "longest_run_median": float(np.median(runs)),
        "repeated_ngram_share": float(np.mean(shares)),
    }


def generation_metrics(codes: Sequence[Any], stopped: Sequence[bool], ref_lengths: Sequence[int],
                       languages: Sequence[str | None]) -> dict[str, float]:
    """The flat gen/* metrics of one validation's generated samples (see the module docstring).

    codes: per sample, its generated codes without the stop code (any 1-D integer array, CPU
    tensors included); stopped: whether it emitted the stop code; ref_lengths: its reference
    code_len (>= 1); languages: its language or None. No samples: an empty dict."""
    n = len(codes)
    if not len(stopped) == len(ref_lengths) == len(languages) == n:
        raise ValueError(f"codes, stopped, ref_lengths and languages differ in length: {n}, {len(stopped)}, "
                         f"{len(ref_lengths)}, {len(languages)}")
    if n == 0:
        return {}
    arrays = [np.asarray(c, dtype=np.int64).reshape(-1) for c in codes]
    done = np.asarray(stopped, dtype=bool)
    ref = np.asarray(ref_lengths, dtype=np.float64)
    if (ref < 1).any():
        raise ValueError(f"reference lengths must be >= 1, got {ref.min():g}")
    per_sample = (np.array([c.size for c in arrays], dtype=np.float64), done, ref,
                  np.array([longest_run(c) for c in arrays], dtype=np.float64),
                  np.array([repeated_ngram_share(c) for c in arrays]))
    out = {PREFIX + name: value for name, value in _group(*per_sample).items()}
    names = np.array([NO_LANGUAGE if lang is None else lang for lang in languages], dtype=object)
    if len(set(names)) > 1:
        for name in sorted(set(names)):
            group = _group(*(column[names == name] for column in per_sample))
            out.update({f"{PREFIX}{name}/{key}": value for key, value in group.items()})
    return out
