"""The "Which GPU, which settings" table of docs/gpu.md, computed (no GPU is needed, none is measured).

For each GPU class: the precision --amp auto picks there (trainers/hardware/precision.py), the micro-batch the
probe's budget allows at the official config for samples of the corpus's long lengths, without and with
gradient checkpointing, and the host memory background saves need.

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
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache

import torch

from benchmarks.acceptance.context import Context
from benchmarks.acceptance.corpus import LONG_CODES, LONG_TEXT, official_gpt, positions
from benchmarks.acceptance.runner import Outcome
from benchmarks.save_stall import official_shapes
from trainers.checkpoint.host_blocks import reserved_bytes
from trainers.checkpoint.save_mode import HEADROOM_BYTES, WORKER_BYTES, choose_save_mode
from trainers.hardware.batch_probe import MEMORY_MARGIN, MemoryBudget
from trainers.hardware.detect import GpuInfo, Hardware, auto_workers
from trainers.hardware.host_memory import GiB, HostMemory
from trainers.hardware.precision import choose_amp
from trainers.model.gpt_model import UnifiedVoiceGPT, dropout_keys

CUDA_CONTEXT = GiB // 2  # the CUDA context and library handles: taken before the probe reads the free memory
MEASURE_SHARE = 8  # measured at 1/8 of the long lengths, scaled up
SMOKE_MEASURE_SHARE = 32
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


def measure(share: int = MEASURE_SHARE) -> dict[str, Activations]:
    """Bytes saved for backward in fp32 and under bf16 autocast ("half": fp16 keeps the same), measured at 1/share
    of the long lengths on one model at the official width with 2 layers."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = UnifiedVoiceGPT(official_gpt(layers=2)).train()
    return {"fp32": measure_activations(model, None, share), "half": measure_activations(model, torch.bfloat16, share)}


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


def _saved_bytes(model: UnifiedVoiceGPT, n: int, text: int, codes: int, dtype: torch.dtype | None) -> int:
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
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
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


def check(ctx: Context) -> Outcome:
    """The table's rows, and the bytes a sample keeps for backward at the official config (fp32, bf16/fp16);
    --smoke measures at a quarter of the usual lengths (seconds less; the figures then differ a little)."""
    measured = measure(SMOKE_MEASURE_SHARE if ctx.smoke else MEASURE_SHARE)
    cfg, seq = official_gpt(), positions(LONG_TEXT, LONG_CODES)
    figures: dict = table(measured)
    figures["per_sample_gib"] = {key: round(act.per_sample(cfg.layers, seq, False, cfg.model_dim) / GiB, 3)
                                 for key, act in measured.items()}
    figures["per_sample_gib_grad_checkpointing"] = {
        key: round(act.per_sample(cfg.layers, seq, True, cfg.model_dim) / GiB, 3) for key, act in measured.items()}
    ok = all(figures[name]["micro_batch"] >= 1 for name, _, _ in GPUS)
    return Outcome(ok, figures, "computed, not measured")
