"""Which model each input of a run belongs to, checked before anything is written.

A run's model family is its config's (`family_for_config`: a 2.5 config says `version: 2.5`). Each other input
is recognised on its own: a base checkpoint by the keys only one family's state dict holds
(`ModelFamily.state_signature`), a tokenizer by its file (`TokenizerAdapter.recognises`), a manifest by the
forms of its lines, its features by the FeatureSpec that reads its first samples. An input recognised as another
family's, and not as the run's, is refused (exit 2) naming the model each input belongs to, before the run
directory is touched (trainers/run/resolve.py and inputs.py call these in that order).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from trainers.data.features import FeatureError
from trainers.data.manifest import ManifestSpec
from trainers.data.manifest_lines import ManifestForms
from trainers.data.sample_table import SampleTable
from trainers.errors import UserError
from trainers.families import FAMILIES
from trainers.families.family import ModelFamily
from trainers.model.gpt_model import GPTConfig
from trainers.model.weights import strip_module_prefix

FIRST_SAMPLES = 4
NOTHING = "nothing was written"


def _others(family: ModelFamily) -> list[ModelFamily]:
    return [other for other in FAMILIES.values() if other is not family]


def _config(config: str, family: ModelFamily) -> str:
    return f"--config {config} is a config of {family.title}"


def refuse_other_tokenizer(family: ModelFamily, path: str | None, config: str) -> None:
    """A tokenizer file of another family's kind (a SentencePiece model for a 2.5 run, a .tiktoken for a 2.0 one)."""
    if not path or not Path(path).is_file() or family.tokenizer.recognises(path):
        return
    for other in _others(family):
        if type(other.tokenizer) is not type(family.tokenizer) and other.tokenizer.recognises(path):
            raise UserError(f"--tokenizer {path} is a {other.tokenizer.kind}, the tokenizer of {other.title}, but "
                            f"{_config(config, family)}, whose tokenizer is a {family.tokenizer.kind}: pass the "
                            f"tokenizer of {family.title}, or train {other.title} with its own config ({NOTHING})")


def _signature(family: ModelFamily) -> str:
    return ", ".join(family.state_signature)


def refuse_other_base(family: ModelFamily, state: Mapping[str, torch.Tensor], path: Path, config: str) -> None:
    """A base checkpoint whose keys are another family's (a 2.0 gpt.pth with a 2.5 config, or the reverse)."""
    keys = strip_module_prefix(state)[0]
    if family.holds_state(keys):
        return
    for other in _others(family):
        if other.holds_state(keys):
            rows = keys.get("text_embedding.weight")
            text = f", {rows.shape[0]} text rows" if isinstance(rows, torch.Tensor) else ""
            own = f" (whose gpt.pth holds {_signature(family)})" if family.state_signature else ""
            raise UserError(f"--base-checkpoint {path} is a gpt.pth of {other.title} (it holds {_signature(other)}"
                            f"{text}), but {_config(config, family)}{own}: pass the gpt.pth of {family.title}, or "
                            f"train {other.title} with its own config and tokenizer ({NOTHING})")


def _first_line(path: Path) -> dict[str, Any] | None:
    """The first JSON object of a manifest; None where there is none (the manifest check reports why)."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if raw.strip():
                    obj = json.loads(raw)
                    return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None
    return None


def _recognised(forms: ManifestForms, obj: dict[str, Any]) -> str | None:
    """The name of the form `obj` is a complete line of, in `forms`."""
    form = forms.detect(obj)
    return form.name if form is not None and all(k in obj for k in form.required) else None


def refuse_other_manifests(family: ModelFamily, specs: Sequence[ManifestSpec], flag: str, config: str) -> None:
    """A manifest written for another family (2.0 lines naming [32, D] conditioning latents in a 2.5 run, or the
    2.5 preprocessing's lines in a 2.0 run): told from its first line."""
    for spec in specs:
        obj = _first_line(spec.path)
        if obj is None or _recognised(family.manifest_forms, obj):
            continue
        for other in _others(family):
            form = _recognised(other.manifest_forms, obj)
            if form:
                raise UserError(f"{flag} {spec.path}: its lines are {form} lines, a manifest of {other.title}'s "
                                f"features, but {_config(config, family)}; {family.title}'s lines: "
                                f"{family.manifest_forms.hint}. Extract the features for {family.title}, or train "
                                f"{other.title} with its own config ({NOTHING})")


def refuse_other_features(family: ModelFamily, gpt: GPTConfig, tables: Sequence[SampleTable], config: str) -> None:
    """Feature files of another family behind lines of this family's form (e.g. a [32, D] conditioning latent where
    a 2.5 line names the prompt's CAMPPlus vector): the first samples that this family cannot read but another
    can. Anything else wrong with a sample is the per-sample check's to report."""
    spec = family.feature_spec(gpt)
    for table in tables:
        for i in range(min(FIRST_SAMPLES, len(table))):
            sample = table[i]
            try:
                spec.read(sample)
                continue
            except FeatureError as exc:
                problem = str(exc)
            for other in _others(family):
                try:
                    other.feature_spec(gpt).read(sample)
                except Exception:  # noqa: BLE001 - not that family's either
                    continue
                raise UserError(f"the features of {sample.source} are {other.title}'s, but {_config(config, family)}: "
                                f"{problem}. Extract the features for {family.title}, or train {other.title} with "
                                f"its own config ({NOTHING})")
            return
