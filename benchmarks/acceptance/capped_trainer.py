#!/usr/bin/env python3
"""The trainer with CUDA's caching allocator capped at a fraction of the GPU's memory, for a real
out-of-memory error at a chosen size:

    python benchmarks/acceptance/capped_trainer.py FRACTION TRAINER_FLAGS...

FRACTION 0 runs the trainer uncapped (the dry run on a machine without CUDA). The trainer runs as
`python trainers/train_gpt_v2.py TRAINER_FLAGS...` would, in this process.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "trainers" / "train_gpt_v2.py"

if __name__ == "__main__":
    fraction = float(sys.argv[1])
    if fraction:
        import torch

        torch.cuda.set_per_process_memory_fraction(fraction)
    sys.argv = [str(SCRIPT), *sys.argv[2:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")
