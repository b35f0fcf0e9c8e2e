"""CUDA's caching allocator with expandable segments, against fragmentation (torch-free: used before torch loads).

A run's tensor sizes keep changing: length-grouped steps have different lengths, validation uses
its own batch, and an out-of-memory error halves the micro-batch (several times, in the worst case).
The caching allocator keeps the segments it reserved for earlier sizes, and a new size may find
no free piece large enough although enough memory is free in total: an out-of-memory error from
fragmentation, the very error the halving answers. With `expandable_segments:True` the allocator
maps more memory into one growing segment instead, so freed memory can be reused for other sizes
(PyTorch's CUDA memory-management notes recommend it where allocation sizes change).

The trainer script sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before torch is imported,
so before CUDA's allocator reads it, when the user has set neither that variable nor its newer name
PYTORCH_ALLOC_CONF (an empty value counts as not set); a value the user set is kept as it is, and
the out-of-memory message suggests adding expandable segments to it. torchrun's workers each run
the script, so each sets it for itself. Not measured here (no GPU); a CPU run ignores the variable.
"""
from __future__ import annotations

from typing import MutableMapping

CUDA_VAR = "PYTORCH_CUDA_ALLOC_CONF"
NEW_VAR = "PYTORCH_ALLOC_CONF"  # the name torch reads for every device's allocator since 2.9
EXPANDABLE = "expandable_segments:True"

_set_here = False  # whether this process's trainer set the variable (for the start-up line)


def use_expandable_segments(environ: MutableMapping[str, str]) -> bool:
    """Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user configured the allocator;
    True when it was set here. Call it before torch is imported."""
    global _set_here
    if environ.get(CUDA_VAR) or environ.get(NEW_VAR):
        return False
    environ.pop(NEW_VAR, None)  # an empty newer name must not shadow the value set here
    environ[CUDA_VAR] = EXPANDABLE
    _set_here = True
    return True


def _user_value(environ: MutableMapping[str, str]) -> tuple[str, str] | None:
    for name in (NEW_VAR, CUDA_VAR):
        if environ.get(name):
            return name, environ[name]
    return None


def allocator_line(environ: MutableMapping[str, str]) -> str:
    """What the start-up summary says of the CUDA allocator."""
    found = _user_value(environ)
    if found is None:
        return f"CUDA allocator: torch's defaults ({CUDA_VAR} is not set)"
    name, value = found
    who = "set by the trainer against fragmentation; set it yourself to choose otherwise" if _set_here and \
        value == EXPANDABLE else "yours"
    return f"CUDA allocator: {name}={value} ({who})"


def fragmentation_advice(environ: MutableMapping[str, str]) -> str:
    """For the out-of-memory message: '' when expandable segments are on, else how to turn them on (two lines)."""
    found = _user_value(environ)
    if found is not None and "expandable_segments:true" in found[1].replace(" ", "").lower():
        return ""
    setting = f"to reuse it, add expandable_segments:True (comma-separated) to your\n{found[0]}={found[1]}" if found \
        else f"start the trainer with {CUDA_VAR}={EXPANDABLE} to reuse it"
    return f"after repeated halving, free GPU memory can be fragmented (sizes change from step to step):\n{setting}"
