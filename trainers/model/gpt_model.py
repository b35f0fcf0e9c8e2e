"""IndexTTS2 GPT ("UnifiedVoice" v2), training path only, in plain PyTorch.

Parameter names and shapes follow the official checkpoint (group A of
shared/reference/indextts2-gpt.md), so `state_dict()` loads into upstream inference.
The conditioning encoders (group B) are not part of this module: the trainer carries
their tensors through unchanged (see `trainers.model.weights`).

Two deliberate differences from the upstream training forward, both documented in
docs/architecture.md and both invisible to inference:

* Layout. Upstream concatenates [prefix | padded text | padded mel], so in a padded batch a
  sample's mel positions attend to its batch-mates' text padding and its loss depends on
  which micro-batch it lands in. `forward(..., layout="packed")` (the default for
  training) places each sample's mel right after its own text and moves all padding to
  the end, so under a causal mask every real position sees exactly what it would see
  alone, as at inference. `layout="upstream"` reproduces the upstream arrangement exactly
  for comparisons; for a batch without padding both give identical logits.
* Dropout. Masks are a pure function of (dropout key of the sample, site, position,
  channel) instead of the global RNG, so they do not depend on the micro-batch a sample
  is in, on interruptions, or on gradient-checkpoint recomputation. Attention-probability
  dropout is not offered: SDPA draws it from the global RNG per batch. The masks live in
  trainers/model/sample_dropout.py, in three versions (`dropout_masks="v1"|"v2"|"v3"`, see there).
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainers.model.cross_entropy import summed_cross_entropy
from trainers.model.layout import CONDITION_LEN, PREFIX_LEN
from trainers.model.sample_dropout import (
    DEFAULT_MASKS,
    MASK_VERSIONS,
    PositionHashes,
    SampleDropout,
    WidthDropout,
    dropout_keys,
)


# Dropout sites of the LoRA adapters' inputs start here, far above the model's (0 .. 2 x layers).
ADAPTER_SITES = 1 << 20

# The official IndexTTS2 config's values, quoted in messages as examples.
_OFFICIAL = {"model_dim": 1280, "layers": 24, "heads": 20, "max_text_tokens": 600, "max_mel_tokens": 1815,
             "number_text_tokens": 12000, "number_mel_codes": 8194, "start_text_token": 0, "stop_text_token": 1,
             "start_mel_token": 8192, "stop_mel_token": 8193}
OFFICIAL_MODEL_DIM = _OFFICIAL["model_dim"]
# The lowest value each integer field accepts.
_LOWEST = {"model_dim": 1, "layers": 1, "heads": 1, "max_text_tokens": 1, "max_mel_tokens": 1,
           "number_text_tokens": 2, "number_mel_codes": 3,
           "start_text_token": 0, "stop_text_token": 0, "start_mel_token": 0, "stop_mel_token": 0}


@dataclass(frozen=True)
class GPTConfig:
    """The `gpt` section of an IndexTTS2 config.yaml that the training path needs."""

    OFFICIAL: ClassVar[Mapping[str, int]] = _OFFICIAL  # the official config's values, quoted in messages
    model_dim: int
    layers: int
    heads: int
    max_text_tokens: int
    max_mel_tokens: int
    number_text_tokens: int
    number_mel_codes: int
    start_text_token: int = 0
    stop_text_token: int = 1
    start_mel_token: int = 8192
    stop_mel_token: int = 8193
    dropout: float = 0.1

    @classmethod
    def from_yaml_section(cls, section: Mapping[str, Any], **overrides: Any) -> "GPTConfig":
        """The config of a yaml `gpt` section; ValueError lists every problem, one `gpt.KEY ...` per line."""
        values = {f.name: section[f.name] for f in fields(cls) if f.name in section}
        values.update(overrides)
        problems = cls.section_problems(values)
        if problems:
            raise ValueError("\n".join(problems))
        return cls(**values)

    @classmethod
    def section_problems(cls, values: Mapping[str, Any], supplied: tuple[str, ...] = ()) -> list[str]:
        """What is wrong with a gpt section: missing keys (except those `supplied` later), then its values.

        Sizes are whole numbers >= 1 (the text vocabulary >= 2, the mel vocabulary >= 3: a code
        plus start and stop), model_dim splits evenly into heads, start/stop text tokens are two
        distinct ids of the text vocabulary, and start/stop mel tokens are the last two ids of the
        mel vocabulary, as in the official config: the data check takes every id below
        start_mel_token for a semantic code, so specials anywhere else would collide with codes.
        """
        official = cls.OFFICIAL
        problems = [f"gpt.{f.name} is missing; add it (the official config has {f.name}: {official[f.name]})"
                    for f in fields(cls) if f.name not in values and f.name not in supplied and f.default is MISSING]
        # Special token ids the section leaves out take their defaults, which must fit the section too.
        full = {f.name: f.default for f in fields(cls) if f.name in _LOWEST and f.default is not MISSING}
        full.update({k: v for k, v in values.items() if k in _LOWEST})

        def got(name: str) -> str:
            return f"got {full[name]!r}" + ("" if name in values else " (the default: the config does not set it)")

        ok: dict[str, int] = {}
        for name, value in full.items():
            if type(value) is not int:  # bool is an int subclass: refuse it too
                problems.append(f"gpt.{name} must be a whole number, {got(name)} ({type(value).__name__}); write "
                                f"digits only, e.g. {name}: {official[name]} as in the official config")
            elif value < _LOWEST[name]:
                problems.append(f"gpt.{name} must be at least {_LOWEST[name]}, {got(name)}; the official config has "
                                f"{name}: {official[name]}")
            else:
                ok[name] = value
        if "model_dim" in ok and "heads" in ok and ok["model_dim"] % ok["heads"]:
            problems.append(f"gpt.heads {ok['heads']} does not divide gpt.model_dim {ok['model_dim']}; choose heads "
                            "that split model_dim evenly (the official config: 1280 / 20 heads)")
        codes = ok.get("number_mel_codes")
        for name, offset in (("start_mel_token", 2), ("stop_mel_token", 1)):
            if codes is not None and name in ok and ok[name] != codes - offset:
                problems.append(f"gpt.{name} must be gpt.number_mel_codes - {offset} = {codes - offset} (the special "
                                f"ids follow the {codes - 2} semantic codes, as in the official config), {got(name)}; "
                                f"fix gpt.{name} or gpt.number_mel_codes")
        tokens = ok.get("number_text_tokens")
        for name in ("start_text_token", "stop_text_token"):
            if tokens is not None and name in ok and ok[name] >= tokens:
                problems.append(f"gpt.{name} must be an id of the text vocabulary (0..{tokens - 1}), {got(name)}; use "
                                f"the id of the tokenizer's {name.split('_')[0]} piece (the official config: "
                                f"{official[name]})")
        if "start_text_token" in ok and ok.get("stop_text_token") == ok["start_text_token"]:
            problems.append(f"gpt.stop_text_token equals gpt.start_text_token ({ok['start_text_token']}); they must "
                            "differ (the official config: 0 and 1)")
        return problems

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Conv1D(nn.Module):
    """GPT-2's transposed linear layer: y = x @ W + b with W stored [in, out]."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor, adapter_drop: "WidthDropout | None" = None, site: int = 0) -> torch.Tensor:
        # adapter_drop and site: for a LoRA adapter's input dropout (trainers/model/lora.py); unused here.
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = Conv1D(dim, 3 * dim)
        self.c_proj = Conv1D(dim, dim)

    def forward(self, x: torch.Tensor, adapter_drop: "WidthDropout | None" = None, site: int = 0) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(x, adapter_drop, site).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, d), adapter_drop, site + 1)


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(dim, 4 * dim)
        self.c_proj = Conv1D(4 * dim, dim)

    def forward(self, x: torch.Tensor, adapter_drop: "WidthDropout | None" = None, site: int = 0) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x, adapter_drop, site), approximate="tanh"), adapter_drop, site + 1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor, drop: "SampleDropout", site: int,
                adapter_drop: "WidthDropout | None" = None) -> torch.Tensor:
        # The four adapter inputs of the block with residual sites (site, site + 1) get their own sites,
        # ADAPTER_SITES + 2 * site + 0..3, which no other block or residual uses.
        adapter_site = ADAPTER_SITES + 2 * site
        x = x + drop(self.attn(self.ln_1(x), adapter_drop, adapter_site), site)
        return x + drop(self.mlp(self.ln_2(x), adapter_drop, adapter_site + 2), site + 1)


class GPTStack(nn.Module):
    """Holds `h` and `ln_f` under the names the official checkpoint uses (gpt.h.N, gpt.ln_f)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.h = nn.ModuleList(Block(cfg.model_dim, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.model_dim, eps=1e-5)


class LearnedPositionEmbeddings(nn.Module):
    def __init__(self, seq_len: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(seq_len, dim)

    def forward(self, length: int) -> torch.Tensor:
        return self.emb(torch.arange(length, device=self.emb.weight.device))


# --- the model ------------------------------------------------------------------------------


class UnifiedVoiceGPT(nn.Module):
    """The IndexTTS2 (2.0) GPT, and the trunk other model families' GPTs extend (trainers/families).

    What differs between families is here as overridable parts: the conditioning inputs a batch brings
    besides text and codes (`CONDITIONING`, the names of its fields, which forward() and loss_sums() take
    first), the prefix they become (`conditioning_prefix`, `prefix_len` positions), the modules that make
    it (`_prefix_modules`), the text positions' embeddings (`text_embeddings`) and an example of the inputs
    for memory probes (`example_conditioning`). The rest, the blocks, heads, packing and dropout, is shared.
    """

    CONDITIONING: tuple[str, ...] = ("condition", "emo_vec")
    prefix_len: int = PREFIX_LEN

    def __init__(self, cfg: GPTConfig, gradient_checkpointing: bool = False, dropout_masks: str = DEFAULT_MASKS,
                 deterministic_loss: bool = False) -> None:
        """`dropout_masks` picks the mask generator ("v1", "v2" or "v3", see trainers/model/sample_dropout.py);
        `deterministic_loss` the cross-entropy with deterministic CUDA kernels (trainers/model/cross_entropy.py).

        It is not a GPTConfig field: that dict is fingerprinted, and a new field would fail the
        resume check of every existing checkpoint. The trainer keeps it in its run settings.
        """
        super().__init__()
        if dropout_masks not in MASK_VERSIONS:
            raise ValueError(f"unknown dropout_masks {dropout_masks!r}; use one of {', '.join(MASK_VERSIONS)}")
        self.dropout_masks = dropout_masks
        self.deterministic_loss = deterministic_loss
        self._mask_positions = PositionHashes()
        self.cfg = cfg
        self.gradient_checkpointing = gradient_checkpointing
        # Dropout on the LoRA adapters' inputs, keyed by sample like the model's (set by lora.add_adapters).
        self.adapter_dropout = 0.0
        d = cfg.model_dim
        self.text_embedding = nn.Embedding(cfg.number_text_tokens + 1, d)
        self.mel_embedding = nn.Embedding(cfg.number_mel_codes, d)
        self.text_pos_embedding = LearnedPositionEmbeddings(cfg.max_text_tokens + 2, d)
        self.mel_pos_embedding = LearnedPositionEmbeddings(cfg.max_mel_tokens + 3, d)
        self._prefix_modules(d)
        self.gpt = GPTStack(cfg)
        self.final_norm = nn.LayerNorm(d, eps=1e-5)
        self.text_head = nn.Linear(d, cfg.number_text_tokens + 1)
        self.mel_head = nn.Linear(d, cfg.number_mel_codes)
        self.apply(_init_weights)

    # -- the family's parts: conditioning prefix and text embeddings --

    def _prefix_modules(self, d: int) -> None:
        """The modules of the conditioning prefix, registered here (their place fixes the parameters' order)."""
        self.speed_emb = nn.Embedding(2, d)

    def conditioning_prefix(self, condition: torch.Tensor, emo_vec: torch.Tensor) -> torch.Tensor:
        """The prefix [B, prefix_len, D]: the 32 conditioning latents [B,32,D] each plus emo_vec [B,D], then
        speed_emb(1) and speed_emb(0), as upstream's inference_speech builds it."""
        b = condition.shape[0]
        speed = self.speed_emb(torch.tensor([1, 0], device=condition.device)).unsqueeze(0).expand(b, -1, -1)
        return torch.cat([condition + emo_vec.unsqueeze(1), speed.to(condition.dtype)], dim=1)

    def text_embeddings(self, text_in: torch.Tensor, **conditioning: torch.Tensor) -> torch.Tensor:
        """The embeddings [B, T+2, D] of the text inputs (start, ids, stop), with their positions 0..T+1."""
        return self.text_embedding(text_in) + self.text_pos_embedding(text_in.shape[1])

    def example_conditioning(self, n: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Zero conditioning inputs of n samples, of the shapes and dtypes a batch brings (memory probes, checks)."""
        d = self.cfg.model_dim
        return {"condition": torch.zeros(n, CONDITION_LEN, d, device=device),
                "emo_vec": torch.zeros(n, d, device=device)}

    # -- inputs --

    def text_io(self, text_ids: torch.Tensor, text_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forcing inputs and targets for text, both [B, T+2]; unused targets are -100."""
        return _segment_io(text_ids, text_lens, self.cfg.start_text_token, self.cfg.stop_text_token)

    def mel_io(self, codes: torch.Tensor, code_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _segment_io(codes, code_lens, self.cfg.start_mel_token, self.cfg.stop_mel_token)

    # -- forward --

    def hidden_states(self, conditioning: Mapping[str, torch.Tensor], text_in: torch.Tensor,
                      text_lens: torch.Tensor, mel_in: torch.Tensor, code_lens: torch.Tensor,
                      dropout_keys: torch.Tensor | None = None, layout: str = "packed",
                      packed_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Final-normed hidden states at the text and mel input positions: [B,T+2,D], [B,M+2,D].

        `conditioning`: the batch's CONDITIONING inputs by name. `packed_len`: `packed_length(text_lens,
        code_lens, prefix_len)`, computed by the caller from the host copy of the lengths, so a GPU run does not
        wait to read it back from the device (else computed here).
        """
        if layout == "packed" and packed_len is None:
            packed_len = _read_packed_length(text_lens, code_lens, self.prefix_len)
        t2, m2 = text_in.shape[1], mel_in.shape[1]
        prefix = self.conditioning_prefix(**conditioning)
        text_e = self.text_embeddings(text_in, **conditioning)
        mel_e = self.mel_embedding(mel_in) + self.mel_pos_embedding(m2)
        x = torch.cat([prefix.to(text_e.dtype), text_e, mel_e], dim=1)  # upstream order
        text_pos, mel_pos = _positions(text_lens, t2, m2, layout, packed_len, self.prefix_len)
        if layout == "packed":
            x = _gather_time(x, _packed_source(text_lens, t2, m2, packed_len, self.prefix_len))
        p = self.cfg.dropout if self.training else 0.0
        if p > 0 and dropout_keys is None:
            raise ValueError("training with dropout needs dropout_keys (see dropout_keys()); they make masks per sample")
        drop = SampleDropout(p, dropout_keys, x.shape[1], x.shape[2], x.device, self.dropout_masks,
                             self._mask_positions)
        x = drop(x, 0)
        p_adapter = self.adapter_dropout if self.training else 0.0
        adapter_drop = WidthDropout(p_adapter, dropout_keys, x.shape[1], x.device, self.dropout_masks,
                                    self._mask_positions)
        for i, block in enumerate(self.gpt.h):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, drop, 1 + 2 * i, adapter_drop, use_reentrant=False)
            else:
                x = block(x, drop, 1 + 2 * i, adapter_drop)
        x = self.gpt.ln_f(x)
        return self.final_norm(_gather_time(x, text_pos)), self.final_norm(_gather_time(x, mel_pos))

    def _teacher_forced(self, conditioning, text_ids, text_lens, codes, code_lens, dropout_keys, layout,
                        packed_len=None):
        """Hidden states at every input position plus the targets they predict."""
        text_in, text_tgt = self.text_io(text_ids, text_lens)
        mel_in, mel_tgt = self.mel_io(codes, code_lens)
        h_text, h_mel = self.hidden_states(conditioning, text_in, text_lens, mel_in, code_lens, dropout_keys, layout,
                                           packed_len)
        return h_text, h_mel, text_tgt, mel_tgt

    def _logits(self, conditioning: Mapping[str, torch.Tensor], text_ids: torch.Tensor, text_lens: torch.Tensor,
                codes: torch.Tensor, code_lens: torch.Tensor, dropout_keys: torch.Tensor | None,
                layout: str) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() for any family: its conditioning inputs by name."""
        h_text, h_mel, _, _ = self._teacher_forced(conditioning, text_ids, text_lens, codes, code_lens, dropout_keys,
                                                   layout)
        return self.text_head(h_text), self.mel_head(h_mel)

    def _loss_sums(self, conditioning: Mapping[str, torch.Tensor], text_ids: torch.Tensor, text_lens: torch.Tensor,
                   codes: torch.Tensor, code_lens: torch.Tensor, dropout_keys: torch.Tensor | None,
                   packed_len: int | None) -> dict[str, torch.Tensor]:
        """loss_sums() for any family: its conditioning inputs by name."""
        h_text, h_mel, text_tgt, mel_tgt = self._teacher_forced(conditioning, text_ids, text_lens, codes, code_lens,
                                                                dropout_keys, "packed", packed_len)
        t_valid, m_valid = text_tgt >= 0, mel_tgt >= 0
        mel_logits = self.mel_head(h_mel[m_valid]).float()
        mel_targets = mel_tgt[m_valid]
        return {
            "text_ce": self.text_cross_entropy(h_text[t_valid], text_tgt[t_valid]),
            "mel_ce": summed_cross_entropy(mel_logits, mel_targets, self.deterministic_loss),
            "text_tokens": t_valid.sum(),
            "mel_tokens": m_valid.sum(),
            "mel_correct": (mel_logits.argmax(-1) == mel_targets).sum(),
        }

    def text_cross_entropy(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed text loss of final-normed hidden states [N, D] against their targets [N]: the text head's
        logits in one block (a family with a wide text head computes them in blocks: trainers/model/cross_entropy.py
        chunked_head_cross_entropy)."""
        return summed_cross_entropy(self.text_head(h).float(), targets, self.deterministic_loss)

    def forward(self, condition: torch.Tensor, emo_vec: torch.Tensor, text_ids: torch.Tensor,
                text_lens: torch.Tensor, codes: torch.Tensor, code_lens: torch.Tensor,
                dropout_keys: torch.Tensor | None = None,
                layout: str = "packed") -> tuple[torch.Tensor, torch.Tensor]:
        """Text and mel logits for a batch, as upstream's training forward computes them.

        condition [B,32,D] float, emo_vec [B,D], text_ids [B,T] (no start/stop), text_lens [B],
        codes [B,M] semantic codes, code_lens [B]. Returns text_logits [B,T+2,Nt+1] and
        mel_logits [B,M+2,Nm]; position j predicts target j of `text_io` / `mel_io`.
        With layout="upstream" the numbers match upstream IndexTTS2 on the same weights.
        """
        return self._logits({"condition": condition, "emo_vec": emo_vec}, text_ids, text_lens, codes, code_lens,
                            dropout_keys, layout)

    def loss_sums(self, condition: torch.Tensor, emo_vec: torch.Tensor, text_ids: torch.Tensor,
                  text_lens: torch.Tensor, codes: torch.Tensor, code_lens: torch.Tensor,
                  dropout_keys: torch.Tensor | None = None,
                  packed_len: int | None = None) -> dict[str, torch.Tensor]:
        """Summed (not averaged) cross-entropies and counts over valid targets.

        Sums let the trainer divide by the token count of the whole optimizer step, so the
        gradient does not depend on how the step's samples are split into micro-batches.
        Heads run on valid positions only, which saves the padded part of the big mel logits.
        """
        return self._loss_sums({"condition": condition, "emo_vec": emo_vec}, text_ids, text_lens, codes, code_lens,
                               dropout_keys, packed_len)


def _init_weights(module: nn.Module) -> None:
    # GPT-2 initialisation; only used when no base checkpoint is given (tests, demo base).
    if isinstance(module, (nn.Linear, nn.Embedding, Conv1D)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, (nn.Linear, Conv1D)) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _segment_io(ids: torch.Tensor, lens: torch.Tensor, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, n = ids.shape
    pos = torch.arange(n + 1, device=ids.device).unsqueeze(0)
    body = torch.cat([ids, ids.new_full((b, 1), stop)], dim=1)
    body = torch.where(pos < lens.unsqueeze(1), body, torch.full_like(body, stop))
    inputs = torch.cat([ids.new_full((b, 1), start), body], dim=1)
    targets = torch.cat([body, ids.new_full((b, 1), stop)], dim=1)
    valid = torch.arange(n + 2, device=ids.device).unsqueeze(0) < (lens.unsqueeze(1) + 1)
    return inputs, torch.where(valid, targets, torch.full_like(targets, -100))


def _gather_time(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def _packed_source(text_lens: torch.Tensor, t2: int, m2: int, seq_len: int, prefix_len: int) -> torch.Tensor:
    """For each packed position, its position in the upstream [prefix|text|mel] order."""
    p = torch.arange(seq_len, device=text_lens.device).unsqueeze(0)
    mel_start_packed = prefix_len + text_lens.unsqueeze(1) + 2
    from_mel = prefix_len + t2 + (p - mel_start_packed)
    # Tail padding reads some mel padding; causality keeps it out of every real position.
    return torch.where(p < mel_start_packed, p, from_mel).clamp(max=prefix_len + t2 + m2 - 1)


def packed_length(text_lens: torch.Tensor, code_lens: torch.Tensor, prefix_len: int = PREFIX_LEN) -> int:
    """The packed sequence length of a batch: its longest prefix + text + codes, with start and stop
    tokens (`prefix_len`: the model's, UnifiedVoiceGPT.prefix_len). Reading it is a host-device
    synchronisation when the lengths live on a GPU."""
    return int((prefix_len + text_lens + 2 + code_lens + 2).max())


def _read_packed_length(text_lens: torch.Tensor, code_lens: torch.Tensor, prefix_len: int = PREFIX_LEN) -> int:
    """The model's own reading of the packed length, where the caller did not pass it (a sync on a GPU)."""
    return packed_length(text_lens, code_lens, prefix_len)


def _positions(text_lens: torch.Tensor, t2: int, m2: int, layout: str, seq_len: int | None,
               prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence positions of the text and mel inputs of every sample in the chosen layout."""
    b = text_lens.shape[0]
    j_text = torch.arange(t2, device=text_lens.device).unsqueeze(0).expand(b, -1)
    j_mel = torch.arange(m2, device=text_lens.device).unsqueeze(0).expand(b, -1)
    if layout == "upstream":
        return prefix_len + j_text, prefix_len + t2 + j_mel
    if layout != "packed":
        raise ValueError(f"unknown layout {layout!r}; use 'packed' or 'upstream'")
    # Positions past a sample's own length point at padding; their targets are ignored.
    text_pos = (prefix_len + j_text).clamp(max=seq_len - 1)
    mel_pos = (prefix_len + text_lens.unsqueeze(1) + 2 + j_mel).clamp(max=seq_len - 1)
    return text_pos, mel_pos


__all__ = [
    "GPTConfig",
    "PREFIX_LEN",
    "UnifiedVoiceGPT",
    "dropout_keys",
    "packed_length",
]
