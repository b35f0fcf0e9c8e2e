"""Upstream's UnifiedVoice, built and run the way the parity tests compare it with ours (tests/upstream_models.py
fetches the code).

2.0 (conformer mode): `conformer_model` builds upstream's class on our weights; the conditioning encoders are
built small and never run, since the trainer works from precomputed latents and so hands upstream the same
latents (`forward(..., do_spk_cond=False)`, and `get_conditioning` replaced for generation). `forward_logits`
runs upstream's own forward() and keeps the logits its get_logits computes on the way (forward itself
returns latents), with the targets it builds.

2.5 (campplus mode): no wheel carries upstream v2.5.0's model_v2.py itself (docs/architecture.md, "Parity with
upstream"). `Campplus` holds a campplus state dict in two upstream-derived models:
- `strict`: indextts25-inference's campplus UnifiedVoice with a `text_head` added (the one module of upstream's
  campplus key set that the rewrite dropped): `load_strict_campplus` is the strict check the 2.5 export needs;
- `uv`: upstream v2.0.0's own UnifiedVoice (conformer build) on the shared weights, with the three campplus
  differences of v2.5.0 supplied: the speaker latent is `spk_emb_proj(campplus)` (one position), the two
  speed slots are zero (speed_emb zeroed), and `lang_embedding[lang]` is added to every text position (a hook
  on text_embedding). Upstream's own forward(), prepare_gpt_inputs and inference_speech then run unchanged:
  `campplus_reference` (teacher-forced logits, targets and loss sums) and `campplus_generate` (greedy codes).
tests/test_upstream_parity.py checks that this equals indextts25-inference's own campplus prepare_gpt_inputs
path on the same weights, so the supplied pieces are a published campplus implementation's, not ours alone.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from tests.upstream_models import UPSTREAM_V2, UPSTREAM_V25, import_module

# Small conformer/perceiver sizes: the encoders are built (the constructor needs them) but never run.
ENCODER = {"output_size": 16, "linear_units": 32, "attention_heads": 2, "num_blocks": 1, "input_layer": "conv2d2",
           "perceiver_mult": 2}
# Keys only the conformer build has, and only the campplus build has (upstream v2.5.0 model_v2.py, __init__).
CONFORMER_ONLY = ("conditioning_encoder.", "perceiver_encoder.", "speed_emb.")
CAMPPLUS_ONLY = ("spk_emb_proj.weight", "spk_emb_proj.bias", "lang_embedding.weight")
CAMPPLUS_DIM = 192  # CAMPPlus speaker vector, spk_emb_proj's input
CAMPPLUS_PREFIX = 3  # [speaker + emotion][0][0]


def v2() -> Any:
    """upstream v2.0.0's indextts.gpt.model_v2 (skips or fails the test where the wheel cannot be had)."""
    return import_module(UPSTREAM_V2, "gpt.model_v2")


def v25() -> Any:
    """indextts25-inference's indextts25.gpt.model_v2 (campplus only; see the module docstring)."""
    return import_module(UPSTREAM_V25, "gpt.model_v2")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Upstream passes `gradient_checkpointing` to GPT2Config, which transformers 4.52 warns about each time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Passing `gradient_checkpointing`", category=UserWarning)
        yield


def gpt_section(cfg: Any) -> dict[str, Any]:
    """An upstream `gpt:` section of our GPTConfig's sizes, with the small encoders."""
    keys = ("layers", "model_dim", "heads", "max_text_tokens", "max_mel_tokens", "number_text_tokens",
            "number_mel_codes", "start_text_token", "stop_text_token", "start_mel_token", "stop_mel_token")
    return {**{k: getattr(cfg, k) for k in keys}, "condition_type": "conformer_perceiver",
            "condition_module": ENCODER, "emo_condition_module": ENCODER}


def load_shared(uv: torch.nn.Module, state: dict[str, torch.Tensor], may_lack: tuple[str, ...]) -> None:
    """Non-strict load that may leave out only keys starting with `may_lack`; anything unexpected fails."""
    result = uv.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(k.startswith(may_lack) for k in result.missing_keys), result.missing_keys


def conformer_model(ours: torch.nn.Module) -> torch.nn.Module:
    """upstream's UnifiedVoice (2.0, conformer mode) on `ours`'s weights, in eval, with infer_v2's KV cache."""
    with quiet():
        uv = v2().UnifiedVoice(**gpt_section(ours.cfg))
        # What ours lacks: the conditioning encoders (group B; ours works from their output).
        load_shared(uv, ours.state_dict(), ("conditioning_encoder.", "perceiver_encoder.", "emo_", "emovec_layer."))
        uv.post_init_gpt2_config(kv_cache=True)  # after the load: it adds inference_model.* and gpt.wte keys
    return uv.eval()


def valid_targets(targets: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The reference's masking (indextts2-gpt.md, step 7): target j counts while j < len + 1."""
    j = torch.arange(targets.shape[1]).unsqueeze(0)
    return torch.where(j < lens.unsqueeze(1) + 1, targets, torch.full_like(targets, -100))


def forward_logits(uv: torch.nn.Module, latent: torch.Tensor, emo_vec: torch.Tensor, text_ids: torch.Tensor,
                   text_lens: torch.Tensor, codes: torch.Tensor, code_lens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Upstream's forward() on a batch whose speaker conditioning is already `latent` ([B, n, D]: the perceiver's
    32 latents in 2.0, the projected CAMPPlus vector in 2.5). Returns text_logits [B, T+2, Nt+1], mel_logits
    [B, M+2, Nm] (from its get_logits, asked for logits beside the latents forward returns) and the text/mel
    targets it builds, masked to -100 past each length as the reference's loss does."""
    seen: dict[str, Any] = {"targets": []}
    get_logits, aligned = uv.get_logits, uv.build_aligned_inputs_and_targets

    def recording_get_logits(conds, first, first_head, second=None, second_head=None, get_attns=False,
                             return_latent=False):
        seen["logits"] = get_logits(conds, first, first_head, second, second_head)
        return get_logits(conds, first, first_head, second, second_head, get_attns, return_latent)

    def recording_aligned(inputs, start, stop):
        result = aligned(inputs, start, stop)
        seen["targets"].append(result[1])
        return result

    uv.get_logits, uv.build_aligned_inputs_and_targets = recording_get_logits, recording_aligned
    try:
        with torch.no_grad():  # forward pads the id tensors in place: clones
            uv(latent, text_ids.clone(), text_lens, codes.clone(), code_lens, None, emo_vec=emo_vec,
               use_speed=torch.zeros(len(text_lens), dtype=torch.long))
    finally:
        del uv.get_logits, uv.build_aligned_inputs_and_targets
    text_logits, mel_logits = (x.permute(0, 2, 1) for x in seen["logits"])
    text_targets, mel_targets = seen["targets"]
    return {"text_logits": text_logits, "mel_logits": mel_logits,
            "text_targets": valid_targets(text_targets, text_lens), "mel_targets": valid_targets(mel_targets, code_lens)}


def loss_sums(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Summed cross-entropies over the valid targets (the keys of UnifiedVoiceGPT.loss_sums)."""
    text, mel = out["text_targets"], out["mel_targets"]
    mel_logits = out["mel_logits"][mel >= 0]
    return {
        "text_ce": F.cross_entropy(out["text_logits"][text >= 0], text[text >= 0], reduction="sum"),
        "mel_ce": F.cross_entropy(mel_logits, mel[mel >= 0], reduction="sum"),
        "text_tokens": (text >= 0).sum(),
        "mel_tokens": (mel >= 0).sum(),
        "mel_correct": (mel_logits.argmax(-1) == mel[mel >= 0]).sum(),
    }


def generated_tokens(uv: torch.nn.Module, latent: torch.Tensor, emo_vec: torch.Tensor, text_ids: torch.Tensor,
                     max_codes: int, **kwargs: Any) -> list[list[int]]:
    """Greedy codes of upstream's inference_speech (infer_v2's way: its own prefix and left-padded batch), each
    up to and including the first stop (HF pads finished rows with it). `latent` stands in for what
    get_conditioning would compute from audio features."""
    uv.get_conditioning = lambda *_args, **_kw: latent
    b = text_ids.shape[0]
    try:
        with torch.no_grad():
            out, _ = uv.inference_speech(torch.zeros(b, 1024, 8), text_ids, emo_vec=emo_vec, do_sample=False,
                                         num_beams=1, max_generate_length=max_codes, **kwargs)
    finally:
        del uv.get_conditioning
    stop = uv.stop_mel_token
    return [row[:row.index(stop) + 1] if stop in row else row for row in out.tolist()]


# ------------------------------------------------------------------------------------------------ 2.5 (campplus)

def campplus_keys(gpt: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Upstream v2.5.0's campplus key set with shapes, derived from upstream v2.0.0's conformer build: the same
    constructor less conditioning_encoder, perceiver_encoder and speed_emb, plus spk_emb_proj [D, 192] and
    lang_embedding [len(LANGUAGE_DICT) + 1, D]."""
    with torch.device("meta"), quiet():
        conformer = v2().UnifiedVoice(**{**gpt, "condition_type": "conformer_perceiver", "condition_module": ENCODER})
    keys = {k: tuple(v.shape) for k, v in conformer.state_dict().items() if not k.startswith(CONFORMER_ONLY)}
    d = gpt["model_dim"]
    keys.update({"spk_emb_proj.weight": (d, CAMPPLUS_DIM), "spk_emb_proj.bias": (d,),
                 "lang_embedding.weight": (len(v25().LANGUAGE_DICT) + 1, d)})
    return keys


def campplus_model(gpt: dict[str, Any]) -> torch.nn.Module:
    """The strict-load target: indextts25-inference's campplus UnifiedVoice plus upstream's text_head, so its
    key set is upstream v2.5.0's campplus one (tests/test_upstream_parity.py checks it against `campplus_keys`)."""
    uv = v25().UnifiedVoice(**gpt)
    uv.text_head = torch.nn.Linear(gpt["model_dim"], gpt["number_text_tokens"] + 1)
    return uv


def load_strict_campplus(state: dict[str, torch.Tensor], gpt: dict[str, Any]) -> torch.nn.Module:
    """`state` loaded with strict=True into the campplus UnifiedVoice of `gpt`'s sizes: a missing, extra or
    misshapen key raises (upstream's own load is non-strict, so there a missing key would stay random)."""
    uv = campplus_model(gpt)
    uv.load_state_dict(state, strict=True)
    return uv.eval()


@dataclass
class Campplus:
    """A campplus state dict in upstream's code; see the module docstring."""

    strict: torch.nn.Module  # the strict-load target, loaded
    uv: torch.nn.Module  # upstream v2.0.0's UnifiedVoice on the shared weights, campplus pieces supplied
    lang_rows: list[torch.Tensor]  # what the text_embedding hook adds: [B, D] (forward) or [D] (generation)

    def speaker_latent(self, spk_emb: torch.Tensor) -> torch.Tensor:
        """spk_emb_proj of the CAMPPlus vectors [B, 192] as one prefix position [B, 1, D]."""
        return self.strict.spk_emb_proj(spk_emb).unsqueeze(1)

    def language(self, lang_ids: torch.Tensor) -> torch.Tensor:
        return self.strict.lang_embedding(lang_ids)


def campplus_upstream(state: dict[str, torch.Tensor], gpt: dict[str, Any]) -> Campplus:
    """`state` (a campplus state dict, e.g. a 2.5 export) checked strictly and set up in upstream's code."""
    strict = load_strict_campplus(state, gpt)
    with quiet():
        uv = v2().UnifiedVoice(**{**gpt, "condition_type": "conformer_perceiver", "condition_module": ENCODER})
        load_shared(uv, {k: v for k, v in state.items() if k not in CAMPPLUS_ONLY}, CONFORMER_ONLY)
        uv.post_init_gpt2_config(kv_cache=True)
    with torch.no_grad():
        uv.speed_emb.weight.zero_()  # campplus: the two slots after the speaker are zero vectors
    lang_rows: list[torch.Tensor] = []

    def add_language(_module, _inputs, out):  # every text position, start and stop included (not padding)
        rows = lang_rows[-1]
        return out + (rows.unsqueeze(1) if out.dim() == 3 else rows)

    uv.text_embedding.register_forward_hook(add_language)
    return Campplus(strict, uv.eval(), lang_rows)


def without_start_stop(text_ids: torch.Tensor, text_lens: torch.Tensor, start: int,
                       stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's text with every id `start` or `stop` dropped, as prepare_gpt_inputs drops them (right-padded
    with `stop` again)."""
    rows = [t[:n][(t[:n] != start) & (t[:n] != stop)] for t, n in zip(text_ids, text_lens.tolist())]
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), stop, dtype=text_ids.dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, torch.tensor([len(r) for r in rows])


def campplus_reference(state: dict[str, torch.Tensor], gpt: dict[str, Any], batch: dict[str, torch.Tensor],
                       model: Campplus | None = None) -> dict[str, torch.Tensor]:
    """Upstream's teacher-forced pass in campplus mode with the language embedding as inference adds it, for
    phase 2's parity test: logits, masked targets and the loss sums of `batch`.

    batch: spk_emb [B, 192] (raw CAMPPlus), emo_vec [B, D], text_ids [B, T] (no start/stop; ids 0 and 1 are
    dropped here as prepare_gpt_inputs drops them), text_lens [B], lang_ids [B] (LANGUAGE_DICT indices),
    codes [B, M], code_lens [B]. Prefix [spk_emb_proj + emo][0][0]; every text position, start, stop and the
    right padding with stop ids included, gets lang_embedding[lang]; upstream's forward() layout otherwise
    (no padding mask, mel positions from 0). Returns text_logits [B, T'+2, Nt+1] (T': after the drop),
    mel_logits [B, M+2, Nm], text_targets, mel_targets (-100 where masked), text_lens (after the drop) and the
    loss sums (text_ce, mel_ce, text_tokens, mel_tokens, mel_correct)."""
    c = model or campplus_upstream(state, gpt)
    text_ids, text_lens = without_start_stop(batch["text_ids"], batch["text_lens"], c.uv.start_text_token,
                                             c.uv.stop_text_token)
    with torch.no_grad():
        latent, rows = c.speaker_latent(batch["spk_emb"]), c.language(batch["lang_ids"])
    c.lang_rows.append(rows)
    try:
        out = forward_logits(c.uv, latent, batch["emo_vec"], text_ids, text_lens, batch["codes"], batch["code_lens"])
    finally:
        c.lang_rows.pop()
    return {**out, "text_lens": text_lens, **loss_sums(out)}


def campplus_generate(c: Campplus, spk_emb: torch.Tensor, emo_vec: torch.Tensor, text_ids: torch.Tensor,
                      lang_id: int, max_codes: int, **kwargs: Any) -> list[list[int]]:
    """Greedy codes of upstream's inference_speech in campplus mode (one language for the batch: the hook adds
    one row to each sample's text), each up to and including its first stop."""
    with torch.no_grad():
        latent, row = c.speaker_latent(spk_emb), c.language(torch.tensor(lang_id))
    c.lang_rows.append(row)
    try:
        return generated_tokens(c.uv, latent, emo_vec, text_ids, max_codes, **kwargs)
    finally:
        c.lang_rows.pop()
