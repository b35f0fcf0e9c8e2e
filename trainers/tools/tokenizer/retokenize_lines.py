"""Reading and checking manifest lines: the two manifest forms (recognised as trainers/manifest.py
does), each line's text, its ids and the problems the trainer would refuse, and the per-manifest
report (tokens, <unk>, byte pieces). Line, Report and Plan are what the writing step is given."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from trainers.data.manifest_lines import INDEXTTS2_FORMS
from trainers.tools.tokenizer.retokenize_front_end import Tokenizer
from trainers.tools.tokenizer.retokenize_limits import Limits


@dataclass(frozen=True)
class Form:
    name: str
    text_keys: tuple[str, ...]  # the first one present is the text
    ids_key: str
    len_key: str
    code_len_key: str


PAIRED = Form("paired", ("target_text",), "target_text_ids_path", "target_text_len", "target_code_len")
SINGLE = Form("single", ("text", "target_text"), "text_ids_path", "text_len", "code_len")


def detect_form(obj: dict) -> Form | None:
    """The line's form by the trainer's own rule (trainers/data/manifest_lines.py)."""
    form = INDEXTTS2_FORMS.detect(obj)
    return None if form is None else {"paired": PAIRED, "single": SINGLE}[form.name]


@dataclass
class Line:
    number: int
    obj: dict
    form: Form
    text: str
    ids: list[int] = field(default_factory=list)
    language: str | None = None  # IndexTTS-2.5: the line's "language", else --language (written into the line)


@dataclass
class Report:
    manifest: str
    output: str
    lines: int = 0
    tokens: int = 0
    unk: int = 0
    unk_rate: float = 0.0
    lines_with_unk: int = 0
    first_line_with_unk: str = ""
    byte_tokens: int = 0
    max_text_len: int = 0
    unknown_chars: list[str] = field(default_factory=list)


@dataclass
class Plan:
    manifest: Path
    output: Path
    lines: list[Line]
    report: Report


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def text_of(obj: dict, form: Form, where: str) -> tuple[str | None, str | None]:
    """The line's text (the first of form.text_keys present), or None and the problem ("where: ...; what to do").
    extend_bpe.py reads its corpus lines with this too."""
    present = [k for k in form.text_keys if k in obj]
    if not present:
        keys = " or ".join(f'"{k}"' for k in form.text_keys)
        return None, (f"{where}: no text field ({keys}) in this {form.name} line; add the utterance's text "
                      "(or drop the line)")
    key = present[0]
    text = obj[key]
    if type(text) is not str:
        return None, f'{where}: "{key}" is {text!r} ({_type_name(text)}), not a string; write the text as a JSON string'
    if len(present) > 1 and obj[present[1]] != text:
        return None, (f'{where}: "{present[0]}" and "{present[1]}" differ in this {form.name} line; keep one, '
                      f'the text of the utterance in "{present[0]}"')
    return text, None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _utf8_ok(obj: dict) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def read_manifest(path: Path) -> tuple[list[Line], list[str]]:
    """The manifest's lines with their text, and the problems found (file:line: ...)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], [f"--manifests {path}: no such file; check the path"]
    except IsADirectoryError:
        return [], [f"--manifests {path}: is a folder; pass the .jsonl manifest file"]
    except OSError as exc:
        return [], [f"--manifests {path}: cannot read it ({exc.strerror or exc})"]
    try:
        content = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return [], [f"--manifests {path}: not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8"]
    lines, problems = [], []
    # Split on "\n" only, as the trainer does: JSON strings may hold U+2028 unescaped.
    for number, raw in enumerate(content.split("\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); write one complete JSON "
                            "object per line")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{where}: the line is a JSON {_type_name(obj)}, not an object; write one JSON object "
                            "per line")
            continue
        if _SURROGATE_ESCAPE.search(raw) and not _utf8_ok(obj):
            problems.append(f"{where}: the line holds an unpaired surrogate escape (\\ud800-\\udfff), which is no "
                            "character; fix the text (it was probably cut in the middle of a character)")
            continue
        form = detect_form(obj)
        if form is None:
            problems.append(f"{where}: neither manifest form recognised ({INDEXTTS2_FORMS.hint}); fix the field names")
            continue
        text, problem = text_of(obj, form, where)
        if problem:
            problems.append(problem)
            continue
        lines.append(Line(number, obj, form, text))
    if not lines and not problems:
        problems.append(f"--manifests {path}: no manifest lines; check the file or leave it out")
    return lines, problems


def encode_lines(tok: Tokenizer, limits: Limits, manifest: Path, lines: list[Line],
                 language: str | None = None) -> list[str]:
    """Fill in each line's ids; return the problems (ids the trainer would refuse). IndexTTS-2.5 (a tiktoken
    tokenizer): each line in its language, its "language" field or else `language` (--language)."""
    problems = []
    if tok.family == "indextts25":
        problems = language_problems(manifest, lines, language)
        if problems:
            return problems
    for line, ids in zip(lines, tok.encode_lines([line.text for line in lines], [line.language for line in lines])):
        line.ids = ids
        where = f"{manifest}:{line.number}"
        if not ids:
            problems.append(f"{where}: the text {line.text!r} gives no ids, and the trainer refuses an empty text; "
                            "write the utterance's text or drop the line")
            continue
        if limits.max_text_tokens is not None and len(ids) > limits.max_text_tokens:
            problems.append(f"{where}: the text gives {len(ids)} ids, more than max_text_tokens "
                            f"{limits.max_text_tokens} ({limits.source}); split or drop this sample")
            continue
        positions = limits.positions_problem(len(ids), line.obj.get(line.form.code_len_key))
        if positions:
            problems.append(f"{where}: {positions}")
    return problems


def language_problems(manifest: Path, lines: list[Line], language: str | None) -> list[str]:
    """Each line's language (IndexTTS-2.5): its "language" field, else --language; one of the 106 codes."""
    from trainers.families.indextts25.languages import language_problem

    problems = []
    for line in lines:
        value = line.obj.get("language", language)
        where = f"{manifest}:{line.number}"
        if value is not None and type(value) is not str:
            problems.append(f'{where}: "language" is {value!r}, not a string; write the language code')
            continue
        problem = language_problem(value)
        if problem:
            problems.append(f"{where}: {problem}" + ("; or pass --language CODE for lines without one"
                                                     if value is None else ""))
        line.language = value
    return problems


def summarise(tok: Tokenizer, plan_manifest: Path, output: Path, lines: Sequence[Line]) -> Report:
    report = Report(str(plan_manifest), str(output), lines=len(lines))
    unk_texts = []
    for line in lines:
        unk, byte_tokens = tok.counts(line.ids)
        report.tokens += len(line.ids)
        report.unk += unk
        report.byte_tokens += byte_tokens
        report.max_text_len = max(report.max_text_len, len(line.ids))
        if unk:
            report.lines_with_unk += 1
            unk_texts.append(line.text)
            report.first_line_with_unk = report.first_line_with_unk or f"{plan_manifest}:{line.number}"
    report.unk_rate = report.unk / report.tokens if report.tokens else 0.0
    report.unknown_chars = tok.unknown_chars(unk_texts)
    return report
