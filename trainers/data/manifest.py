"""Parse and validate training manifests (JSONL) before training starts.

Every problem in every given manifest is collected and reported in one
ManifestError, so a data set can be fixed in one pass instead of one crash
per run. Feature files are only checked for existence here; their contents
are checked lazily by trainers.data.features when a sample is loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from trainers.model.layout import PREFIX_LEN

logger = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 30
_LANG_SEPARATOR = "::"
_HASH_CHUNK = 1 << 20


class ManifestError(ValueError):
    """One or more manifest problems; str() lists one problem per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(format_problems(self.problems))

    def __reduce__(self):  # keep `problems` intact across pickling (worker processes)
        return (type(self), (self.problems,))


def format_problems(problems: Sequence[str], limit: int = MAX_LISTED_PROBLEMS) -> str:
    """Join problems one per line, listing at most `limit` of them."""
    lines = list(problems[:limit])
    if len(problems) > limit:
        lines.append(f"... and {len(problems) - limit} more problems")
    return "\n".join(lines)


@dataclass(frozen=True)
class ManifestSpec:
    path: Path
    lang: str | None


def parse_manifest_spec(spec: str) -> ManifestSpec:
    """Split "PATH::LANG" into a ManifestSpec; without "::" the language is None."""
    path_part, sep, lang = spec.rpartition(_LANG_SEPARATOR)
    if not sep:
        path_part, lang_value = spec, None
    else:
        lang_value = lang.strip()
        if not lang_value:
            raise ManifestError(
                [f"{spec}: empty language after '::'; write PATH::LANG (e.g. data/train.jsonl::am) or drop the suffix"]
            )
    if not path_part.strip():
        raise ManifestError([f"{spec}: empty manifest path; write PATH or PATH::LANG"])
    return ManifestSpec(path=Path(path_part), lang=lang_value)


@dataclass(frozen=True)
class DataLimits:
    max_text_tokens: int
    max_mel_tokens: int
    prefix_len: int = PREFIX_LEN

    def __post_init__(self) -> None:
        if self.max_text_tokens < 1 or self.max_mel_tokens < 1 or self.prefix_len < 0:
            raise ValueError(f"invalid DataLimits {self}")

    @property
    def max_positions(self) -> int:
        """Positions the model's position tables can hold (mel + text tables)."""
        return (self.max_mel_tokens + 3) + (self.max_text_tokens + 2)

    def positions(self, text_len: int, code_len: int) -> int:
        """Sequence length of one sample: prefix + [start] text [stop] + [start] codes [stop]."""
        return self.prefix_len + (text_len + 2) + (code_len + 2)


@dataclass(frozen=True, slots=True)
class Sample:
    index: int
    id: str
    source: str
    text_ids_path: str
    codes_path: str
    condition_path: str
    emo_vec_path: str
    text_len: int
    code_len: int
    lang: str | None
    speaker: str | None


@dataclass(frozen=True)
class _Form:
    """Field names of one manifest layout, mapped onto Sample's roles."""

    name: str
    text_ids: str
    text_len: str
    codes: str
    code_len: str
    condition: str
    emo_vec: str
    required: tuple[str, ...] = ()  # filled in by __post_init__; read once per line

    def __post_init__(self) -> None:
        fields_ = ("id", self.text_ids, self.text_len, self.codes, self.code_len, self.condition, self.emo_vec)
        object.__setattr__(self, "required", fields_)

    @property
    def path_keys(self) -> tuple[str, str, str, str]:
        return (self.text_ids, self.codes, self.condition, self.emo_vec)


# The prompt's emotion vector is what inference uses by default, so paired
# samples condition on it (target_emo_vec_path is accepted but unused).
_PAIRED = _Form(
    name="paired",
    text_ids="target_text_ids_path",
    text_len="target_text_len",
    codes="target_codes_path",
    code_len="target_code_len",
    condition="prompt_condition_path",
    emo_vec="prompt_emo_vec_path",
)
_SINGLE = _Form(
    name="single",
    text_ids="text_ids_path",
    text_len="text_len",
    codes="codes_path",
    code_len="code_len",
    condition="condition_path",
    emo_vec="emo_vec_path",
)
_PAIRED_KEYS = frozenset(_PAIRED.required) - {"id"}
_SINGLE_KEYS = frozenset(_SINGLE.required) - {"id"}
_FORM_HINT = (
    "a paired line has prompt_condition_path and target_codes_path; "
    "a single-utterance line has text_ids_path, codes_path and condition_path"
)


def _detect_form(obj: dict[str, Any]) -> _Form | None:
    """Pick the layout a line is written in; partial lines get the closest form
    so the error names their missing fields instead of a vague 'unknown form'."""
    if "prompt_condition_path" in obj and "target_codes_path" in obj:
        return _PAIRED
    if "codes_path" in obj or not _SINGLE_KEYS.isdisjoint(obj):
        return _SINGLE
    if not _PAIRED_KEYS.isdisjoint(obj):
        return _PAIRED
    return None


@dataclass
class _Validator:
    """Shared state while validating all manifests of one call."""

    limits: DataLimits
    flag: str
    problems: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    exists: dict[str, bool] = field(default_factory=dict)  # one stat per unique feature path

    def file_exists(self, path: str) -> bool:
        found = self.exists.get(path)
        if found is None:
            found = self.exists[path] = os.path.isfile(path)
        return found


@dataclass
class _FileContext:
    """Per-manifest state: display name, base folder and a cache of feature paths."""

    name: str
    base: str
    lang: str | None
    check: _Validator
    # raw path as written -> (resolved absolute path, file exists); large
    # manifests repeat few paths, so each is joined and stat'ed once.
    features: dict[str, tuple[str, bool]] = field(default_factory=dict)

    def feature(self, raw: str) -> tuple[str, bool]:
        entry = self.features.get(raw)
        if entry is None:
            path = os.path.normpath(os.path.join(self.base, raw))  # absolute `raw` stays as is
            entry = self.features[raw] = (path, self.check.file_exists(path))
        return entry


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _length_problem(key: str, value: Any, limit: int, limit_key: str) -> str | None:
    """Describe what is wrong with a token count, or None when it is valid."""
    if type(value) is not int:  # bool is an int subclass; reject it too
        return f"{key} must be an integer, got {value!r} ({_type_name(value)}); write the token count as a JSON integer"
    if value < 1:
        return f"{key} {value} must be at least 1; drop this empty sample"
    if value > limit:
        return f"{key} {value} exceeds {limit_key} {limit}; drop or split this sample"
    return None


def _path_problem(key: str, value: Any, ctx: _FileContext) -> tuple[str | None, str | None]:
    """Return (resolved path, None) for an existing feature file, else (None, problem)."""
    if type(value) is not str or not value:
        return None, f"{key} must be a non-empty string path, got {value!r} ({_type_name(value)}); fix the manifest line"
    path, found = ctx.feature(value)
    if not found:
        return None, f"{key} file not found: {path}; relative paths are resolved from the manifest folder {ctx.base}"
    return path, None


def _optional_str(obj: dict[str, Any], key: str) -> tuple[str | None, str | None]:
    """Return (value, None) for an optional name field, or (None, problem)."""
    value = obj.get(key)
    if value is None or value == "":
        return None, None
    if type(value) is str:
        return value, None
    if type(value) is int:  # numeric speaker ids are common; treat them as names
        return str(value), None
    return None, f"{key} must be a string or null, got {value!r} ({_type_name(value)}); fix the manifest line"


def _line_problems(obj: Any) -> tuple[_Form | None, str | None]:
    """Structural checks: an object in a known form with all required fields."""
    if not isinstance(obj, dict):
        return None, f"line is a JSON {_type_name(obj)}, not an object; write one JSON object per line"
    form = _detect_form(obj)
    if form is None:
        return None, f"neither manifest form recognised ({_FORM_HINT}); fix the field names"
    missing = [key for key in form.required if key not in obj]
    if missing:
        return None, f"missing required field(s) {', '.join(missing)} for a {form.name} line; add them or regenerate the manifest"
    return form, None


def _check_line(obj: Any, ctx: _FileContext, src: str) -> None:
    """Validate one parsed line; append a Sample or the line's problems."""
    check = ctx.check
    form, problem = _line_problems(obj)
    if form is None:
        check.problems.append(f"{src}: {problem}")
        return
    limits = check.limits
    text_len, code_len = obj[form.text_len], obj[form.code_len]
    problems = [
        _length_problem(form.text_len, text_len, limits.max_text_tokens, "gpt.max_text_tokens"),
        _length_problem(form.code_len, code_len, limits.max_mel_tokens, "gpt.max_mel_tokens"),
    ]
    if problems == [None, None] and limits.positions(text_len, code_len) > limits.max_positions:
        problems.append(
            f"sample needs {limits.positions(text_len, code_len)} positions "
            f"({limits.prefix_len}+({text_len}+2)+({code_len}+2)) but "
            f"(gpt.max_mel_tokens+3)+(gpt.max_text_tokens+2) is {limits.max_positions}; drop or split this sample"
        )
    sample_id = obj["id"]
    if type(sample_id) is not str or not sample_id:
        problems.append(f"id must be a non-empty string, got {sample_id!r} ({_type_name(sample_id)}); fix the manifest line")
    paths = []
    for key in form.path_keys:
        path, problem = _path_problem(key, obj[key], ctx)
        paths.append(path)
        problems.append(problem)
    speaker, speaker_problem = _optional_str(obj, "speaker")
    line_lang, lang_problem = _optional_str(obj, "language")
    problems += (speaker_problem, lang_problem)
    if any(problems):
        check.problems.extend(f"{src}: {p}" for p in problems if p)
        return
    text_ids_path, codes_path, condition_path, emo_vec_path = paths
    check.samples.append(
        Sample(
            index=len(check.samples),
            id=sample_id,
            source=src,
            text_ids_path=text_ids_path,
            codes_path=codes_path,
            condition_path=condition_path,
            emo_vec_path=emo_vec_path,
            text_len=text_len,
            code_len=code_len,
            lang=ctx.lang if ctx.lang is not None else line_lang,
            speaker=speaker,
        )
    )


def _read_text(spec: ManifestSpec, flag: str, out: list[str]) -> str | None:
    """Read a manifest as UTF-8 text, or record why it cannot be read."""
    try:
        data = spec.path.read_bytes()
    except FileNotFoundError:
        out.append(f"{flag} {spec.path}: file not found; check the path")
        return None
    except IsADirectoryError:
        out.append(f"{flag} {spec.path}: is a directory; pass the .jsonl manifest file")
        return None
    except OSError as exc:
        out.append(f"{flag} {spec.path}: cannot read ({exc.strerror or exc}); check the file and its permissions")
        return None
    try:
        return data.decode("utf-8-sig")  # tolerate a BOM written by some editors
    except UnicodeDecodeError as exc:
        out.append(f"{flag} {spec.path}: not UTF-8 text (bad byte at offset {exc.start}); save the manifest as UTF-8")
        return None


def _load_one(spec: ManifestSpec, check: _Validator) -> None:
    text = _read_text(spec, check.flag, check.problems)
    if text is None:
        return
    name = str(spec.path)
    ctx = _FileContext(name=name, base=os.path.dirname(os.path.abspath(spec.path)), lang=spec.lang, check=check)
    seen_lines = 0
    # Split on "\n" only: str.splitlines() would also break on U+2028 etc.,
    # which JSON allows unescaped inside strings.
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        seen_lines += 1
        src = f"{name}:{number}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            check.problems.append(f"{src}: invalid JSON ({exc.msg} at column {exc.colno}); write one complete JSON object per line")
            continue
        _check_line(obj, ctx, src)
    if seen_lines == 0:
        check.problems.append(f"{check.flag} {spec.path}: manifest has no samples; check the file or drop this manifest")


def _warn_duplicate_ids(samples: Sequence[Sample]) -> None:
    seen: set[str] = set()
    duplicates = 0
    example = None
    for sample in samples:
        if sample.id in seen:
            duplicates += 1
            example = example or sample
        else:
            seen.add(sample.id)
    if duplicates:
        logger.warning(
            "%d samples repeat an id already used by an earlier sample (first at %s, id %r); "
            "unique ids make logs and per-sample errors unambiguous",
            duplicates,
            example.source,
            example.id,
        )


def load_manifests(
    specs: Sequence[ManifestSpec], limits: DataLimits, *, flag: str = "--train-manifest"
) -> list[Sample]:
    """Parse and validate all manifests; raise one ManifestError listing every problem."""
    check = _Validator(limits=limits, flag=flag)
    if not specs:
        check.problems.append(f"{flag}: no manifest given; pass at least one PATH or PATH::LANG")
    for spec in specs:
        _load_one(spec, check)
    if check.problems:
        raise ManifestError(check.problems)
    _warn_duplicate_ids(check.samples)
    return check.samples


def manifests_fingerprint(specs: Sequence[ManifestSpec]) -> str:
    """sha256 over each manifest's language and bytes, in order.

    The location is deliberately left out so a moved data folder (paths inside
    are relative) still matches a checkpoint's recorded fingerprint.
    """
    digest = hashlib.sha256()
    digest.update(f"manifests:{len(specs)}\n".encode())
    problems = []
    for spec in specs:
        lang = "<none>" if spec.lang is None else f"={spec.lang}"
        digest.update(f"lang{lang}\n".encode())
        try:
            with open(spec.path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                digest.update(f"bytes:{size}\n".encode())  # length prefix keeps file boundaries unambiguous
                while chunk := handle.read(_HASH_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            problems.append(f"{spec.path}: cannot read manifest for fingerprinting ({exc.strerror or exc}); check the path")
    if problems:
        raise ManifestError(problems)
    return digest.hexdigest()
