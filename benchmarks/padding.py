#!/usr/bin/env python3
"""How many token slots are real, not padding, in the plain and the length-grouped data order?

    python benchmarks/padding.py [--seed 1234] [--samples 20000] [--smoke]

Padding efficiency = real token slots / padded token slots over one whole epoch (epoch 0 of
--seed), summed over every micro-batch of every step, the short last step included. A sample
takes its packed length, 34 + (text_len + 2) + (code_len + 2) positions (data_order.packed_lengths),
and a micro-batch of m samples takes m x its longest packed length. Effective batch 32,
micro-batches of 4 and 8. The orders are the trainer's own (trainers/data_order.py):

  plain    DataOrder(seed, N, 32): the order of runs made before grouping (random steps,
           cut in random order)
  sorted   plain steps, each cut longest first (data_order.longest_first); not a DataOrder
           mode, shown to tell apart what sorting inside a step and grouping steps each bring
  grouped  DataOrder(seed, N, 32, lengths=..., grouped=True)

Corpora:

  demo       the --demo training corpus (trainers/demo_data.py, generated into a temp dir with
             the sizes of checkpoints/demo.yaml); lengths read from its train.jsonl
             (target_text_len, target_code_len)
  synthetic  --samples samples drawn with numpy PCG64(2024):
             text  = clip(round(exp(normal(ln 45, 0.6))), 10, 200): log-normal around the
                     geometric middle of 10..200 tokens, the range spanning about +-2.5 sigma;
             codes = clip(round(text * exp(normal(ln 6.5, 0.25))), 50, 1500): about 6.5 codes
                     per text token (speech at ~3.5 BPE tokens/s, codes at ~23 Hz), +-28% noise
                     per utterance for speaking rate, so codes are roughly proportional to text

Then, for the synthetic corpus, the window of the grouped order (data_order.GROUP_WINDOW_STEPS)
is varied: padding efficiency at micro-batch 4, 8, 16 and 32 (a whole step in one micro-batch),
the spread of real tokens per full step (coefficient of variation: what grouping changes in a
step's statistics; window 1 has the plain order's steps), and the share of step-mate pairs of
epoch 0 that share a step again in epoch 1, for the whole corpus and for its first 2,000 samples
as a small corpus ("whole" sorts each epoch at once).

Exits 0 when grouped reaches 0.90 for both corpora at micro-batch 4 and 8, else 1. --smoke (for
tests/test_benchmarks.py) takes a synthetic corpus of 2,000 samples and does not judge the target.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import yaml  # noqa: E402

from trainers.data.data_order import (GROUP_WINDOW_STEPS, DataOrder, grouped_epoch_order, longest_first,  # noqa: E402
                                 packed_lengths, step_samples)
from trainers.data.demo_data import DemoCorpusSpec, ensure_demo_assets  # noqa: E402

EFFECTIVE_BATCH = 32
MICRO_BATCHES = (4, 8)
TARGET = 0.90
SYNTHETIC_SEED = 2024
WINDOWS = (1, 4, 8, 16, 32, 64, None)  # None: the whole epoch is one window
SMALL_CORPUS = 2000


def demo_lengths() -> np.ndarray:
    gpt = yaml.safe_load((REPO_ROOT / "checkpoints" / "demo.yaml").read_text(encoding="utf-8"))["gpt"]
    spec = DemoCorpusSpec(model_dim=gpt["model_dim"], vocab_size=gpt["number_text_tokens"],
                          num_codes=gpt["start_mel_token"])
    with tempfile.TemporaryDirectory(prefix="padding-bench-") as tmp:
        assets = ensure_demo_assets(Path(tmp) / "demo_data", spec)
        rows = [json.loads(line) for line in assets.train_manifest.read_text(encoding="utf-8").splitlines()
                if line.strip()]
    return packed_lengths([r["target_text_len"] for r in rows], [r["target_code_len"] for r in rows])


def synthetic_lengths(n: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(SYNTHETIC_SEED))
    text = np.clip(np.round(np.exp(rng.normal(np.log(45), 0.6, n))), 10, 200)
    codes = np.clip(np.round(text * np.exp(rng.normal(np.log(6.5), 0.25, n))), 50, 1500)
    return packed_lengths(text, codes)


def efficiency(steps: list[np.ndarray], lengths: np.ndarray, micro: int) -> float:
    """Real / padded token slots when each step is cut, in the given order, into micro-batches."""
    real = padded = 0
    for step in steps:
        for i in range(0, len(step), micro):
            lens = lengths[step[i:i + micro]]
            real += int(lens.sum())
            padded += len(lens) * int(lens.max())
    return real / padded


def steps_of(flat: np.ndarray, batch: int) -> list[np.ndarray]:
    return [step_samples(flat, k, batch) for k in range(-(-len(flat) // batch))]


def mode_steps(lengths: np.ndarray, seed: int) -> dict[str, list[np.ndarray]]:
    """Each step's samples in the order the trainer cuts them into micro-batches."""
    n = len(lengths)
    plain = DataOrder(seed, n, EFFECTIVE_BATCH)
    grouped = DataOrder(seed, n, EFFECTIVE_BATCH, lengths=lengths, grouped=True)
    # plan_epoch's concatenated micro-batches do not depend on the micro-batch size (tested).
    return {
        "plain": [np.array(p.samples) for p in plain.plan_epoch(0, 0, EFFECTIVE_BATCH)],
        "sorted": [longest_first(s, lengths) for s in steps_of(plain.flat_order(0), EFFECTIVE_BATCH)],
        "grouped": [np.array(p.samples) for p in grouped.plan_epoch(0, 0, EFFECTIVE_BATCH)],
    }


def step_mates_kept(lengths: np.ndarray, seed: int, window: int) -> float:
    """Share of the pairs that share a full step in epoch 0 and share one again in epoch 1."""
    def pairs(epoch: int) -> set[tuple[int, int]]:
        flat = grouped_epoch_order(seed, epoch, lengths, EFFECTIVE_BATCH, window)
        out = set()
        for k in range(len(flat) // EFFECTIVE_BATCH):
            s = sorted(step_samples(flat, k, EFFECTIVE_BATCH).tolist())
            out.update((a, b) for i, a in enumerate(s) for b in s[i + 1:])
        return out
    before = pairs(0)
    return len(before & pairs(1)) / len(before)


def describe(name: str, lengths: np.ndarray) -> str:
    q = "/".join(str(x) for x in np.percentile(lengths, [0, 10, 50, 90, 100]).astype(int).tolist())
    n, batch = len(lengths), EFFECTIVE_BATCH
    return (f"{name}: {n} samples, packed length min/p10/median/p90/max {q}, "
            f"{-(-n // batch)} steps of {batch} (last {n % batch or batch})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1234, help="the run seed the orders are drawn with (trainer default)")
    p.add_argument("--samples", type=int, default=20_000, help="size of the synthetic corpus")
    p.add_argument("--smoke", action="store_true",
                   help=f"a synthetic corpus of {SMALL_CORPUS} samples, the target not judged: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.samples = SMALL_CORPUS

    corpora = {"demo": demo_lengths(), "synthetic": synthetic_lengths(args.samples)}
    met = True
    print(f"padding efficiency = real / padded token slots, epoch 0 of seed {args.seed}, effective batch "
          f"{EFFECTIVE_BATCH}; grouped window {GROUP_WINDOW_STEPS} steps")
    for name, lengths in corpora.items():
        print(describe(name, lengths))
        steps = mode_steps(lengths, args.seed)
        for micro in MICRO_BATCHES:
            eff = {mode: efficiency(s, lengths, micro) for mode, s in steps.items()}
            ok = eff["grouped"] >= TARGET
            met &= ok
            print(f"  micro-batch {micro}: plain {eff['plain']:.3f}   sorted {eff['sorted']:.3f}   "
                  f"grouped {eff['grouped']:.3f}   {'meets' if ok else 'MISSES'} the target {TARGET:.2f}")

    lengths = corpora["synthetic"]
    small = lengths[:SMALL_CORPUS]
    print(f"grouped-order window (synthetic corpus; step-mates kept = pairs sharing a step in epoch 0 and again "
          f"in epoch 1, whole corpus / its first {SMALL_CORPUS} samples):")
    for window in WINDOWS:
        w = window or len(lengths)  # larger than any epoch: one window
        flat = grouped_epoch_order(args.seed, 0, lengths, EFFECTIVE_BATCH, w)
        steps = [longest_first(s, lengths) for s in steps_of(flat, EFFECTIVE_BATCH)]
        effs = "  ".join(f"m{m} {efficiency(steps, lengths, m):.3f}" for m in (4, 8, 16, EFFECTIVE_BATCH))
        tokens = np.array([lengths[s].sum() for s in steps if len(s) == EFFECTIVE_BATCH])
        spread = f"tokens/step cv {tokens.std() / tokens.mean():.2f}"
        kept = f"{step_mates_kept(lengths, args.seed, w):.3f} / {step_mates_kept(small, args.seed, w):.3f}"
        label = "whole" if window is None else str(window)
        mark = "  <- GROUP_WINDOW_STEPS" if window == GROUP_WINDOW_STEPS else ""
        print(f"  window {label:>5}: {effs}   {spread}   step-mates kept {kept}{mark}")

    print(f"target: grouped >= {TARGET:.2f} at micro-batch {' and '.join(map(str, MICRO_BATCHES))} for both corpora: "
          f"{'not judged (--smoke)' if args.smoke else 'met' if met else 'NOT met'}")
    return 0 if met or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
