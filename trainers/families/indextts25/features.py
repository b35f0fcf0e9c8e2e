"""IndexTTS-2.5's samples: manifest lines, feature files, and the named arrays the model takes.

Per sample (shared/reference/indextts25-gpt.md, sections 5 and 7): the target's text ids (tiktoken, the `<|xx|>`
language token first, no start/stop), the target's 25 Hz codes, the prompt's 192-d CAMPPlus vector `spk_emb`,
a 1280-d emotion vector and the language (its lang_embedding row, languages.py). Four line forms:

- the 2.5 community preprocessing's output, as it writes it (one .npz per utterance holding codes, text_ids,
  spk_emb and emo_vec): its pair lines (`target_features`, `prompt_features`, text_len, code_len, lang,
  lang_alias) and its utterance lines (`features`: the utterance is its own prompt);
- .npy lines like IndexTTS2's, with the speaker vector in place of the conditioning latents: paired
  (target_text_ids_path, target_text_len, target_codes_path, target_code_len, prompt_spk_emb_path,
  prompt_emo_vec_path, language) and single (text_ids_path, text_len, codes_path, code_len, spk_emb_path,
  emo_vec_path, language).

The emotion vector of a paired sample is the prompt's, as upstream inference takes it by default (and as
IndexTTS2's paired lines do). A line's language is its `lang_alias` where it has one (the code it borrows),
else its language; `PATH::LANG` on the command line overrides both.

Ids 0 and 1: upstream inference drops every id 0 and 1 from the text before wrapping it in start/stop (in the
tiktoken vocabulary they are the ranks of "!" and '"'), and the community preprocessing keeps them. So the
trainer drops them too: when the manifests are checked, each text ids file is read once, its length checked
against the line's text_len (the count of ids in the file) and the count kept after the drop is what the
sample table holds, so a step's token counts are the ids the model sees (said once, with how many).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainers.data.features import FeatureError, FeatureSpec, _fail, _float_array, _load_npy
from trainers.data.manifest_lines import LineForm, ManifestForms, TextIds
from trainers.data.sample_table import Sample
from trainers.families.indextts25.languages import lang_id, language_problem, text_language
from trainers.families.indextts25.model import SPEAKER_DIM

DROPPED_IDS = (0, 1)  # start_text / stop_text, dropped from the content as prepare_gpt_inputs drops them
CONDITION_LATENTS = 32  # IndexTTS2's conditioning latents [32, D]: what a 2.0 feature file holds instead
# The members of a community .npz (named as the arrays they are), by the role of the line's path naming it
# (sample_table.PATH_ROLES): the prompt's file gives spk_emb.
ROLE_MEMBERS = {"text_ids": "text_ids", "codes": "codes", "condition": "spk_emb", "emo_vec": "emo_vec"}
REMAKE = "re-run the 2.5 preprocessing"


class _Unreadable(Exception):
    """What is wrong with a feature file read while the manifests are checked (no sample yet)."""


def _problem(sample: Sample | None, what: str, path: str, problem: str) -> Exception:
    return _fail(sample, what, path, problem) if sample is not None else _Unreadable(problem)


def _read_member(sample: Sample | None, what: str, path: str) -> tuple[np.ndarray, frozenset[str] | None]:
    """The array `what` of an .npz or an .npy file, and the arrays of the archive (None for an .npy)."""
    if not path.endswith(".npz"):
        if sample is not None:
            return _load_npy(sample, what, path), None
        array = np.load(path, allow_pickle=False)
        if not isinstance(array, np.ndarray):
            array.close()
            raise _Unreadable("is an .npz archive; expected a single array saved with np.save")
        return array, None
    try:
        with np.load(path, allow_pickle=False) as archive:
            if what not in archive.files:
                raise _problem(sample, what, path, f"the archive has no {what!r} array (it has "
                                                   f"{', '.join(archive.files) or 'none'}); {REMAKE}")
            return archive[what], frozenset(archive.files)
    except (FeatureError, _Unreadable):
        raise
    except FileNotFoundError as exc:
        raise _problem(sample, what, path, "not found; was it deleted after the manifest was validated?") from exc
    except Exception as exc:  # numpy raises several types for corrupt archives
        raise _problem(sample, what, path, f"cannot be loaded as .npz ({exc}); {REMAKE}") from exc


def archive_arrays(path: str) -> frozenset[str] | str | None:
    """ManifestForms.archive_arrays: the arrays of an .npz (None for an .npy), or why it cannot be read."""
    if not path.endswith(".npz"):
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            return frozenset(archive.files)
    except Exception as exc:  # noqa: BLE001 - numpy raises several types for corrupt archives
        return f"cannot be loaded as .npz ({exc}); {REMAKE}"


def kept_ids(ids: np.ndarray) -> np.ndarray:
    return ids[~np.isin(ids, DROPPED_IDS)]


def count_text_ids(path: str) -> TextIds | str:
    """ManifestForms.count_text_ids: the ids of a text ids file and those kept once ids 0 and 1 are dropped."""
    try:
        ids, arrays = _read_member(None, "text_ids", path)
    except _Unreadable as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported on its line
        return f"cannot be loaded ({exc}); re-extract this feature"
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        return f"expected a 1-D array of integer ids, found shape {list(ids.shape)} of {ids.dtype}"
    kept = kept_ids(ids)
    return TextIds(int(ids.shape[0]), int(kept.shape[0]), int(kept[0]) if kept.size else -1, arrays)


@dataclass(frozen=True)
class IndexTTS25Features(FeatureSpec):
    """A sample as the 2.5 model takes it: text_ids (0 and 1 dropped), codes, spk_emb [192], emo_vec [D], lang_id."""

    def load(self, sample: Sample, what: str, path: str) -> np.ndarray:
        """The array of an .npz member or an .npy file; text ids without the ids 0 and 1 (their count checked)."""
        array, _ = _read_member(sample, what, path)
        if what != "text_ids":
            return array
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise _fail(sample, what, path, f"expected a 1-D array of integer ids, found shape {list(array.shape)} of "
                                            f"{array.dtype}")
        kept = kept_ids(array)
        if kept.shape[0] != sample.text_len:
            raise _fail(sample, what, path, f"has {kept.shape[0]} ids once ids 0 and 1 are dropped, but had "
                                            f"{sample.text_len} when the manifests were checked: the file "
                                            "changed since; start the run again so the manifests are checked")
        return kept

    def conditioning(self, sample: Sample) -> dict[str, np.ndarray]:
        return {"spk_emb": self._spk_emb(sample), "emo_vec": self._emo_vec(sample),
                "lang_id": np.asarray(lang_id(sample.lang or ""), dtype=np.int64)}

    def model_dim_files(self, sample: Sample) -> list[tuple[str, str, tuple[int, ...]]]:
        return [("emo_vec", sample.emo_vec_path, ())]

    def _spk_emb(self, sample: Sample) -> np.ndarray:
        path = sample.condition_path
        array = self.load(sample, "spk_emb", path)
        if array.ndim >= 2 and array.shape[-2:] == (CONDITION_LATENTS, self.model_dim):
            raise _fail(sample, "spk_emb", path, f"holds [{CONDITION_LATENTS}, {self.model_dim}] conditioning latents, "
                                                 "the speaker input of IndexTTS2 (2.0); an IndexTTS-2.5 sample needs "
                                                 f"the prompt's {SPEAKER_DIM}-d CAMPPlus vector (re-extract the "
                                                 "features with the 2.5 preprocessing)")
        return _float_array(sample, "spk_emb", path, array, (SPEAKER_DIM,))


_PAIR = LineForm(name="2.5 preprocessing pair", text_ids="target_features", text_len="text_len",
                 codes="target_features", code_len="code_len", condition="prompt_features",
                 emo_vec="prompt_features", language="lang", language_alias="lang_alias")
_UTTERANCE = LineForm(name="2.5 preprocessing utterance", text_ids="features", text_len="text_len", codes="features",
                      code_len="code_len", condition="features", emo_vec="features", language="lang",
                      language_alias="lang_alias")
_PAIRED = LineForm(name="paired (2.5)", text_ids="target_text_ids_path", text_len="target_text_len",
                   codes="target_codes_path", code_len="target_code_len", condition="prompt_spk_emb_path",
                   emo_vec="prompt_emo_vec_path")
_SINGLE = LineForm(name="single (2.5)", text_ids="text_ids_path", text_len="text_len", codes="codes_path",
                   code_len="code_len", condition="spk_emb_path", emo_vec="emo_vec_path")


def detect_form(obj: dict[str, Any]) -> LineForm | None:
    """A line's form; partial lines get the closest, so the error names their missing fields."""
    if "target_features" in obj or "prompt_features" in obj:
        return _PAIR
    if "features" in obj:
        return _UTTERANCE
    if "prompt_spk_emb_path" in obj or "target_codes_path" in obj or "target_text_ids_path" in obj:
        return _PAIRED
    if "spk_emb_path" in obj or "codes_path" in obj or "text_ids_path" in obj:
        return _SINGLE
    return None


FORMS = ManifestForms(
    "indextts25", detect_form,
    "a 2.5 preprocessing pair line has target_features and prompt_features, its utterance line features; a paired "
    ".npy line has target_text_ids_path, target_codes_path and prompt_spk_emb_path, a single one text_ids_path, "
    "codes_path and spk_emb_path",
    count_text_ids=count_text_ids,
    dropped_note=("{samples} samples' text ids hold ids 0 or 1 ({ids} in all)\n"
                  "(the tiktoken ranks of '!' and '\"'): IndexTTS-2.5 inference drops them from the text before the\n"
                  "model sees it, and so does the trainer (it counts each sample's text without them)"),
    language_problem=language_problem,
    text_language=text_language,
    archive_arrays=archive_arrays,
    role_arrays=ROLE_MEMBERS,
    archive_hint=REMAKE,
)
