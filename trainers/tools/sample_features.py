"""The inputs of generated samples, found by sample id in manifests: text ids, conditioning, emotion vector.

A sample set (trainers/run/sample_sets.py) keeps the codes and ids only; the rest is in the validation
manifest the samples were chosen from. The manifests are the ones given (--manifest), else the run's
own --val-manifest files as its newest checkpoint (or run_config.json) records them. They are read
and checked as the trainer reads them (trainers.data.manifest, trainers.data.features), and every
problem is a UserError naming the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from trainers.data.features import FeatureDataset, FeatureError, FeatureSpec
from trainers.data.manifest import DataLimits, ManifestError, load_manifests, parse_manifest_spec
from trainers.errors import UserError
from trainers.model.gpt_model import GPTConfig
from trainers.tools.pack_run import read_run


@dataclass(frozen=True)
class SampleInputs:
    """What the GPT's forward over a sample's codes takes besides the codes."""

    text_ids: np.ndarray  # [L] int64, without start/stop tokens
    condition: np.ndarray  # [32, model_dim] float32
    emo_vec: np.ndarray  # [model_dim] float32


def manifest_specs(run_dir: Path, given: Sequence[str] | None) -> list[str]:
    """The manifests to search: `given`, else the run's recorded --val-manifest files."""
    if given:
        return list(given)
    try:
        recorded = list(read_run(run_dir).settings.get("val_manifests") or [])
    except UserError as exc:
        raise UserError(f"{exc}; pass the validation manifest with --manifest") from None
    if not recorded:
        raise UserError(f"{run_dir} records no --val-manifest; pass the manifest holding the samples with --manifest")
    missing = [s for s in recorded if not Path(parse_manifest_spec(s).path).is_file()]
    if missing:
        raise UserError(f"the run's validation manifest {missing[0]} is not there (moved, or relative to another "
                        "folder); pass it with --manifest")
    return recorded


def sample_inputs(run_dir: Path, given: Sequence[str] | None, gpt_section: Mapping[str, Any],
                  ids: Sequence[str]) -> dict[str, SampleInputs]:
    """The inputs of each id in `ids`, checked against the model of `gpt_section`; UserError for any problem."""
    specs = manifest_specs(run_dir, given)
    try:
        gpt = GPTConfig.from_yaml_section(gpt_section)
    except ValueError as exc:
        raise UserError(f"--model-dir's config.yaml has a bad gpt section:\n{exc}") from None
    try:
        table = load_manifests([parse_manifest_spec(s) for s in specs], DataLimits(gpt.max_text_tokens,
                               gpt.max_mel_tokens), flag="--manifest")
    except ManifestError as exc:
        raise UserError(f"the manifests have problems:\n{exc}") from None
    rows: dict[str, int] = {}
    for row, sample_id in enumerate(table.ids.strings()):
        rows.setdefault(sample_id, row)
    absent = [i for i in ids if i not in rows]
    if absent:
        raise UserError(f"{len(absent)} sample(s) of the set are in no manifest of {', '.join(specs)} (first: "
                        f"{absent[0]!r}); pass the validation manifest the run generated them from with --manifest")
    data = FeatureDataset(table, FeatureSpec(gpt.model_dim, gpt.number_text_tokens, gpt.start_mel_token))
    found = {}
    for sample_id in ids:
        try:
            item = data[rows[sample_id]]
        except FeatureError as exc:
            raise UserError(str(exc)) from None
        found[sample_id] = SampleInputs(item["text_ids"].numpy(), item["condition"].numpy(), item["emo_vec"].numpy())
    return found
