#!/usr/bin/env python3
"""The "Which GPU, which settings" table of docs/gpu.md, computed on the CPU (no GPU is needed, none is measured).

    python benchmarks/gpu_table.py [--smoke]

For each GPU class: the precision --amp auto picks there (trainers/hardware/precision.py), the micro-batch the
probe's budget allows at the official config for samples of the acceptance corpus's long lengths, without and
with gradient checkpointing, and the host memory background saves need.

Micro-batch: the largest n for which the probe's own budget (trainers/hardware/batch_probe.py MemoryBudget:
85% of the free memory, AdamW's moments, the optimizer update's temporary) allows a pass peaking at
    peak(n) = gradients (the trained weights' size) + autocast's low-precision weight copies + n x a,
free memory = the card's memory - the trained fp32 weights - CUDA_CONTEXT, with a the bytes autograd keeps
per sample for backward. a is measured on the CPU: the tensors saved for backward (saved_tensors_hooks, each
storage once) by the model at the official width with 1 and 2 layers, 1 and 2 samples, at 1/8 of the long
lengths; the differences give bytes per layer and position, bytes per position outside the blocks and the
per-pass weight copies, scaled to 24 layers and the full lengths (every part is linear in the positions:
flash attention and the CPU's fused attention keep no score matrix). With gradient checkpointing a block
keeps only its fp32 input, plus one block's activations while it is recomputed. fp16 keeps what bf16 does
(same element size, same autocast op lists); the CPU's autocast op lists are close to CUDA's, not equal.
The probe itself measures on the GPU; these figures say what to expect, not what it will answer.

Only the bytes matter, so the matrix products and attention are not computed (ShapesOnly: each returns zeros of
its output's shape, strides and dtype): the measurement takes seconds whatever the CPU, where a bf16 product on a
CPU without bf16 instructions (AVX2 only) runs ~80x slower than fp32. Every run first checks that this changes
no byte: at width 128 the saved bytes with and without the products computed must be equal, in fp32 and bf16.

--smoke (for tests/test_benchmarks.py): the same at 1/32 of the lengths. Exit 0; 1 when the check above fails.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

from benchmarks.acceptance.corpus import LONG_CODES, LONG_TEXT, official_gpt, positions  # noqa: E402
from benchmarks.save_stall import official_shapes  # noqa: E402
from trainers.checkpoint.host_blocks import reserved_bytes  # noqa: E402
from trainers.checkpoint.save_mode import HEADROOM_BYTES, WORKER_BYTES, choose_save_mode  # noqa: E402
from trainers.hardware.batch_probe import MEMORY_MARGIN, MemoryBudget  # noqa: E402
from trainers.hardware.detect import GpuInfo, Hardware, auto_workers  # noqa: E402
from trainers.hardware.host_memory import GiB, HostMemory  # noqa: E402
from trainers.hardware.precision import choose_amp  # noqa: E402
from trainers.model.gpt_model import UnifiedVoiceGPT, dropout_keys  # noqa: E402

CUDA_CONTEXT = GiB // 2  # the CUDA context and library handles: taken before the probe reads the free memory
MEASURE_SHARE = 8  # measured at 1/8 of the long lengths, scaled up
SMOKE_MEASURE_SHARE = 32
CHECK_WIDTH = 128  # where ShapesOnly is checked against the computed products
MAX_MICRO_BATCH = 4096  # where the search stops (a measurement of 0 bytes per sample would never end it)
HOST_CORES = 8  # CPU cores assumed beside the GPU: 4 data-loader processes (half the cores, at most 4)
# (name, memory as nvidia-smi reports it in MiB, compute capability)
GPUS: tuple[tuple[str, int, tuple[int, int]], ...] = (
    ("T4 16 GB", 15360, (7, 5)),
    ("L4 24 GB", 23034, (8, 9)),
    ("A10G 24 GB", 23028, (8, 6)),
    ("A100 40 GB", 40960, (8, 0)),
    ("A100 80 GB", 81920, (8, 0)),
    ("H100 80 GB", 81559, (9, 0)),
)


aten = torch.ops.aten
# The products and attention kernels the model runs on the CPU, fp32 or under autocast.
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}


class ShapesOnly(TorchDispatchMode):
    """Matrix products and attention return zeros of their outputs' shapes, strides and dtypes instead of
    computing them (the outputs come from the ops' meta kernels). Autograd, which sits above this mode, saves
    those tensors as it would the computed ones; everything else runs as usual."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in PRODUCTS:
            return func(*args, **kwargs)
        on_meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
        out = func(*on_meta[0], **on_meta[1])
        return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).zero_()
                        if isinstance(t, torch.Tensor) else t, out)


@dataclass(frozen=True)
class Activations:
    per_layer_position: float  # bytes a block keeps per sequence position of one sample
    rest_per_position: float  # bytes per position of one sample outside the blocks (embeddings, heads, loss)
    weight_copies_per_layer: float  # autocast's low-precision copies of a block's weights, per pass
    weight_copies_rest: float  # the same of the heads and embeddings

    def per_sample(self, layers: int, seq: int, checkpointing: bool, dim: int) -> float:
        rest = self.rest_per_position * seq
        if not checkpointing:
            return layers * self.per_layer_position * seq + rest
        return layers * seq * dim * 4 + self.per_layer_position * seq + rest  # fp32 block inputs + one recompute

    def per_pass(self, layers: int) -> float:
        return layers * self.weight_copies_per_layer + self.weight_copies_rest


def _model(**changes) -> UnifiedVoiceGPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return UnifiedVoiceGPT(official_gpt(layers=2, **changes)).train()


def measure(share: int = MEASURE_SHARE) -> dict[str, Activations]:
    """Bytes saved for backward in fp32 and under bf16 autocast ("half": fp16 keeps the same), measured at 1/share
    of the long lengths on one model at the official width with 2 layers, the products not computed."""
    model = _model()
    return {"fp32": measure_activations(model, None, share), "half": measure_activations(model, torch.bfloat16, share)}


def shapes_only_changes_nothing(share: int) -> dict[str, tuple[int, int]]:
    """{precision: (bytes saved with the products computed, without)} at width CHECK_WIDTH: must be equal."""
    model = _model(model_dim=CHECK_WIDTH, heads=CHECK_WIDTH // 64)
    text, codes = LONG_TEXT // share, LONG_CODES // share
    found = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        found[name] = (_saved_bytes(model, 2, text, codes, dtype, skip=False),
                       _saved_bytes(model, 2, text, codes, dtype))
    return found


def measure_activations(model: UnifiedVoiceGPT, dtype: torch.dtype | None, share: int) -> Activations:
    """Bytes saved for backward at the official width (see the module docstring), on the CPU."""
    text, codes = LONG_TEXT // share, LONG_CODES // share
    blocks = model.gpt.h
    saved = {}
    for layers in (1, 2):
        model.gpt.h = torch.nn.ModuleList(list(blocks)[:layers])
        for n in (1, 2):
            saved[layers, n] = _saved_bytes(model, n, text, codes, dtype)
    model.gpt.h = blocks
    sample = {layers: saved[layers, 2] - saved[layers, 1] for layers in (1, 2)}
    copies = {layers: saved[layers, 1] - sample[layers] for layers in (1, 2)}
    seq = positions(text, codes)
    layer = (sample[2] - sample[1]) / seq
    return Activations(layer, (sample[1] - layer * seq) / seq, copies[2] - copies[1], 2 * copies[1] - copies[2])


def _saved_bytes(model: UnifiedVoiceGPT, n: int, text: int, codes: int, dtype: torch.dtype | None,
                 skip: bool = True) -> int:
    """Bytes of the storages autograd saves in one forward (the weights' own excluded); `skip`: under ShapesOnly."""
    cfg, g = model.cfg, torch.Generator().manual_seed(n)
    batch = (torch.randn(n, 32, cfg.model_dim, generator=g), torch.randn(n, cfg.model_dim, generator=g),
             torch.randint(2, cfg.number_text_tokens, (n, text), generator=g), torch.full((n,), text),
             torch.randint(0, cfg.start_mel_token, (n, codes), generator=g), torch.full((n,), codes))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=dtype) if dtype else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast, ShapesOnly() if skip else nullcontext():
        sums = model.loss_sums(*batch, dropout_keys=dropout_keys(0, 0, torch.arange(n)))
    del sums  # the graph and what it saved go with it
    return sum(storages.values())


def gpu_row(name: str, mib: int, capability: tuple[int, int], measured: dict[str, Activations]) -> dict:
    """One row of the table: precision, micro-batch without and with gradient checkpointing, host memory."""
    gpu = GpuInfo(index=0, name=name, total_bytes=mib * 2 ** 20, free_bytes=mib * 2 ** 20, capability=capability,
                  bf16=capability >= (8, 0), tf32=capability >= (8, 0))  # as detect_hardware sets them
    hw = Hardware(torch.device("cuda", 0), gpu, 1, HOST_CORES, 0)
    amp = choose_amp(hw, "auto")
    cfg = official_gpt()
    trained = _trained_bytes()
    act = measured["fp32" if amp.dtype is None else "half"]
    budget = MemoryBudget(int((gpu.total_bytes - trained - CUDA_CONTEXT) * MEMORY_MARGIN), trained)
    seq = positions(LONG_TEXT, LONG_CODES)
    row = {"precision": amp.name}
    for key, checkpointing in (("micro_batch", False), ("micro_batch_grad_checkpointing", True)):
        per_sample = act.per_sample(cfg.layers, seq, checkpointing, cfg.model_dim)
        fixed = trained + act.per_pass(cfg.layers)
        n = 0
        while n < MAX_MICRO_BATCH and budget.allows(int(fixed + (n + 1) * per_sample)):
            n += 1
        row[key] = n
    row["host_gib_pinned_saves"] = round(host_bytes_for_pinned_saves(hw) / GiB, 2)
    return row


def host_bytes_for_pinned_saves(hw: Hardware) -> int:
    """Host memory available at start for background saves in pinned buffers (trainers/checkpoint/save_mode.py):
    the packed pinned blocks of the official model's trained weights and AdamW moments, plus what the run keeps."""
    sizes = [(4 * torch.Size(shape).numel(), True) for _, shape in _official_trained_shapes()] * 3
    workers, _ = auto_workers(hw)
    need = reserved_bytes(sizes) + HEADROOM_BYTES + workers * WORKER_BYTES
    chosen = [choose_save_mode(sizes, HostMemory(avail, avail, "computed"), workers).pinned
              for avail in (need - 1, need)]
    if chosen != [False, True]:
        raise AssertionError(f"save_mode.py no longer chooses pinned saves from {need / GiB:.2f} GiB up: update this")
    return need


@cache
def _trained_bytes() -> int:
    """The official model's trained fp32 weights (built on the meta device once: every row needs them)."""
    with torch.device("meta"):
        return sum(p.numel() for p in UnifiedVoiceGPT(official_gpt()).parameters()) * 4


@cache
def _official_trained_shapes() -> list[tuple[str, tuple[int, ...]]]:
    return official_shapes()[0]


def table(measured: dict[str, Activations]) -> dict[str, dict]:
    return {name: gpu_row(name, mib, cap, measured) for name, mib, cap in GPUS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help=f"measure at 1/{SMOKE_MEASURE_SHARE} of the lengths (seconds)")
    args = p.parse_args()
    share = SMOKE_MEASURE_SHARE if args.smoke else MEASURE_SHARE
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; measured at 1/{share} of {LONG_TEXT} text and {LONG_CODES} codes")
    started = time.perf_counter()
    same = shapes_only_changes_nothing(SMOKE_MEASURE_SHARE)
    for name, (computed, shapes) in same.items():
        print(f"check at width {CHECK_WIDTH}, {name}: saved bytes with the products computed {computed:,}, "
              f"without {shapes:,}: {'equal' if computed == shapes else 'DIFFERENT'}")
    if any(computed != shapes for computed, shapes in same.values()):
        print("FAIL: skipping the products changes what autograd saves; the table below would be wrong")
        return 1
    measured = measure(share)
    cfg, seq = official_gpt(), positions(LONG_TEXT, LONG_CODES)
    for key, act in measured.items():
        plain, recomputed = (act.per_sample(cfg.layers, seq, c, cfg.model_dim) / GiB for c in (False, True))
        print(f"bytes a sample keeps for backward at the official config ({seq} positions), "
              f"{'fp32' if key == 'fp32' else 'bf16/fp16'}: {plain:.3f} GiB; with --grad-checkpointing "
              f"{recomputed:.3f} GiB")
    print("| GPU | --amp auto picks | micro-batch | with --grad-checkpointing | host RAM for pinned background saves |")
    print("|---|---|---|---|---|")
    for name, row in table(measured).items():
        print(f"| {name} | {row['precision']} | {row['micro_batch']} (computed) | "
              f"{row['micro_batch_grad_checkpointing']} (computed) | {row['host_gib_pinned_saves']:.1f} GiB "
              "(computed) |")
    print(f"measured and computed in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
