#!/usr/bin/env python3
"""indextts-prepare on a CPU at demo size: utterances/s in batches of similar length against one clip at a time.

    python benchmarks/prepare_speed.py [--family indextts2|indextts25|both] [--clips 64] [--rounds 3] [--smoke]

The audio is --demo's (synthesised, 1-2.4 s clips at 16-44.1 kHz, one speaker in stereo) and the models are the
demo backend's tiny stand-ins (trainers/tools/prepare/demo_backend.py), on one thread. Two figures per family:

  features       the backend's encode alone, on clips decoded beforehand: batches as the pipeline forms them
                 (sorted by length, CPU_BATCH clips of the longest length per batch) against each clip alone;
                 the outputs are compared (codes identical, floats within 1e-5)
  whole command  indextts-prepare itself in this process (decoding, resampling, text, encoding, every file written
                 with fsync, the records, the merge) with its default batches against --batch-size 1; the two
                 outputs are compared (manifests byte for byte, codes identical, floats within 1e-5)

Each round runs both ways in turn (the order alternating, so a slow spell of a shared machine hits both); the
medians of the rounds are printed with every round's figure. Target: batched features at least 3x the clips
alone, outputs equal; exit 1 when missed. --smoke (tests/test_benchmarks.py): 8 clips, one round, no target.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from trainers.tools.prepare.backend import BackendRequest
from trainers.tools.prepare.batching import CPU_BATCH, next_batch
from trainers.tools.prepare.cli import main as prepare_main
from trainers.tools.prepare.demo import DEMO_CONFIGS, SPEAKERS, make_audio
from trainers.tools.prepare.demo_backend import DemoBackend

REPO = Path(__file__).resolve().parents[1]
TARGET = 3.0
TOLERANCE = 1e-5


def encode_batched(backend: DemoBackend, clips: list) -> list:
    order = sorted(range(len(clips)), key=lambda i: -clips[i].waveform.shape[0])
    lengths = [clips[i].waveform.shape[0] for i in order]
    budget = CPU_BATCH * lengths[0]
    out: list = [None] * len(clips)
    start = 0
    while start < len(order):
        end = next_batch(lengths, start, budget)
        for i, features in zip(order[start:end], backend.encode([clips[i] for i in order[start:end]])):
            out[i] = features
        start = end
    return out


def same_features(a: list, b: list) -> bool:
    return all(np.array_equal(x.codes, y.codes) and all(
        np.allclose(x.conditioning[k], y.conditioning[k], rtol=0, atol=TOLERANCE) for k in x.conditioning)
        for x, y in zip(a, b))


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_command(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        status = prepare_main(argv)
    if status != 0:
        raise SystemExit(f"indextts-prepare {' '.join(argv)} exited {status}:\n{err.getvalue()}")


def same_outputs(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file() and ".prepare" not in p.parts)
    if names != sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() and ".prepare" not in p.parts):
        return False
    for name in names:
        x, y = (a / name).read_bytes(), (b / name).read_bytes()
        if not name.startswith("features/"):
            if x != y:
                return False
            continue
        xa, ya = np.load(io.BytesIO(x)), np.load(io.BytesIO(y))
        pairs = [(xa[k], ya[k], k) for k in xa.files] if name.endswith(".npz") else [(xa, ya, name)]
        for u, v, what in pairs:
            exact = "codes" in what or "text_ids" in what
            if (exact and not np.array_equal(u, v)) or (not exact and not np.allclose(u, v, rtol=0, atol=TOLERANCE)):
                return False
    return True


def family_figures(family: str, clips_wanted: int, rounds: int, work: Path) -> float:
    listing, tokenizer = make_audio(work / family / "audio", family, max(1, clips_wanted // len(SPEAKERS)))
    config = REPO / "checkpoints" / DEMO_CONFIGS[family]
    backend = DemoBackend(BackendRequest(family, config, tokenizer=tokenizer))
    rows = [json.loads(line) for line in listing.read_text().splitlines()]
    clips = [backend.audio(listing.parent / r["audio"], r["id"]) for r in rows]
    seconds = [c.seconds for c in clips]
    print(f"{family}, {len(clips)} clips of {min(seconds):.1f}-{max(seconds):.1f} s (demo audio, stand-in models):",
          flush=True)
    backend.encode(clips[:2])  # warm-up: first-call allocations
    alone_rates, batched_rates, equal = [], [], True
    for r in range(rounds):
        ways = [("alone", lambda: [backend.encode([c])[0] for c in clips]), ("batched", lambda: encode_batched(backend,
                                                                                                            clips))]
        results = {}
        for name, fn in (ways if r % 2 == 0 else ways[::-1]):
            seconds_taken, results[name] = timed(fn)
            (alone_rates if name == "alone" else batched_rates).append(len(clips) / seconds_taken)
        equal = equal and same_features(results["alone"], results["batched"])
    base = ["--input", str(listing), "--backend", "demo", "--config", str(config), "--tokenizer", str(tokenizer),
            "--device", "cpu"]
    one_rates, default_rates, outputs_equal = [], [], True
    for r in range(rounds):
        outs = {}
        ways = [("one", ["--batch-size", "1"]), ("default", [])]
        for name, extra in (ways if r % 2 == 0 else ways[::-1]):
            outs[name] = work / family / f"{name}{r}"
            taken, _ = timed(lambda: run_command([*base, "--out", str(outs[name]), *extra]))
            (one_rates if name == "one" else default_rates).append(len(clips) / taken)
        outputs_equal = outputs_equal and same_outputs(outs["one"], outs["default"])
    ratio = statistics.median(batched_rates) / statistics.median(alone_rates)
    whole = statistics.median(default_rates) / statistics.median(one_rates)
    print(f"  features, one clip at a time  {statistics.median(alone_rates):8.1f} utt/s  rounds: "
          f"{', '.join(f'{x:.1f}' for x in alone_rates)}")
    print(f"  features, batched ({CPU_BATCH})      {statistics.median(batched_rates):8.1f} utt/s  rounds: "
          f"{', '.join(f'{x:.1f}' for x in batched_rates)}; {ratio:.2f}x; outputs equal: {'yes' if equal else 'NO'}")
    print(f"  whole command, --batch-size 1 {statistics.median(one_rates):8.1f} utt/s  rounds: "
          f"{', '.join(f'{x:.1f}' for x in one_rates)}")
    print(f"  whole command, batched        {statistics.median(default_rates):8.1f} utt/s  rounds: "
          f"{', '.join(f'{x:.1f}' for x in default_rates)}; {whole:.2f}x; outputs equal: "
          f"{'yes' if outputs_equal else 'NO'}", flush=True)
    return ratio if equal and outputs_equal else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("indextts2", "indextts25", "both"), default="both")
    p.add_argument("--clips", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="8 clips, one round, no target (for the test suite)")
    args = p.parse_args()
    if args.smoke:
        args.clips, args.rounds = 8, 1
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, {args.threads} thread(s); load average before {load:.2f}", flush=True)
    families = ("indextts2", "indextts25") if args.family == "both" else (args.family,)
    with tempfile.TemporaryDirectory(prefix="prepare_speed-") as tmp:
        ratios = [family_figures(f, args.clips, args.rounds, Path(tmp)) for f in families]
    worst = min(ratios)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    verdict = "not judged (--smoke)" if args.smoke else ("met" if worst >= TARGET else "MISSED")
    print(f"target: batched features >= {TARGET:g}x one clip at a time, outputs equal: {worst:.2f}x -> {verdict}")
    return 0 if args.smoke or worst >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
