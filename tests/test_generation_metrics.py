"""The gen/* metrics of generated codes: stop rate, length ratio against the reference, babbling signals,
overall and per language, with names TensorBoard and --best-metric can use."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainers.training.generation_metrics import (
    HIGHER_IS_BETTER, LOWER_IS_BETTER, generation_metrics, longest_run, repeated_ngram_share,
)


def test_longest_run_of_one_code():
    assert longest_run(np.array([], dtype=np.int64)) == 0
    assert longest_run(np.array([5])) == 1
    assert longest_run(np.array([1, 2, 2, 2, 3, 3, 1])) == 3
    assert longest_run(np.array([4, 4, 4, 4])) == 4
    assert longest_run(np.array([1, 2, 7, 7, 7, 7, 7])) == 5  # a run that reaches the end


def test_repeated_ngram_share_counts_the_codes_of_ngrams_seen_before():
    assert repeated_ngram_share(np.arange(20)) == 0.0
    assert repeated_ngram_share(np.array([1, 2, 3])) == 0.0  # shorter than one n-gram
    # 1 2 3 4 | 1 2 3 4: the second 4-gram occurrence covers the last four of eight codes
    assert repeated_ngram_share(np.array([1, 2, 3, 4, 1, 2, 3, 4]), n=4) == pytest.approx(0.5)
    # one code held: every window after the first repeats it, covering all but the first code
    assert repeated_ngram_share(np.full(10, 9), n=4) == pytest.approx(0.9)


def test_overall_figures():
    codes = [torch.arange(10), np.arange(5), [3] * 40, []]
    m = generation_metrics(codes, [True, True, False, True], [10, 10, 20, 8], [None] * 4)
    assert m["gen/samples"] == 4
    assert m["gen/stop_rate"] == pytest.approx(0.75)
    ratios = [1.0, 0.5, 2.0, 0.0]
    assert m["gen/length_ratio_median"] == pytest.approx(np.median(ratios))
    assert m["gen/length_ratio_p10"] == pytest.approx(np.percentile(ratios, 10))
    assert m["gen/length_ratio_p90"] == pytest.approx(np.percentile(ratios, 90))
    # |ln ratio|, an empty sample counted as one code: 0, ln 2, ln 2, ln 8
    assert m["gen/length_error_median"] == pytest.approx(np.log(2))
    assert m["gen/longest_run_median"] == pytest.approx(np.median([1, 1, 40, 0]))
    assert m["gen/repeated_ngram_share"] == pytest.approx(np.mean([0, 0, 39 / 40, 0]))
    assert not any("/unknown/" in k for k in m)  # one group: no per-language copies


def test_per_language_figures_and_tensorboard_names():
    m = generation_metrics([[1, 2], [1, 2, 3, 4], [5]], [True, False, True], [2, 2, 1], ["am", "am", None])
    assert m["gen/am/stop_rate"] == pytest.approx(0.5) and m["gen/am/samples"] == 2
    assert m["gen/unknown/stop_rate"] == 1.0 and m["gen/unknown/length_ratio_median"] == 1.0
    assert m["gen/am/length_ratio_median"] == pytest.approx(1.5)
    assert all(k.startswith("gen/") and " " not in k and isinstance(v, float) for k, v in m.items())
    assert (HIGHER_IS_BETTER | LOWER_IS_BETTER) <= set(m)


def test_a_model_that_babbles_to_the_limit_scores_worse_on_every_directed_metric():
    """The direction the docstring states, on the failure it is for: the babbler never stops, runs long
    and repeats one code; the healthy model stops near the reference length with varied codes."""
    rng = np.random.default_rng(0)
    healthy = generation_metrics([rng.integers(0, 100, 50) for _ in range(4)], [True] * 4, [50] * 4, [None] * 4)
    babbler = generation_metrics([np.full(200, 7)] * 4, [False] * 4, [50] * 4, [None] * 4)
    for name in HIGHER_IS_BETTER:
        assert babbler[name] < healthy[name], name
    for name in LOWER_IS_BETTER:
        assert babbler[name] > healthy[name], name


def test_mismatched_inputs_and_empty_references_are_refused():
    assert generation_metrics([], [], [], []) == {}
    with pytest.raises(ValueError, match="differ in length"):
        generation_metrics([[1]], [True, False], [1], [None])
    with pytest.raises(ValueError, match="reference lengths must be >= 1"):
        generation_metrics([[1]], [True], [0], [None])


def test_repeated_ngram_share_is_the_same_for_codes_too_large_to_pack():
    """Codes pack into one int64 per n-gram when they fit; larger or negative ones take the row-wise path,
    with the same answer."""
    codes = np.random.default_rng(1).integers(0, 6, 300)
    small = repeated_ngram_share(codes)
    assert 0 < small < 1
    assert repeated_ngram_share(codes + 2 ** 40) == small
    assert repeated_ngram_share(codes - 3) == small
