"""One line of a manifest: its forms, the checks of its fields, and the table row it becomes.

The forms are a model family's (`ManifestForms`, carried by DataLimits; trainers/families): IndexTTS2's
paired and single-utterance lines are defined here. A form maps the line's keys onto the table's roles
(text ids, codes, the prompt's conditioning file, the emotion vector's file); several roles may name one
file (an archive holding them all).

Feature files are only checked for existence here; their contents are checked when a sample is
loaded (trainers.data.features). A line that passes every check takes a fast path (check_line's
first half); any other line goes through the checks that word each problem.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from trainers.data.feature_folders import TOO_SHORT, FolderRecord, file_state
from trainers.data.sample_table import PATH_ROLES, TableBuilder
from trainers.model.layout import PREFIX_LEN


@dataclass(frozen=True)
class DataLimits:
    """What a model family's model accepts of a manifest line: its length limits, and the forms its lines are
    written in (by default IndexTTS2's)."""

    max_text_tokens: int
    max_mel_tokens: int
    prefix_len: int = PREFIX_LEN
    forms: "ManifestForms" = field(default_factory=lambda: INDEXTTS2_FORMS)
    text_tokens: int = 0  # the text vocabulary's size, for a family's language tokens (0: not known, not checked)

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


@dataclass(frozen=True)
class LineForm:
    """Field names of one manifest layout, mapped onto Sample's roles (a family's ManifestForms holds its forms)."""

    name: str
    text_ids: str
    text_len: str
    codes: str
    code_len: str
    condition: str
    emo_vec: str
    language: str = "language"  # the optional field naming the sample's language
    # A field that, where a line has it, names the language the sample is trained as instead (the 2.5
    # preprocessing's lang_alias: a borrowed language code).
    language_alias: str | None = None
    required: tuple[str, ...] = ()  # filled in by __post_init__; read once per line

    def __post_init__(self) -> None:
        fields_ = ("id", self.text_ids, self.text_len, self.codes, self.code_len, self.condition, self.emo_vec)
        object.__setattr__(self, "required", tuple(dict.fromkeys(fields_)))  # a key naming several roles once

    @property
    def path_keys(self) -> tuple[str, str, str, str]:
        """The keys naming each file role (sample_table.PATH_ROLES), in that order."""
        return (self.text_ids, self.codes, self.condition, self.emo_vec)


# The prompt's emotion vector is what inference uses by default, so paired
# samples condition on it (target_emo_vec_path is accepted but unused).
_PAIRED = LineForm(
    name="paired",
    text_ids="target_text_ids_path",
    text_len="target_text_len",
    codes="target_codes_path",
    code_len="target_code_len",
    condition="prompt_condition_path",
    emo_vec="prompt_emo_vec_path",
)
_SINGLE = LineForm(
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


def _detect_form(obj: dict[str, Any]) -> LineForm | None:
    """Pick the layout a line is written in; partial lines get the closest form
    so the error names their missing fields instead of a vague 'unknown form'."""
    if "prompt_condition_path" in obj and "target_codes_path" in obj:
        return _PAIRED
    if "codes_path" in obj or not _SINGLE_KEYS.isdisjoint(obj):
        return _SINGLE
    if not _PAIRED_KEYS.isdisjoint(obj):
        return _PAIRED
    return None


@dataclass(frozen=True)
class TextIds:
    """What a family reads of a line's text ids file when its model drops some ids (ManifestForms.count_text_ids):
    the ids in the file, those the model keeps (the length the sample table holds), the first id kept (-1: none),
    and the arrays of the archive they were read from (None: a file of one array)."""

    in_file: int
    kept: int
    first: int = -1
    arrays: frozenset[str] | None = None


@dataclass(frozen=True)
class ManifestForms:
    """The line forms of a model family's manifests: `detect` picks a line's form (for a partial line the
    closest, so the error names its missing fields), `hint` says how the forms are told apart.

    Optional checks of a family: `count_text_ids(path)` reads a text ids file when the model keeps fewer ids
    than the file holds (TextIds, or what is wrong with the file): the table's text_len is then the kept count, so
    a step's token counts are what the model sees, and the line's text_len is checked against the file here
    (`dropped_note`, with {samples} and {ids}, is said once when ids were dropped); `language_problem(lang)` says
    what is wrong with a sample's language (None: nothing); `text_language(first_id, text_tokens)` names the
    language whose token the text's first id is (None: no language token), which must be the sample's language;
    `archive_arrays(path)` lists the arrays of a feature file that is an archive of several (None: one array; a
    string: what is wrong with it), each role (PATH_ROLES) reading the array `role_arrays` names, so an
    archive without one is refused by line when the manifests are checked, not mid-run when first read.
    """

    name: str
    detect: Callable[[dict[str, Any]], LineForm | None]
    hint: str
    count_text_ids: Callable[[str], "TextIds | str"] | None = None
    dropped_note: str = ""
    language_problem: Callable[[str | None], str | None] | None = None
    text_language: Callable[[int, int], str | None] | None = None
    archive_arrays: Callable[[str], "frozenset[str] | str | None"] | None = None
    role_arrays: Mapping[str, str] = field(default_factory=dict)
    archive_hint: str = "make this feature file again"  # what to do about an archive without an array a role reads


INDEXTTS2_FORMS = ManifestForms("indextts2", _detect_form, _FORM_HINT)


@dataclass
class Validator:
    """The state of one call's check of all its manifests."""

    limits: DataLimits
    flag: str
    problems: list[str] = field(default_factory=list)
    table: TableBuilder = field(default_factory=TableBuilder)
    # One stat per unique feature path: what is wrong with it, "" for a readable regular file.
    file_problems: dict[str, str] = field(default_factory=dict)
    folders: FolderRecord = field(default_factory=FolderRecord)
    # The family's count of each text ids file (ManifestForms.count_text_ids), and what was dropped.
    text_ids: dict[str, TextIds | str] = field(default_factory=dict)
    archives: dict[str, frozenset[str] | str | None] = field(default_factory=dict)  # ManifestForms.archive_arrays
    dropped_ids: int = 0
    samples_with_dropped: int = 0

    def file_problem(self, path: str) -> str:
        problem = self.file_problems.get(path)
        if problem is None:
            self.folders.note(os.path.dirname(path))  # before the file: a change from now on shows in the folder
            problem, linked = file_state(path)
            if linked:
                self.folders.linked.append(path)
            self.file_problems[path] = problem
        return problem


@dataclass
class FileContext:
    """Per-manifest state: display name, base folder and a cache of feature paths."""

    name: str
    base: str
    lang: str | None
    check: Validator
    manifest: int = -1  # the manifest's index in the table (set on its first sample)
    # raw path as written -> (resolved absolute path, what is wrong with it or ""); large
    # manifests repeat few paths, so each is joined and stat'ed once.
    features: dict[str, tuple[str, str]] = field(default_factory=dict)
    # raw path as written -> its table file index, for paths without problems (the fast path's lookup).
    good: dict[str, int] = field(default_factory=dict)

    def language(self, line_lang: str | None) -> str | None:
        """The sample's language: `::LANG` of the manifest, else the line's own."""
        return self.lang if self.lang is not None else line_lang

    def feature(self, raw: str) -> tuple[str, str]:
        entry = self.features.get(raw)
        if entry is None:
            path = os.path.normpath(os.path.join(self.base, raw))  # absolute `raw` stays as is
            entry = self.features[raw] = (path, self.check.file_problem(path))
            if not entry[1]:
                self.good[raw] = self.check.table.file(path)
        return entry

    def family_checks(self, form: LineForm, raws: list[str], text_len: int, lang: str | None,
                      ) -> tuple[int, str | None]:
        """The family's own checks of a line (ManifestForms): (the text length the table keeps, a problem or None).
        `raws`: the line's paths of PATH_ROLES; `lang`: the line's own language (`::LANG` overrides it)."""
        forms = self.check.limits.forms
        if forms.language_problem is not None:
            problem = forms.language_problem(self.language(lang))
            if problem:
                return text_len, problem
        if forms.count_text_ids is None:
            return text_len, self._archive_problem(form, raws)
        text_key, path = form.text_ids, self.feature(raws[0])[0]
        counted = self.check.text_ids.get(path)
        if counted is None:
            counted = self.check.text_ids[path] = forms.count_text_ids(path)
            if isinstance(counted, TextIds):  # the archive was opened for its ids: its arrays are known
                self.check.archives.setdefault(path, counted.arrays)
        if isinstance(counted, str):
            return text_len, f"{text_key} {path}: {counted}"
        if counted.in_file != text_len:
            return text_len, (f"{text_key} {path} holds {counted.in_file} ids but the line says text_len {text_len}; "
                              "regenerate the manifest or the feature")
        if counted.kept < 1:
            return text_len, f"{text_key} {path}: no id is left once the ids the model drops are dropped; drop this sample"
        return counted.kept, (self._archive_problem(form, raws)
                              or self._text_language_problem(text_key, path, counted.first, lang))

    def _archive_problem(self, form: LineForm, raws: list[str]) -> str | None:
        """An archive named for a role that lacks the array the role reads (ManifestForms.archive_arrays)."""
        forms = self.check.limits.forms
        if forms.archive_arrays is None:
            return None
        for role, key, raw in zip(PATH_ROLES, form.path_keys, raws):
            member = forms.role_arrays.get(role)
            if member is None:
                continue
            path = self.feature(raw)[0]
            if path not in self.check.archives:
                self.check.archives[path] = forms.archive_arrays(path)
            arrays = self.check.archives[path]
            if isinstance(arrays, str):
                return f"{key} {path}: {arrays}"
            if arrays is not None and member not in arrays:
                return (f"{key} {path}: the archive has no {member!r} array (it has {', '.join(sorted(arrays)) or 'none'})"
                        f"; {forms.archive_hint}")
        return None

    def _text_language_problem(self, text_key: str, path: str, first: int, line_lang: str | None) -> str | None:
        """Text ids that begin with another language's token than the sample's language (ManifestForms.text_language):
        the sample would train its language's row on text that inference begins with its own language's token."""
        text_language = self.check.limits.forms.text_language
        lang = self.language(line_lang)
        found = text_language(first, self.check.limits.text_tokens) if text_language and lang else None
        if found is None or lang is None or found == lang.lower():
            return None
        begins = f"{text_key} {path}: its text ids begin with the language token of {found}"
        if self.lang is not None:
            says = f" (its line says {line_lang})" if line_lang and line_lang != self.lang else ""
            return (f"{begins}, but ::{lang} trains the sample as {lang}{says}; drop ::{lang} if the data is {found}, "
                    f"or make its text ids again as {lang} (indextts-retokenize)")
        return (f"{begins}, but its line says the language is {lang}; fix the line's language, or make its text ids "
                f"again as {lang} (indextts-retokenize)")

    def add(self, sample_id: str, text_len: int, code_len: int, line: int, lang: str | None, speaker: str | None,
            raws: list[str], kept: int) -> None:
        """A checked line's sample; `kept`: its text length once the family dropped ids (family_checks)."""
        if self.manifest < 0:
            self.manifest = self.check.table.manifest(self.name)
        files = [self.good[raw] for raw in raws]
        if kept != text_len:
            self.check.dropped_ids += text_len - kept
            self.check.samples_with_dropped += 1
        table = self.check.table
        table.add(sample_id, kept, code_len, self.manifest, line, self.language(lang), speaker, files)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _length_problem(key: str, value: Any, limit: int, limit_key: str) -> str | None:
    if type(value) is not int:  # bool is an int subclass; reject it too
        return f"{key} must be an integer, got {value!r} ({_type_name(value)}); write the token count as a JSON integer"
    if value < 1:
        return f"{key} {value} must be at least 1; drop this empty sample"
    if value > limit:
        return f"{key} {value} exceeds {limit_key} {limit}; drop or split this sample"
    return None


def _path_problem(key: str, value: Any, ctx: FileContext) -> str | None:
    """What is wrong with a feature path, or None for an existing feature file."""
    if type(value) is not str or not value:
        return (f"{key} must be a non-empty string path, got {value!r} ({_type_name(value)}); "
                "fix the manifest line")
    path, problem = ctx.feature(value)
    if not problem:
        return None
    if problem.startswith(TOO_SHORT):  # the path is right, the file is not
        return f"{key} {path} {problem}; extract this feature again, or drop the line"
    outside = os.path.isabs(value) or os.path.relpath(path, ctx.base).split(os.sep)[0] == os.pardir
    where = (f"it is outside the manifest folder {ctx.base}, which is allowed only for an existing regular file"
             if outside else f"relative paths are resolved from the manifest folder {ctx.base}")
    return f"{key} {problem}: {path}; {where}; fix the path or the file"


def _optional_str(obj: dict[str, Any], key: str | None) -> tuple[str | None, str | None]:
    """(value, None) for an optional name field (None: the form has no such field), or (None, problem)."""
    value = obj.get(key)
    name = _name(value)
    if name is not False:
        return name, None
    return None, f"{key} must be a string or null, got {value!r} ({_type_name(value)}); fix the manifest line"


def _line_problems(obj: Any, forms: ManifestForms) -> tuple[LineForm | None, str | None]:
    """Structural checks: an object in a known form with all required fields."""
    if not isinstance(obj, dict):
        return None, f"line is a JSON {_type_name(obj)}, not an object; write one JSON object per line"
    form = forms.detect(obj)
    if form is None:
        return None, f"neither manifest form recognised ({forms.hint}); fix the field names"
    missing = [key for key in form.required if key not in obj]
    if missing:
        return None, f"missing required field(s) {', '.join(missing)} for a {form.name} line; add them or regenerate the manifest"
    return form, None


def _name(value: Any) -> str | None | bool:
    """An optional name field's value (None when absent or empty), or False when it is of the wrong type."""
    if value is None or value == "":
        return None
    if type(value) is str:
        return value
    return str(value) if type(value) is int else False  # numeric speaker ids are common; treat them as names


def _fast_line(obj: Any, ctx: FileContext, line: int) -> bool:
    """Add a line that passes every check, without wording anything; False: check it the slow way."""
    if type(obj) is not dict:
        return False
    limits = ctx.check.limits
    form = limits.forms.detect(obj)
    try:
        sample_id, text_len, code_len = obj["id"], obj[form.text_len], obj[form.code_len]
        raws = [obj[key] for key in form.path_keys]
    except (KeyError, AttributeError):  # AttributeError: no form
        return False
    if not (type(sample_id) is str and sample_id and type(text_len) is int and type(code_len) is int
            and 1 <= text_len <= limits.max_text_tokens and 1 <= code_len <= limits.max_mel_tokens
            and limits.positions(text_len, code_len) <= limits.max_positions):
        return False
    for raw in raws:
        if type(raw) is not str or not raw or (raw not in ctx.good and ctx.feature(raw)[1]):
            return False
    speaker, lang = _name(obj.get("speaker")), _name(obj.get(form.language))
    alias = _name(obj.get(form.language_alias))  # None without the field: JSON keys are never None
    if speaker is False or lang is False or alias is False:
        return False
    lang = alias or lang
    kept, problem = ctx.family_checks(form, raws, text_len, lang)
    if problem:
        return False
    ctx.add(sample_id, text_len, code_len, line, lang, speaker, raws, kept)
    return True


def check_line(obj: Any, ctx: FileContext, line: int) -> None:
    """Add one parsed line's sample to the table, or record its problems."""
    if _fast_line(obj, ctx, line):
        return
    src = f"{ctx.name}:{line}"
    check = ctx.check
    form, problem = _line_problems(obj, check.limits.forms)
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
    raws = [obj[key] for key in form.path_keys]
    problems += (_path_problem(key, obj[key], ctx) for key in dict.fromkeys(form.path_keys))
    speaker, speaker_problem = _optional_str(obj, "speaker")
    line_lang, lang_problem = _optional_str(obj, form.language)
    alias, alias_problem = _optional_str(obj, form.language_alias)
    problems += (speaker_problem, lang_problem, alias_problem)
    if not any(problems):
        line_lang = alias or line_lang
        kept, family_problem = ctx.family_checks(form, raws, text_len, line_lang)
        problems.append(family_problem)
    if any(problems):
        check.problems.extend(f"{src}: {p}" for p in problems if p)
        return
    ctx.add(sample_id, text_len, code_len, line, line_lang, speaker, raws, kept)
