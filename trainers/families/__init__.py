"""The model families the trainer knows, and which one a run trains.

A family (trainers/families/family.py ModelFamily) owns what differs between the GPTs: config, model,
conditioning prefix, batch fields and manifest lines, upstream state dict, tokenizer, demo. Adding one
is a folder here defining its FAMILY and one line in FAMILIES below (docs/architecture.md, "Model
families"). A run's family is saved in its checkpoints (schema: run.model_family; a checkpoint without
it, as every 2.0 one, is the first family's).
"""
from __future__ import annotations

from typing import Any, Collection, Mapping

from trainers.checkpoint.schema import FIRST_FAMILY
from trainers.errors import UserError
from trainers.families import indextts2, indextts25
from trainers.families.family import ModelFamily

# The registry, one line per family; the first takes every config no other claims.
FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (
    indextts2.FAMILY,
    indextts25.FAMILY,
)}
assert next(iter(FAMILIES)) == FIRST_FAMILY, "the first family is the one of checkpoints that name none"


def family_named(name: str, where: str = "the checkpoint") -> ModelFamily:
    """The family `name` (as a checkpoint records it); UserError for one this trainer does not know."""
    family = FAMILIES.get(name)
    if family is None:
        raise UserError(f"{where} holds a {name!r} model, which this version of the trainer does not know (it knows "
                        f"{', '.join(FAMILIES)}); update the trainer")
    return family


def family_for_config(model_yaml: Mapping[str, Any]) -> ModelFamily:
    """The family a config.yaml belongs to: the first later family that claims it, else the first."""
    first, *others = FAMILIES.values()
    return next((family for family in others if family.claims(model_yaml)), first)


def family_for_state(keys: Collection[str]) -> ModelFamily:
    """The family a state dict with these keys belongs to (a gpt.pth records none): the first later family whose
    signature (`ModelFamily.state_signature`) it holds, else the first, as `family_for_config` decides for configs."""
    first, *others = FAMILIES.values()
    return next((family for family in others if family.holds_state(keys)), first)
