"""Dropout whose mask at (sample, site, position, channel) is a pure function of them.

torch's dropout draws its masks from the global RNG stream, so they change with the micro-batch
split, with interruptions and with gradient-checkpoint recomputation. Here each sample carries
a 32-bit key (`dropout_keys`: seed, optimizer step, sample index) and the mask is computed
from that key, the dropout site, and the cell index `position * dim + channel`.

Three mask versions, selected by `UnifiedVoiceGPT(..., dropout_masks=...)` (the run setting
`dropout_masks`, see trainers/config/settings.py):

* "v1": the first implementation, kept bit for bit because checkpoints of runs trained with it
  must resume exactly. Every site hashes `cell + key` in int64 (16 passes over B x S x D, 12
  of them int64), saves the mask in the activation dtype for backward, and since the key is
  added to the cell index, the masks of two (sample, site) pairs whose keys are close are the
  same sequence shifted.
* "v2" (the default for new runs): the cell hash does not depend on the key, so it is
  computed once per device and shared by every sample, site, step and sequence length. A site
  then costs a non-linear mix of that hash with a per-(sample, site) xor key and odd
  multiplier: 6 int32 passes over B x S x D / 2 words (each 32-bit result gives two cells'
  masks), one comparison that writes a 0/1 mask in the activation dtype (no bool kernels,
  which are slow on CPU), and one fused multiply-by-mask-and-scale. On CPU this runs in
  cache-sized chunks, so a site's memory traffic is little more than reading its input and
  writing its output. Nothing is saved for backward: the mask is regenerated there, so
  dropout costs no activation memory.
* "v3" (opt-in, for GPUs): the keep decision is made in the kernel that applies it, forward and
  backward (trainers/model/fused_masks.py, compiled on CUDA): one pass reading the input and
  writing the output, nothing saved. On the CPU it runs eagerly and costs more than v2.
"""
from __future__ import annotations

import torch

from trainers.model import fused_masks
from trainers.model.mask_hash import MASK32 as _MASK32, hash32 as _hash32, site_key, to_int32 as _to_int32

MASK_VERSIONS = ("v1", "v2", "v3")
DEFAULT_MASKS = "v2"


def dropout_keys(seed: int, step: int, sample_indices: torch.Tensor) -> torch.Tensor:
    """32-bit keys naming each sample's dropout masks for one optimizer step, [B] int64."""
    idx = sample_indices.to(torch.int64) & _MASK32
    k = _hash32(torch.full_like(idx, seed & _MASK32))
    k = _hash32((k + (step & _MASK32) * 0x9E3779B1) & _MASK32)
    return _hash32((k + idx * 0x85EBCA6B) & _MASK32)


# v2 constants. Products in int32 wrap modulo 2**32 (vectorised mullo on CPU, mul.lo on CUDA);
# tests/test_dropout_masks.py checks the result against an exact int64 formula.
_V2_FINAL_MUL = 0x846CA68B - 2**32  # an odd multiplier with good avalanche, as int32
_V2_TABLE_CHUNK = 1 << 20  # the position table grows in whole chunks (4 MiB)
# On CPU, masks are made and applied in chunks of this many cells (even, so each starts at a
# word): their integer temporaries stay in cache, and the memory traffic of a site is then
# little more than its input read and output written.
_CPU_CHUNK = 1 << 18


class PositionHashes:
    """v2's hashes of word indices, one growing table per device, owned by the model that uses it.

    A pure function of the index, so a prefix of a longer table is the table of a shorter
    sequence: one table serves every forward, and each forward only slices it.
    """

    def __init__(self) -> None:
        self._tables: dict[torch.device, torch.Tensor] = {}

    def first(self, words: int, device: torch.device) -> torch.Tensor:
        """Hashes of word indices 0..words-1 as int32 [words]."""
        table = self._tables.get(device)
        if table is None or table.numel() < words:
            n = -(-words // _V2_TABLE_CHUNK) * _V2_TABLE_CHUNK
            idx = torch.arange(n, device=device, dtype=torch.int64)
            table = _to_int32(_hash32((idx * 0x9E3779B1 + 0x632BE5AB) & _MASK32))
            self._tables[device] = table
        return table[:words]


class SampleDropout:
    """One instance serves one forward pass: it is built from the samples' keys and the padded
    sequence length, and called once per site. Calling it again for a site (gradient
    checkpointing, backward) gives the same mask.
    """

    def __init__(self, p: float, keys: torch.Tensor | None, seq_len: int, dim: int, device: torch.device,
                 version: str = DEFAULT_MASKS, positions: PositionHashes | None = None) -> None:
        if version not in MASK_VERSIONS:
            raise ValueError(f"unknown dropout mask version {version!r}; use one of {', '.join(MASK_VERSIONS)}")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.version = version
        self.active = p > 0 and keys is not None
        if not self.active:
            return
        assert keys is not None
        self.keys = keys.to(device=device, dtype=torch.int64).view(-1, 1, 1)
        self.scale = 1.0 / (1.0 - p)
        self.shape = (self.keys.shape[0], seq_len, dim)
        if version == "v1":
            self.cells = torch.arange(seq_len * dim, device=device, dtype=torch.int64).view(1, seq_len, dim)
            self.threshold = int(p * 2**32)
        elif version == "v3":
            fused_masks.check_cells(seq_len * dim)
            self.threshold = fused_masks.threshold(p)
            self._v3_keys: dict[int, torch.Tensor] = {}
        else:
            self.positions = (positions or PositionHashes()).first(-(-seq_len * dim // 2), device)
            # Each 32-bit hash gives two cells' masks, one per 16-bit half: the drop rate is
            # round(p * 2**16) / 2**16, within 2**-17 of p.
            self.threshold16 = min(round(p * 2**16), 2**16 - 1) - 2**15
            self._site_keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, site: int) -> torch.Tensor:
        if not self.active:
            return x
        if self.version == "v1":
            site_keys = site_key(self.keys, site)
            keep = _hash32((self.cells + site_keys) & _MASK32) >= self.threshold
            return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))
        if self.version == "v3":
            return fused_masks.FusedMask.apply(x, self._keys_v3(site), self.threshold, self.scale)
        return _RegeneratedMask.apply(x, self, site)

    def _keys_v3(self, site: int) -> torch.Tensor:
        """v3: the samples' [B, 1] keys of a site, made once per forward (backward and recomputation reuse them)."""
        if site not in self._v3_keys:
            self._v3_keys[site] = fused_masks.site_keys(self.keys, site)
        return self._v3_keys[site]

    # -- v2 --

    def keep_mask(self, site: int, dtype: torch.dtype) -> torch.Tensor:
        """v2 and v3: 1 where a cell is kept, 0 where dropped, as a [B, S, D] tensor of `dtype`."""
        if self.version == "v3":
            ones = torch.ones(self.shape, dtype=dtype, device=self.keys.device)
            return fused_masks.apply(ones, self._keys_v3(site), self.threshold, 1.0)
        add, mul = self._keys_of_site(site)
        b, s, d = self.shape
        out = torch.empty((b, s * d), dtype=dtype, device=self.positions.device)
        return _keep_from_hashes(self.positions, add, mul, self.threshold16, s * d, out).view(b, s, d)

    def _keys_of_site(self, site: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample int32 [B, 1] xor key and odd multiplier of a site, both hashes of (key, site).

        The multiplier is what makes two samples' masks unrelated: with a shared multiplier,
        keys differing only in their top bits would give related masks.
        """
        if site not in self._site_keys:
            add = site_key(self.keys.view(-1, 1), site)
            mul = _hash32(add ^ 0x5BD1E995) | 1
            self._site_keys[site] = (_to_int32(add), _to_int32(mul))
        return self._site_keys[site]

    def apply_mask(self, t: torch.Tensor, site: int) -> torch.Tensor:
        """v2: t * keep * scale, fused (addcmul: 0 + scale * t * keep)."""
        if t.device.type != "cpu":
            # A whole batch per kernel: on a GPU launches matter more than memory traffic.
            return torch.addcmul(t.new_zeros(()), t, self.keep_mask(site, t.dtype), value=self.scale)
        add, mul = self._keys_of_site(site)
        b, s, d = self.shape
        n = s * d
        src, out = t.reshape(b, n), torch.empty((b, n), dtype=t.dtype)
        keep, zero = torch.empty(min(n, _CPU_CHUNK), dtype=t.dtype), t.new_zeros(())
        for i in range(b):
            for start in range(0, n, _CPU_CHUNK):
                stop = min(start + _CPU_CHUNK, n)
                k = _keep_from_hashes(self.positions[start // 2:(stop + 1) // 2], add[i], mul[i], self.threshold16,
                                      stop - start, keep[: stop - start])
                torch.addcmul(zero, src[i, start:stop], k, value=self.scale, out=out[i, start:stop])
        return out.view(b, s, d)


def _keep_from_hashes(words: torch.Tensor, add: torch.Tensor, mul: torch.Tensor, threshold16: int, cells: int,
                      out: torch.Tensor) -> torch.Tensor:
    """v2 keep mask of `cells` cells from the position hashes of their words, written into `out` as 0/1.

    `words` is [W] or [B, W] int32, `add`/`mul` broadcast against it; `out` is [..., cells].
    """
    z = torch.bitwise_xor(words, add)
    z.mul_(mul)
    # Logical (not arithmetic) shift, so the mix stays a bijection of the position hash.
    z.bitwise_xor_((z >> 16).bitwise_and_(0xFFFF))
    z.mul_(_V2_FINAL_MUL)
    # Cell 2w uses the low 16 bits of word w, cell 2w+1 the high 16 (little-endian view).
    # Comparing straight into the activation dtype avoids bool tensors (slow kernels on CPU).
    return torch.ge(z.view(torch.int16)[..., :cells], threshold16, out=out)


class _RegeneratedMask(torch.autograd.Function):
    """x * keep * scale with a backward that regenerates `keep` instead of saving it.

    The mask is a pure function of the keys, so storing it (B x S x D per site) would only
    cost memory; regenerating costs a few integer passes.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, drop: SampleDropout, site: int) -> torch.Tensor:  # type: ignore[override]
        ctx.drop, ctx.site = drop, site
        return drop.apply_mask(x, site)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return ctx.drop.apply_mask(grad, ctx.site), None, None


class WidthDropout:
    """SampleDropout for the inputs of several widths in one forward pass (the LoRA adapters' inputs are
    model_dim or 4 x model_dim wide): one SampleDropout per width, made on first use, each keyed by the
    same samples, so an adapter's mask is as independent of the micro-batch split as the model's."""

    def __init__(self, p: float, keys: torch.Tensor | None, seq_len: int, device: torch.device,
                 version: str = DEFAULT_MASKS, positions: "PositionHashes | None" = None) -> None:
        self.p, self.keys, self.seq_len, self.device = p, keys, seq_len, device
        self.version, self.positions = version, positions
        self._by_width: dict[int, SampleDropout] = {}

    def __call__(self, x: torch.Tensor, site: int) -> torch.Tensor:
        width = x.shape[-1]
        if width not in self._by_width:
            self._by_width[width] = SampleDropout(self.p, self.keys, self.seq_len, width, self.device, self.version,
                                                  self.positions)
        return self._by_width[width](x, site)
