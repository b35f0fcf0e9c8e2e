"""The process's random number generators: the "rng" section of a checkpoint.

Training itself draws no random numbers (the data order is keyed by (seed, epoch), dropout
masks by (seed, step, sample), generation at validation by (seed, sample)), so these states only
keep anything else that draws from the global generators reproducible across a resume. A fresh
start seeds them from --seed (`seed`) and a resume restores them (`load_state_dict`), so they are
a function of the run, as everything else in the checkpoint is: a resumed run saves the states
the uninterrupted run saves. Unseeded, they were whatever the process started with (numpy's,
Python's and torch's own seeds are drawn from the OS), different in every start.
Stored as tensors, containers and primitives, so a checkpoint loads with torch.load(weights_only=True).
"""
from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class ProcessRNG:
    def seed(self, seed: int) -> None:
        """A fresh start's states, from the run's seed (0 <= seed < 2**64: trainers/config/bounds.py)."""
        torch.manual_seed(seed)  # the CPU's and every CUDA device's
        np.random.seed([seed & 0xFFFFFFFF, seed >> 32])  # its legacy seeding takes 32-bit words
        random.seed(seed)

    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return {
            "torch": torch.get_rng_state(),
            "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": _to_lists(random.getstate()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        cuda_states = state["cuda"]
        if cuda_states and not torch.cuda.is_available():
            log.info("the checkpoint holds CUDA RNG states for %d device(s) and this machine has no CUDA:",
                     len(cuda_states))
            log.info("they are kept out (training draws no CUDA random numbers, so results are unaffected)")
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if cuda_states and len(cuda_states) == count:
                torch.cuda.set_rng_state_all(cuda_states)
            elif cuda_states:
                log.warning("checkpoint has CUDA RNG states for %d devices, this machine has %d: not restored",
                            len(cuda_states), count)
                log.warning("(training does not draw from them, so results are unaffected)")
        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        random.setstate(_to_tuples(state["python"]))


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x
