"""Do the features fit the model config? Checked on the first samples, before anything is built or written.

Features extracted for another model size (the official model's 1280-wide conditioning latents
trained with a smaller --config, or the other way round) fail on every sample. Found when the
first batch is loaded, that costs the model build and leaves run_config.json and logs/ behind,
with advice about one sample. Here the .npy headers of the first FIRST_SAMPLES samples of each
manifest flag are read (a few small reads); when every one of them has the same width and it is
not gpt.model_dim, the start is refused (exit 2) naming --config and the configs of that width.
Anything else (a single odd sample, an unreadable file) is left to the per-sample checks of
trainers.data.features, which name the sample's manifest:line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import yaml

from trainers.data.features import FeatureSpec
from trainers.data.sample_table import SampleTable
from trainers.errors import UserError
from trainers.model.gpt_model import OFFICIAL_MODEL_DIM

FIRST_SAMPLES = 4
CONFIG_DIR = Path(__file__).resolve().parents[2] / "checkpoints"


def _width(path: str, leading: tuple[int, ...]) -> int | None:
    """The last axis of the array in `path` if its shape is leading + (width,) (one batch axis allowed)."""
    try:
        shape = np.load(path, mmap_mode="r", allow_pickle=False).shape  # reads the header, maps the rest
    except Exception:  # noqa: BLE001 - any unreadable file is the per-sample check's to report
        return None
    if len(shape) == len(leading) + 2 and shape[0] == 1:
        shape = shape[1:]
    return shape[-1] if len(shape) == len(leading) + 1 and tuple(shape[:-1]) == leading else None


def _configs_of_width(width: int) -> list[str]:
    found = []
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        try:
            gpt = yaml.safe_load(path.read_text(encoding="utf-8")).get("gpt", {})
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if isinstance(gpt, dict) and gpt.get("model_dim") == width:
            found.append(str(path.relative_to(CONFIG_DIR.parent)))
    return found


def check_features_fit(tables: Sequence[SampleTable], spec: FeatureSpec, config: str) -> None:
    """Refuse (UserError) when the first samples' conditioning features all have a width other than gpt.model_dim."""
    seen = []  # (source, what, path, width) of each readable feature
    for table in tables:
        for sample in table[:FIRST_SAMPLES]:
            for what, path, leading in spec.model_dim_files(sample):
                width = _width(path, leading)
                if width is not None:
                    seen.append((sample.source, what, path, width))
    widths = {width for *_, width in seen}
    if len(widths) != 1 or spec.model_dim in widths:
        return
    width = widths.pop()
    fits = _configs_of_width(width)
    official = " (the official IndexTTS2 model)" if width == OFFICIAL_MODEL_DIM else ""
    where = (f"width {width} is gpt.model_dim of {' and '.join(fits)}{official}: pass --config {fits[0]}"
             if fits else f"no config in {CONFIG_DIR} has gpt.model_dim {width}{official}: pass the --config of the "
                          f"model the features were extracted for (its gpt.model_dim is {width})")
    source, what, path, _ = seen[0]
    raise UserError(f"--config {config}: the features were extracted for another model size. Its gpt.model_dim is "
                    f"{spec.model_dim}, but the conditioning features of the first {len({s[0] for s in seen})} "
                    f"samples are {width} wide (e.g. {source}: {what} file {path}). Every sample would fail, so the "
                    f"data is not at fault: {where}; nothing was written")
