"""Each model family's feature files and manifest lines, in the forms the trainer's readers take
(trainers/data/manifest_lines.py for IndexTTS2, trainers/families/indextts25/features.py for IndexTTS-2.5).

IndexTTS2 (2.0): four .npy files per utterance under features/ (NAME_text_ids int32 [L], NAME_codes int32 [T],
NAME_condition float32 [32, D], NAME_emo_vec float32 [D]); single-utterance lines (its own conditioning) and
paired lines (the prompt's condition and emo_vec, the target's text and codes), as the community preprocessing
writes them.
IndexTTS-2.5: one .npz per utterance (codes, text_ids, spk_emb [192], emo_vec [D]), utterance lines and pair
lines in the community 2.5 preprocessing's form (features / target_features and prompt_features, lang,
lang_alias, text_len, code_len).

Paths in the lines are relative to the manifest's folder (OUT).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from trainers.data.features import MAX_ABS_FEATURE
from trainers.errors import UserError
from trainers.tools.prepare.backend import Features
from trainers.tools.prepare.store import FEATURES_DIR, npy_bytes, npz_bytes

CONDITION_LATENTS = 32
SPEAKER_DIM = 192


@dataclass(frozen=True)
class Layout:
    """How one family's utterance becomes files and lines."""

    family: str
    shapes: Callable[[int], dict[str, tuple[int, ...]]]  # conditioning name -> shape, for gpt.model_dim
    files: Callable[[str, np.ndarray, Features], list[tuple[str, bytes]]]  # stem, text ids, features -> files
    roles: Callable[[str], dict[str, str]]  # stem -> role -> file name
    single: Callable[[dict[str, Any]], dict[str, Any]]  # record -> utterance line
    pair: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]  # (target, prompt) records -> pair line

    def check(self, utt_id: str, features: Features, model_dim: int, max_code: int) -> str | None:
        """What is wrong with a backend's output for an utterance (None: nothing). A shape the config does not
        have is the user's mismatch of model and config: UserError."""
        for name, shape in self.shapes(model_dim).items():
            array = features.conditioning.get(name)
            if array is None or tuple(array.shape) != shape:
                found = "none" if array is None else list(array.shape)
                raise UserError(f"the feature models make {name} of shape {found} for {utt_id}, but --config's "
                                f"gpt.model_dim {model_dim} needs {list(shape)}: pass the config of the model whose "
                                "checkpoints make the features")
            if not np.isfinite(array).all() or np.abs(array).max() > MAX_ABS_FEATURE:
                return f"its {name} holds NaN, infinite or huge values"
        codes = features.codes
        if codes.size and (codes.min() < 0 or codes.max() >= max_code):
            raise UserError(f"the feature models make code {int(codes.max())} for {utt_id}, outside 0..{max_code - 1} "
                            "of --config's gpt.start_mel_token: pass the config of the model whose codec made them")
        return None


def _rel(name: str) -> str:
    return f"{FEATURES_DIR}/{name}"


def _files20(stem: str, text_ids: np.ndarray, f: Features) -> list[tuple[str, bytes]]:
    return [(f"{stem}_text_ids.npy", npy_bytes(text_ids.astype(np.int32))),
            (f"{stem}_codes.npy", npy_bytes(f.codes.astype(np.int32))),
            (f"{stem}_condition.npy", npy_bytes(f.conditioning["condition"].astype(np.float32))),
            (f"{stem}_emo_vec.npy", npy_bytes(f.conditioning["emo_vec"].astype(np.float32)))]


def _roles20(stem: str) -> dict[str, str]:
    return {role: _rel(f"{stem}_{role}.npy") for role in ("text_ids", "codes", "condition", "emo_vec")}


def _single20(r: dict[str, Any]) -> dict[str, Any]:
    f = r["roles"]
    return {"id": r["id"], "speaker": r["speaker"], "text": r["text"], "text_ids_path": f["text_ids"],
            "text_len": r["text_len"], "codes_path": f["codes"], "code_len": r["code_len"],
            "condition_path": f["condition"], "condition_len": CONDITION_LATENTS, "emo_vec_path": f["emo_vec"],
            "language": r["language"], "duration": r["seconds"]}


def _pair20(t: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"{t['id']}__{p['id']}", "speaker": t["speaker"], "prompt_id": p["id"],
            "prompt_condition_path": p["roles"]["condition"], "prompt_condition_len": CONDITION_LATENTS,
            "prompt_emo_vec_path": p["roles"]["emo_vec"], "target_id": t["id"], "target_text": t["text"],
            "target_text_ids_path": t["roles"]["text_ids"], "target_text_len": t["text_len"],
            "target_codes_path": t["roles"]["codes"], "target_code_len": t["code_len"],
            "target_emo_vec_path": t["roles"]["emo_vec"], "language": t["language"]}


def _files25(stem: str, text_ids: np.ndarray, f: Features) -> list[tuple[str, bytes]]:
    return [(f"{stem}.npz", npz_bytes({"codes": f.codes.astype(np.int32), "text_ids": text_ids.astype(np.int32),
                                       "spk_emb": f.conditioning["spk_emb"].astype(np.float32),
                                       "emo_vec": f.conditioning["emo_vec"].astype(np.float32)}))]


def _roles25(stem: str) -> dict[str, str]:
    return {"features": _rel(f"{stem}.npz")}


def _single25(r: dict[str, Any]) -> dict[str, Any]:
    return {"id": r["id"], "features": r["roles"]["features"], "speaker": r["speaker"], "lang": r["language"],
            "lang_alias": None, "text": r["text"], "text_len": r["text_len"], "code_len": r["code_len"],
            "duration": r["seconds"]}


def _pair25(t: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"{t['id']}__{p['id']}", "target_features": t["roles"]["features"],
            "prompt_features": p["roles"]["features"], "speaker": t["speaker"], "lang": t["language"],
            "lang_alias": None, "prompt_lang": p["language"], "cross_lingual": t["language"] != p["language"],
            "text_len": t["text_len"], "code_len": t["code_len"]}


LAYOUTS: dict[str, Layout] = {
    "indextts2": Layout("indextts2", lambda d: {"condition": (CONDITION_LATENTS, d), "emo_vec": (d,)}, _files20,
                        _roles20, _single20, _pair20),
    "indextts25": Layout("indextts25", lambda d: {"spk_emb": (SPEAKER_DIM,), "emo_vec": (d,)}, _files25, _roles25,
                         _single25, _pair25),
}
