"""Autoregressive mel-code generation with UnifiedVoiceGPT, as upstream IndexTTS2 inference generates codes
(`UnifiedVoice.inference_speech`, built by infer_v2 with `kv_cache=True`), from precomputed conditioning.

The sequence: the prefix (the model family's `conditioning_prefix`; IndexTTS2's: the 32 conditioning latents
with emo_vec added to each, speed_emb(1), speed_emb(0)), the text [start_text] + ids + [stop_text] embedded by
the model's `text_embeddings` with text positions 0.., then mel codes from start_mel_token.
Logits come from gpt.ln_f, final_norm and mel_head at the last position; generation stops at stop_mel_token
or after `max_codes` tokens. Samples of different text lengths share a batch, left-padded and masked as
upstream does, so each sample's codes are those it gets alone.

Where upstream's generation differs from teacher forcing, and what this function does:

* Mel positions. Upstream's cached decoding embeds the k-th generated code at mel position k + 1
  (`get_fixed_embedding(attention_mask.shape[1] - mel_len)`), so its positions run 0, 2, 3, ... where
  training (and upstream without a KV cache) uses 0, 1, 2, ... `mel_positions="upstream"` (the default)
  gives the codes IndexTTS2 inference produces; "training" the positions the model was trained on.
  Upstream's optional CUDA engine (`use_accel`) numbers positions differently again; not reproduced.
* Text. Upstream drops every text id equal to start_text_token or stop_text_token before adding its own;
  we take ids[:len] as given (tokenizer output contains neither).
* Repetition penalty. infer_v2 passes repetition_penalty=10.0; `repetition_penalty` applies HF's rule
  (seen codes' logits divided by it if positive, multiplied if negative), and counts mel code 1 and the
  start code as seen from the start, because upstream's placeholder prompt ids are 1s
  (trainers/model/code_choice.py).
* Search. infer_v2 defaults to beam search (num_beams=3) with sampling (temperature 0.8, top_k 30,
  top_p 0.8) and length_penalty 0. Beams are not offered: greedy (num_beams=1, do_sample=False upstream)
  is the parity target, and sampling offers temperature/top-k/top-p from the caller's torch.Generator.
  Upstream's `typical_sampling` warper is not offered.
* Limit. `max_codes` counts generated tokens, the stop included, as upstream's `max_generate_length`.

The model is put in eval mode under no_grad for the call and its training flag restored after; its
parameters are only read. Nothing reads the global RNG.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainers.model.code_choice import Generators, Sampling, choose, first_seen
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.model.kv_cache import KVCache, last_logits

MEL_POSITIONS = ("upstream", "training")


@dataclass(frozen=True)
class GeneratedCodes:
    codes: list[torch.Tensor]  # per sample: int64 on the CPU, the stop code not included
    stopped: list[bool]  # whether the sample emitted stop_mel_token within max_codes tokens


def _check(model: UnifiedVoiceGPT, conditioning: dict[str, torch.Tensor], text_ids: torch.Tensor,
           text_lens: torch.Tensor, max_codes: int, mel_positions: str) -> None:
    cfg = model.cfg
    b = text_ids.shape[0]
    if mel_positions not in MEL_POSITIONS:
        raise ValueError(f"unknown mel_positions {mel_positions!r}; use one of {', '.join(MEL_POSITIONS)}")
    if sorted(conditioning) != sorted(model.CONDITIONING):
        raise TypeError(f"the model takes the conditioning inputs {', '.join(model.CONDITIONING)} besides text_ids "
                        f"and text_lens, got {', '.join(conditioning) or 'none'}")
    expected = {k: list(v.shape) for k, v in model.example_conditioning(b, "meta").items()}
    got = {k: list(conditioning[k].shape) for k in expected}
    if got != expected:
        raise ValueError(" and ".join(f"{k} must be {v}" for k, v in expected.items()) + f" for {b} texts, got "
                         + " and ".join(str(v) for v in got.values()))
    if text_lens.shape != (b,) or int(text_lens.min()) < 0 or int(text_lens.max()) > text_ids.shape[1]:
        raise ValueError(f"text_lens must hold {b} lengths within text_ids' {text_ids.shape[1]} columns, "
                         f"got {text_lens.tolist()}")
    if int(text_lens.max()) > cfg.max_text_tokens:
        raise ValueError(f"a text of {int(text_lens.max())} ids exceeds gpt.max_text_tokens {cfg.max_text_tokens}")
    # The last input is token max_codes - 1; its position must fit the table of max_mel_tokens + 3 rows.
    highest = cfg.max_mel_tokens + 2
    if max_codes < 1 or max_codes > highest:
        raise ValueError(f"max_codes must be 1..{highest} (gpt.max_mel_tokens {cfg.max_mel_tokens} + 2: the mel "
                         f"position table's reach), got {max_codes}")


def _prompts(model: UnifiedVoiceGPT, text_ids: torch.Tensor, text_lens: torch.Tensor,
             **conditioning: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's [prefix | text | start_mel] embeddings, left-padded with zeros: [B, P, D], and the pads.
    The prefix and the text's embeddings are the model's own (its family's), from the sample's conditioning
    inputs in the model's dtype."""
    cfg, device = model.cfg, model.mel_head.weight.device
    dtype = model.mel_head.weight.dtype
    start = model.mel_embedding.weight[cfg.start_mel_token] + model.mel_pos_embedding.emb.weight[0]
    rows = []
    for i, n in enumerate(text_lens.tolist()):
        ids = text_ids[i, :n].to(device)
        text = torch.cat([ids.new_tensor([cfg.start_text_token]), ids, ids.new_tensor([cfg.stop_text_token])])
        own = {k: v[i: i + 1].to(device, dtype if v.is_floating_point() else v.dtype) for k, v in conditioning.items()}
        prefix = model.conditioning_prefix(**own)[0]
        text_e = model.text_embeddings(text.unsqueeze(0), **own)[0]
        rows.append(torch.cat([prefix, text_e, start.unsqueeze(0)]))
    longest = max(r.shape[0] for r in rows)
    pad = torch.tensor([longest - r.shape[0] for r in rows], device=device)
    x = torch.stack([torch.cat([r.new_zeros(longest - r.shape[0], r.shape[1]), r]) for r in rows])
    return x, pad


def _mel_input(model: UnifiedVoiceGPT, codes: torch.Tensor, index: int, mel_positions: str) -> torch.Tensor:
    """Embedding [B, 1, D] of the `index`-th mel input (0: start_mel_token), `codes` [B]."""
    row = index + 1 if mel_positions == "upstream" and index > 0 else index
    return (model.mel_embedding(codes) + model.mel_pos_embedding.emb.weight[row]).unsqueeze(1)


def generate_codes(model: UnifiedVoiceGPT, text_ids: torch.Tensor, text_lens: torch.Tensor, max_codes: int, *,
                   sampling: Sampling | None = None, generator: Generators | None = None,
                   repetition_penalty: float = 1.0, kv_cache: bool = True, mel_positions: str = "upstream",
                   **conditioning: torch.Tensor) -> GeneratedCodes:
    """Mel codes for each of B texts: greedy unless `sampling` is given, which needs `generator` (on the
    model's device): one, or a list of B, one per text. text_ids [B,T] (no start/stop), text_lens [B], and the
    model's conditioning inputs by name (model.CONDITIONING; IndexTTS2: condition [B,32,D], emo_vec [B,D]).
    `kv_cache=False` recomputes the whole sequence at every step (same codes; for comparisons). Greedy codes do
    not depend on the batch a sample is in, nor do sampled ones with a generator per text; with one generator
    the batch draws from it in turn."""
    _check(model, conditioning, text_ids, text_lens, max_codes, mel_positions)
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be positive (1.0: off; infer_v2 uses 10.0), "
                         f"got {repetition_penalty}")
    if sampling is not None and generator is None:
        raise ValueError("sampled generation needs a torch.Generator (generator=...): it never draws from the "
                         "global RNG, so that generating leaves training's random state alone")
    if sampling is not None and not isinstance(generator, torch.Generator) and len(generator) != len(text_ids):
        raise ValueError(f"generator: one torch.Generator, or one per text ({len(text_ids)}), got {len(generator)}")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _generate(model, conditioning, text_ids, text_lens, max_codes, sampling, generator,
                             repetition_penalty, kv_cache, mel_positions)
    finally:
        model.train(was_training)


def _generate(model: UnifiedVoiceGPT, conditioning: dict[str, torch.Tensor], text_ids: torch.Tensor,
              text_lens: torch.Tensor, max_codes: int, sampling: Sampling | None, generator: Generators | None,
              penalty: float, kv_cache: bool, mel_positions: str) -> GeneratedCodes:
    cfg = model.cfg
    x, pad = _prompts(model, text_ids, text_lens, **conditioning)
    b, device = x.shape[0], x.device
    seen = first_seen(b, cfg.number_mel_codes, cfg.start_mel_token, device) if penalty != 1.0 else None
    cache = KVCache.empty(model, pad, x.shape[1] + max_codes, x.dtype) if kv_cache else None
    steps: list[torch.Tensor] = []
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    chunk = x
    for index in range(max_codes):
        if cache is not None:
            logits = last_logits(model, chunk, cache)
        else:  # the whole sequence again, through a cache that lives for this step only
            logits = last_logits(model, x, KVCache.empty(model, pad, x.shape[1], x.dtype))
        code = choose(logits, seen, penalty, sampling, generator)
        code = torch.where(finished, torch.full_like(code, cfg.stop_mel_token), code)  # as HF pads finished rows
        steps.append(code)
        finished |= code == cfg.stop_mel_token
        if seen is not None:
            seen[torch.arange(b, device=device), code] = True
        if bool(finished.all()) or index + 1 == max_codes:
            break
        chunk = _mel_input(model, code, index + 1, mel_positions)
        if cache is None:
            x = torch.cat([x, chunk], dim=1)
    return _per_sample(torch.stack(steps, dim=1).cpu(), cfg.stop_mel_token)


def _per_sample(tokens: torch.Tensor, stop: int) -> GeneratedCodes:
    codes, stopped = [], []
    for row in tokens:
        ends = (row == stop).nonzero()
        n = int(ends[0]) if len(ends) else row.shape[0]
        codes.append(row[:n].clone())
        stopped.append(bool(len(ends)))
    return GeneratedCodes(codes, stopped)
