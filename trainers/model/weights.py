"""IndexTTS2 state dicts: loading the base gpt.pth, resizing the text vocabulary, and the
trained model with its carried tensors as one checkpoint section.

The official state dict holds three groups of keys: the training path's tensors (group A,
the trainer's model), conditioning-encoder tensors inference needs but training does not
use (group B, carried through unchanged), and keys upstream drops on load. Which prefix is in
which group is a model family's (`StateLayout`, trainers/families); the functions here take
the layout and default to IndexTTS2's (2.0).

The text embedding and text head have Nt+1 rows: ids 0..Nt-1 are tokens and row Nt is an
extra row no token id reaches. With a larger tokenizer (N > Nt pieces) ids 0..Nt-1 keep their
base rows, ids Nt..N-1 are new, and the extra row moves to row N, so the layout stays the
one upstream inference expects for number_text_tokens = N.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from trainers.errors import UserError
from trainers.model.gpt_model import UnifiedVoiceGPT
from trainers.torch_files import CheckpointError, load_checkpoint

log = logging.getLogger(__name__)

TEXT_ROW_KEYS = ("text_embedding.weight", "text_head.weight", "text_head.bias")
MODEL_NAMESPACES = ("gpt.", "text_", "mel_", "speed_emb.", "final_norm.")
# Group B: not used by the training forward, loaded strictly by inference.
CARRIED_PREFIXES = (
    "emovec_layer.",
    "emo_layer.",
    "conditioning_encoder.",
    "perceiver_encoder.",
    "emo_conditioning_encoder.",
    "emo_perceiver_encoder.",
)
DROPPED_PREFIXES = ("inference_model.", "gpt.wte.")

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StateLayout:
    """A model family's upstream state dict: which keys its model trains (group A, under these namespaces),
    which it carries unchanged for inference (group B) and which upstream drops on load."""

    model_namespaces: tuple[str, ...]
    carried_prefixes: tuple[str, ...]
    dropped_prefixes: tuple[str, ...]
    text_row_keys: tuple[str, ...] = TEXT_ROW_KEYS


INDEXTTS2_LAYOUT = StateLayout(MODEL_NAMESPACES, CARRIED_PREFIXES, DROPPED_PREFIXES)


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    for name, t in named:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def strip_module_prefix(state: Mapping[str, torch.Tensor]) -> tuple[StateDict, bool]:
    """DDP saves every key as "module.<name>"; only a prefix on every key is treated as one."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}, True
    return dict(state), False


def split_state_dict(state: Mapping[str, torch.Tensor], layout: StateLayout = INDEXTTS2_LAYOUT,
                     ) -> tuple[StateDict, StateDict, list[str]]:
    """Split an official-format state dict into (group-A candidates, carried group-B keys, dropped keys).

    Accepts DDP-style "module." prefixes. The caller decides what to do with candidates the
    model does not have.
    """
    state, _ = strip_module_prefix(state)
    trained, carried, dropped = {}, {}, []
    for key, value in state.items():
        if key.startswith(layout.dropped_prefixes) or key.endswith((".attn.bias", ".attn.masked_bias")):
            dropped.append(key)
        elif key.startswith(layout.carried_prefixes):
            carried[key] = value
        else:
            trained[key] = value
    return trained, carried, dropped


def state_dict_of(obj: object) -> StateDict | None:
    """The state dict inside a loaded file: {"model": sd, ...} or a raw sd; None if it holds none."""
    state = obj.get("model", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return None
    return state


def read_state_dict(path: Path, flag: str = "--base-checkpoint") -> StateDict:
    """The state dict of an official-format file: {"model": sd, ...} or a raw sd."""
    try:
        obj = load_checkpoint(path)
    except CheckpointError as exc:
        raise UserError(f"{flag} {path}: {exc.reason}") from None
    state = state_dict_of(obj)
    if state is None:
        raise UserError(f"{flag} {path}: not a state dict (expected tensors, or a dict with a 'model' state dict)")
    return state


# No trained IndexTTS2 tensor comes near this; a value beyond it (e.g. 1e38) makes every loss overflow.
MAX_ABS_WEIGHT = 1e4


def refuse_bad_values(state: Mapping[str, torch.Tensor], path: Path, flag: str = "--base-checkpoint") -> None:
    """Non-finite or absurdly large floating-point values, named by tensor, before any training uses them."""
    for name, t in state.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise UserError(f"{flag} {path}: tensor {name} holds {bad} NaN/inf value(s); the file is damaged or "
                            "comes from a diverged run: use an intact checkpoint")
        largest = float(t.abs().max())
        if largest > MAX_ABS_WEIGHT:
            raise UserError(f"{flag} {path}: tensor {name} holds a value of magnitude {largest:.3g}, far beyond any "
                            f"trained weight (|x| <= {MAX_ABS_WEIGHT:g}); the file is damaged: use an intact checkpoint")


def text_tokens_of(state: Mapping[str, torch.Tensor], path: Path) -> int:
    """Nt of a state dict: its text_embedding rows minus the extra row."""
    trained, _, _ = split_state_dict(state)
    if "text_embedding.weight" not in trained:
        raise UserError(f"--base-checkpoint {path}: no text_embedding.weight; is this an IndexTTS2 gpt.pth?")
    return int(trained["text_embedding.weight"].shape[0]) - 1


@dataclass
class BaseWeights:
    carried: StateDict                 # group B and unknown keys, written back unchanged
    base_text_tokens: int              # Nt of the base checkpoint (text_embedding rows - 1)
    dropped: list[str] = field(default_factory=list)
    new_text_rows: int = 0


def check_base_fits(path: Path, state: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor],
                    report_unknown: bool = True, layout: StateLayout = INDEXTTS2_LAYOUT,
                    ) -> tuple[StateDict, StateDict, list[str], int]:
    """Split `state` by `layout` and check that it fits a model whose state dict is `own` (shapes only: a model
    on the meta device will do). Returns (trained, carried, dropped, base text tokens); UserError if not."""
    trained, carried, dropped = split_state_dict(state, layout)
    # Keys in the model's own namespaces that it lacks (e.g. extra layers) mean the config does
    # not match; anything else is unknown to us and is carried through rather than lost.
    unexpected = sorted(k for k in set(trained) - set(own) if k.startswith(layout.model_namespaces))
    for key in sorted(set(trained) - set(own) - set(unexpected)):
        if report_unknown:
            log.warning("base checkpoint key %s is not part of the trained model; it is carried into saved "
                        "checkpoints unchanged", key)
        carried[key] = trained.pop(key)
    not_float = [f"  {k}: {str(trained[k].dtype).removeprefix('torch.')}" for k in sorted(set(trained) & set(own))
                 if own[k].is_floating_point() and not trained[k].is_floating_point()]
    if not_float:
        raise UserError("\n".join([f"--base-checkpoint {path} holds non-floating-point tensors where the model has "
                                    "weights:", *not_float, "these must be float32, float16 or bfloat16; pass the "
                                    "original IndexTTS2 gpt.pth (not a quantized or converted copy)"]))
    base_tokens = text_tokens_of(trained, path)
    new_tokens = own["text_embedding.weight"].shape[0] - 1
    if new_tokens < base_tokens:
        raise UserError(
            f"the tokenizer has {new_tokens} pieces but --base-checkpoint {path} has {base_tokens} text tokens; "
            "use the tokenizer the checkpoint was trained with, or an extension of it"
        )
    misfits = _misfits(trained, own, layout.text_row_keys)
    if misfits or unexpected:
        lines = [f"--base-checkpoint {path} does not fit the model built from --config:", *misfits]
        lines += [f"  not in the model: {k}" for k in unexpected]
        lines.append("check that --config matches the checkpoint (model_dim, layers, heads, max_*_tokens, "
                     "number_mel_codes)")
        raise UserError("\n".join(lines))
    return trained, carried, dropped, base_tokens


def load_base_weights(path: Path, model: nn.Module, state: Mapping[str, torch.Tensor] | None = None,
                      layout: StateLayout = INDEXTTS2_LAYOUT) -> BaseWeights:
    """Load `path` (or its already read `state`) into `model`, extending the text rows if needed."""
    own = model.state_dict()
    trained, carried, dropped, base_tokens = check_base_fits(path, read_state_dict(path) if state is None else state,
                                                             own, layout=layout)
    new_tokens = own["text_embedding.weight"].shape[0] - 1
    for key in layout.text_row_keys:
        trained[key] = resize_text_rows(trained[key], new_tokens)
    model.load_state_dict(trained, strict=True)
    if new_tokens > base_tokens:
        log.info("text vocabulary extended from %d to %d tokens: new rows start at the mean of the base rows",
                 base_tokens, new_tokens)
    return BaseWeights(carried=carried, base_text_tokens=base_tokens, dropped=dropped,
                       new_text_rows=new_tokens - base_tokens)


def _misfits(trained: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor],
             text_rows: tuple[str, ...] = ()) -> list[str]:
    """Lines naming the model's tensors a state dict lacks, then those of another shape. The `text_rows`
    tensors may differ in number of rows (a vocabulary extension), never in width."""
    lines = [f"  missing: {k}" for k in sorted(set(own) - set(trained))]
    for k in sorted(set(trained) & set(own)):
        ckpt, model = trained[k].shape, own[k].shape
        if (ckpt[1:] != model[1:]) if k in text_rows else (ckpt != model):
            lines.append(f"  {k}: checkpoint {tuple(ckpt)}, model {tuple(model)}")
    return lines


def resize_text_rows(base: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Rows for `new_tokens` tokens + the extra row, from a tensor with base_tokens + 1 rows."""
    base_tokens = base.shape[0] - 1
    if new_tokens == base_tokens:
        return base
    # New ids start at the mean of the base token rows: a neutral point that keeps the first
    # logits of a new token ordinary, instead of random rows that can dominate the softmax.
    mean = base[:base_tokens].float().mean(dim=0, keepdim=True).to(base.dtype)
    new_rows = mean.expand(new_tokens - base_tokens, *base.shape[1:])
    return torch.cat([base[:base_tokens], new_rows, base[base_tokens:]], dim=0).clone()


@dataclass
class GPTWeights:
    """The trained model plus the tensors carried for inference: the "model" section of a checkpoint,
    in exactly the layout upstream IndexTTS2 loads."""

    model: UnifiedVoiceGPT
    carried: StateDict
    # A LoRA run's trained tensors (adapters, extended text rows): its checkpoints hold these alone, the base
    # being named by path and sha256 in the run section. None: full fine-tuning, the whole model is saved.
    trained_keys: tuple[str, ...] | None = None
    layout: StateLayout = INDEXTTS2_LAYOUT  # the model family's (trainers/families)

    def saved_tensors(self) -> StateDict:
        """The tensors of the model section where they live (state_dict() copies them to the CPU)."""
        own = self.model.state_dict()
        if self.trained_keys is not None:
            return {k: own[k] for k in self.trained_keys}
        return {**own, **self.carried}

    def state_dict(self) -> StateDict:
        return {k: v.detach().cpu() for k, v in self.saved_tensors().items()}

    def non_finite(self) -> str | None:
        """The first trained parameter holding a NaN or inf (carried tensors were checked on load)."""
        return first_non_finite(self.model.named_parameters())

    def fit_problems(self, state: Mapping[str, torch.Tensor], source: Path | str) -> UserError | None:
        """Why a saved model section cannot be loaded into this model (None: it can)."""
        trained, _, _ = split_state_dict(state, self.layout)
        own = self.model.state_dict()
        if self.trained_keys is not None:
            own = {k: own[k] for k in self.trained_keys}
            if set(trained) - set(own):
                return UserError(f"{source} holds {len(set(trained) - set(own))} tensors this LoRA run does not train "
                                 f"(e.g. {sorted(set(trained) - set(own))[0]}): it is not a checkpoint of a LoRA run "
                                 "with these --lora-targets; resume with the LoRA settings it was trained with")
        problems = _misfits(trained, own)
        if not problems:
            return None
        return UserError("\n".join([f"{source} does not fit the model of this run:", *problems,
                                    "resume with the --config and --tokenizer the run was started with"]))

    def load_state_dict(self, state: Mapping[str, torch.Tensor], source: Path | str = "the checkpoint") -> None:
        refusal = self.fit_problems(state, source)
        if refusal is not None:
            raise refusal
        trained, carried, _ = split_state_dict(state, self.layout)
        if self.trained_keys is not None:  # the base was loaded from its file: only the trained tensors come back
            self.model.load_state_dict({k: trained[k] for k in self.trained_keys}, strict=False)
            return
        own = self.model.state_dict()
        self.model.load_state_dict({k: trained[k] for k in own}, strict=True)
        self.carried = {**carried, **{k: trained[k] for k in set(trained) - set(own)}}
