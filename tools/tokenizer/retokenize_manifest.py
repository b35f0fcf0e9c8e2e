#!/usr/bin/env python3
"""Make the text ids of training manifests with a (new or extended) SentencePiece model.

    python tools/tokenizer/retokenize_manifest.py --tokenizer checkpoints/bpe_am.model \\
        --manifests data/am_train.jsonl data/am_val.jsonl --output-dir data/am_ids \\
        --config checkpoints/config.yaml

For each manifest line the text is turned into ids the way IndexTTS2 inference does it (below)
and saved as a 1-D int32 .npy without start/stop tokens, as the usual preprocessing saves
them. A NEW manifest of the same file name is written into --output-dir, pointing at them:

    OUT/<manifest file name>                     the new manifest
    OUT/text_ids/<manifest name without suffix>/<line number>.npy

Manifest lines: the paired form (prompt_condition_path + target_codes_path) takes its text from
"target_text" and gets "target_text_ids_path" / "target_text_len"; the single-utterance form
(text_ids_path, codes_path, condition_path, ...) takes "text" (or "target_text" where a line
has no "text") and gets "text_ids_path" / "text_len". The form is recognised as the trainer
does (trainers/manifest.py); the ids fields are replaced where present, added where not.
Every other field keeps its value and place; the JSON is re-serialised (UTF-8, one object per
line, blank lines dropped). Paths: every other string field whose name ends in "_path" is
resolved from the input manifest's folder, as the trainer does, and rewritten relative to
--output-dir, so it still names the same file (absolute paths stay absolute). Other fields
are not touched, so a path kept in a field not named "*_path" must be absolute.

Text front end, as IndexTTS2's TextTokenizer.encode applies it before SentencePiece:
  1. empty text gives no ids; text that is a single character once stripped is encoded as is
     (no upper-casing);
  2. [SKIPPED] the language normaliser (TextNormalizer: WeTextProcessing for English and
     Chinese - numbers, dates, contractions, pinyin, punctuation maps - and the Japanese /
     Amharic rules of community forks). It is not available here and is not imitated: write the
     manifest text as the normaliser would leave it (numbers in words, ...), or the ids made
     here differ from what inference makes for the same text;
  3. the CJK pre-tokeniser: the line is stripped, split around every character of U+1100-11FF,
     U+2E80-A4CF, U+A840-D7AF, U+F900-FAFF, U+FE30-FE4F, U+FF65-FFDC, U+20000-2FFFF (each
     becomes its own word), each part stripped and UPPER-CASED, parts joined by single spaces;
  4. SentencePiece encoding of the result.

Refused (status 2, nothing written), every problem listed as "file:line: what; what to do":
a line that is not a JSON object in a known form, a missing or non-string text field, a single
line whose "text" and "target_text" differ, text that gives no ids, more ids than --max-text-tokens (default: gpt.max_text_tokens of --config),
a sample longer than the model's position tables (with --config), a tokenizer that can emit the
start/stop text ids (0 and 1, or gpt.start/stop_text_token of --config: they must be control
pieces such as <s> and </s>), an unreadable tokenizer or config, an output that would replace
an input. <unk> is reported (count, rate, lines, the characters without a piece), not refused;
a tokenizer with lower-case letters and no upper-case ones (trained on text that was not
upper-cased, so every Latin letter becomes <unk> after IndexTTS2's upper-casing) is warned about.

Writing: each file goes to a temporary file in its folder and is renamed into place; the ids
of a manifest are written before the manifest, so a manifest never names a missing file; an
.npy that already holds the same bytes is left alone. Running the tool twice gives the same
bytes. Files of an earlier run that the new manifest no longer names are not removed.

Exit status: 0 written, 2 refused (nothing written), 1 writing failed part-way (disk full,
permissions: the message says which manifests were completed).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import sentencepiece as spm

EXIT_OK, EXIT_WRITE_FAILED, EXIT_REFUSED = 0, 1, 2
MAX_LISTED_PROBLEMS = 30
MAX_LISTED_CHARS = 20
IDS_DIR = "text_ids"
START_TEXT_TOKEN, STOP_TEXT_TOKEN = 0, 1  # official config; --config may say otherwise
PREFIX_POSITIONS = 34  # 32 conditioning vectors + 2 speed embeddings

CJK_RANGES = ((0x1100, 0x11FF), (0x2E80, 0xA4CF), (0xA840, 0xD7AF), (0xF900, 0xFAFF),
              (0xFE30, 0xFE4F), (0xFF65, 0xFFDC), (0x20000, 0x2FFFF))
_CJK_CHAR = re.compile("([" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in CJK_RANGES) + "])")

SKIPPED_NORMALISATION = (
    "language normalisation SKIPPED: IndexTTS2's TextNormalizer (WeTextProcessing for en/zh: numbers, dates, "
    "contractions, pinyin, punctuation maps; the ja/am rules of forks) is not available and not imitated; "
    "the text must already be written as it would leave the normaliser, or inference will see other ids")
APPLIED_FRONT_END = (
    "front end applied: empty text -> no ids; a single (stripped) character encoded as is; otherwise the CJK "
    "pre-tokeniser (strip, split around CJK characters, UPPER-CASE, join with single spaces), then SentencePiece")


class Refusal(Exception):
    """Input problems; nothing is written. Each entry is one 'where: what; what to do' line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class WriteFailure(Exception):
    """Writing an output failed after others were written."""


# ----------------------------------------------------------------------------- front end

def pre_tokenize(text: str) -> str:
    """IndexTTS2's CJK pre-tokeniser: every CJK character its own word, parts upper-cased."""
    parts = (part.strip() for part in _CJK_CHAR.split(text.strip()))
    return " ".join(part.upper() for part in parts if part)


def front_end(text: str) -> str:
    """The string IndexTTS2 hands to SentencePiece for ``text``, language normalisation aside."""
    if not text:
        return ""
    if len(text.strip()) == 1:
        return text  # as is: not stripped, not upper-cased
    return pre_tokenize(text)


# ----------------------------------------------------------------------------- tokenizer

@dataclass
class Tokenizer:
    path: Path
    sp: spm.SentencePieceProcessor
    start: int
    stop: int

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode([front_end(t) for t in texts], out_type=int)

    def unknown_chars(self, texts: Sequence[str]) -> list[str]:
        """Characters that SentencePiece turns into <unk> on their own, in code-point order."""
        chars = sorted({c for t in texts for c in front_end(t) if not c.isspace()})
        unk = self.sp.unk_id()
        return [c for c, ids in zip(chars, self.sp.encode(chars, out_type=int)) if unk in ids]

    def looks_lower_case(self) -> bool:
        """Cased letters in its text pieces, none upper-case: trained on text that was not upper-cased."""
        sp = self.sp
        cased = {c for i in range(sp.get_piece_size())
                 if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))
                 for c in sp.id_to_piece(i) if c.islower() or c.isupper()}
        return bool(cased) and not any(c.isupper() for c in cased)


def load_tokenizer(path: Path, start: int, stop: int) -> Tokenizer:
    if not path.is_file():
        raise Refusal([f"--tokenizer {path}: no such file; pass the SentencePiece .model the trainer will use"])
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as exc:
        raise Refusal([f"--tokenizer {path} is not a SentencePiece model ({str(exc).strip()}); pass the .model "
                       "file (e.g. checkpoints/bpe.model), not the .vocab"]) from None
    problems = []
    for name, token in (("start", start), ("stop", stop)):
        if token >= sp.get_piece_size() or not sp.is_control(token):
            what = f"has only {sp.get_piece_size()} pieces" if token >= sp.get_piece_size() else \
                f"has {sp.id_to_piece(token)!r} as id {token}, a piece SentencePiece emits for text"
            problems.append(
                f"--tokenizer {path} {what}, but IndexTTS2 reads id {token} as the {name} text token "
                f"(gpt.{name}_text_token), so such ids would be taken for it; use a tokenizer whose ids "
                f"{start} and {stop} are the control pieces <s> and </s>, as the official bpe.model "
                "(SentencePiece training: --bos_id=0 --eos_id=1 --unk_id=2)")
    if problems:
        raise Refusal(problems)
    return Tokenizer(path, sp, start, stop)


# ----------------------------------------------------------------------------- limits

@dataclass(frozen=True)
class Limits:
    max_text_tokens: int | None = None
    max_mel_tokens: int | None = None
    source: str = "none"
    start: int = START_TEXT_TOKEN
    stop: int = STOP_TEXT_TOKEN

    def positions_problem(self, text_len: int, code_len: Any) -> str | None:
        """The trainer's check that a sample fits the text and mel position tables."""
        if self.max_text_tokens is None or self.max_mel_tokens is None or type(code_len) is not int:
            return None
        needed = PREFIX_POSITIONS + (text_len + 2) + (code_len + 2)
        room = (self.max_mel_tokens + 3) + (self.max_text_tokens + 2)
        if needed <= room:
            return None
        return (f"the sample needs {needed} positions ({PREFIX_POSITIONS}+({text_len}+2)+({code_len}+2)) but "
                f"(gpt.max_mel_tokens+3)+(gpt.max_text_tokens+2) is {room}, so the trainer refuses it; "
                "drop or split this sample")


def _config_int(gpt: dict, key: str, path: Path, required: bool) -> int | None:
    value = gpt.get(key)
    if value is None and not required:
        return None
    if type(value) is not int or value < (0 if key.endswith("_token") else 1):
        raise Refusal([f"--config {path}: gpt.{key} is {value!r}; it must be "
                       + ("a non-negative integer" if key.endswith("_token") else "a positive integer")
                       + " (is it an IndexTTS2 config.yaml?)"])
    return value


def resolve_limits(config: Path | None, max_text_tokens: int | None) -> Limits:
    if max_text_tokens is not None and max_text_tokens < 1:
        raise Refusal([f"--max-text-tokens {max_text_tokens} must be at least 1"])
    if config is None:
        source = "--max-text-tokens" if max_text_tokens is not None else "none"
        return Limits(max_text_tokens, None, source)
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is in requirements.txt
        raise Refusal(["--config needs pyyaml (pip install pyyaml), or pass --max-text-tokens instead"]) from None
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Refusal([f"--config {config}: no such file; pass the config.yaml the trainer will use"]) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise Refusal([f"--config {config}: cannot read it as YAML ({exc}); pass an IndexTTS2 config.yaml"]) from None
    gpt = data.get("gpt") if isinstance(data, dict) else None
    if not isinstance(gpt, dict):
        raise Refusal([f"--config {config}: no 'gpt' section; pass an IndexTTS2 config.yaml"])
    from_config = _config_int(gpt, "max_text_tokens", config, required=True)
    start = _config_int(gpt, "start_text_token", config, required=False)
    stop = _config_int(gpt, "stop_text_token", config, required=False)
    return Limits(
        max_text_tokens if max_text_tokens is not None else from_config,
        _config_int(gpt, "max_mel_tokens", config, required=False),
        "--max-text-tokens" if max_text_tokens is not None else f"{config} gpt.max_text_tokens",
        START_TEXT_TOKEN if start is None else start, STOP_TEXT_TOKEN if stop is None else stop)


# ----------------------------------------------------------------------------- manifests

@dataclass(frozen=True)
class Form:
    name: str
    text_keys: tuple[str, ...]  # the first one present is the text
    ids_key: str
    len_key: str
    code_len_key: str


PAIRED = Form("paired", ("target_text",), "target_text_ids_path", "target_text_len", "target_code_len")
SINGLE = Form("single", ("text", "target_text"), "text_ids_path", "text_len", "code_len")
# The keys trainers/manifest.py uses to tell the forms apart.
_SINGLE_KEYS = frozenset({"text_ids_path", "text_len", "codes_path", "code_len", "condition_path", "emo_vec_path"})
_PAIRED_KEYS = frozenset({"target_text_ids_path", "target_text_len", "target_codes_path", "target_code_len",
                          "prompt_condition_path", "prompt_emo_vec_path"})
_FORM_HINT = ("a paired line has prompt_condition_path and target_codes_path; a single-utterance line has "
              "text_ids_path, codes_path and condition_path")


def detect_form(obj: dict) -> Form | None:
    """The trainer's rule: paired with both paired keys, else single with any single key, else
    paired with any paired key."""
    if "prompt_condition_path" in obj and "target_codes_path" in obj:
        return PAIRED
    if not _SINGLE_KEYS.isdisjoint(obj):
        return SINGLE
    if not _PAIRED_KEYS.isdisjoint(obj):
        return PAIRED
    return None


@dataclass
class Line:
    number: int
    obj: dict
    form: Form
    text: str
    ids: list[int] = field(default_factory=list)


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


def _text_of(obj: dict, form: Form, where: str) -> tuple[str | None, str | None]:
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
            problems.append(f"{where}: neither manifest form recognised ({_FORM_HINT}); fix the field names")
            continue
        text, problem = _text_of(obj, form, where)
        if problem:
            problems.append(problem)
            continue
        lines.append(Line(number, obj, form, text))
    if not lines and not problems:
        problems.append(f"--manifests {path}: no manifest lines; check the file or leave it out")
    return lines, problems


def encode_lines(tok: Tokenizer, limits: Limits, manifest: Path, lines: list[Line]) -> list[str]:
    """Fill in each line's ids; return the problems (ids the trainer would refuse)."""
    problems = []
    for line, ids in zip(lines, tok.encode([line.text for line in lines])):
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


def summarise(tok: Tokenizer, plan_manifest: Path, output: Path, lines: Sequence[Line]) -> Report:
    sp = tok.sp
    report = Report(str(plan_manifest), str(output), lines=len(lines))
    unk_id = sp.unk_id()
    unk_texts = []
    for line in lines:
        counts = Counter(line.ids)
        unk = counts.get(unk_id, 0)
        report.tokens += len(line.ids)
        report.unk += unk
        report.byte_tokens += sum(n for i, n in counts.items() if sp.is_byte(i))
        report.max_text_len = max(report.max_text_len, len(line.ids))
        if unk:
            report.lines_with_unk += 1
            unk_texts.append(line.text)
            report.first_line_with_unk = report.first_line_with_unk or f"{plan_manifest}:{line.number}"
    report.unk_rate = report.unk / report.tokens if report.tokens else 0.0
    report.unknown_chars = tok.unknown_chars(unk_texts)
    return report


# ----------------------------------------------------------------------------- outputs

def ids_relpath(manifest: Path, number: int) -> str:
    return f"{IDS_DIR}/{manifest.stem}/{number:07d}.npy"


def rewrite_line(line: Line, source_dir: str, out_dir: str, ids_path: str) -> dict:
    """The line for the new manifest: new ids fields, other *_path fields re-rooted at out_dir."""
    form = line.form
    row = {}
    for key, value in line.obj.items():
        if key == form.ids_key:
            value = ids_path
        elif key == form.len_key:
            value = len(line.ids)
        elif key.endswith("_path") and type(value) is str and value and not os.path.isabs(value):
            target = os.path.normpath(os.path.join(source_dir, value))
            try:
                value = os.path.relpath(target, out_dir)
            except ValueError:  # another drive (Windows): no relative path exists
                value = target
        row[key] = value
    row.setdefault(form.ids_key, ids_path)
    row.setdefault(form.len_key, len(line.ids))
    return row


class _RealPaths:
    """os.path.realpath that resolves each folder once: manifests name many files in few folders.
    A file that is itself a symlink is caught by the inode comparison in output_problems."""

    def __init__(self) -> None:
        self.folders: dict[str, str] = {}

    def __call__(self, path: Path | str) -> str:
        folder, name = os.path.split(os.path.abspath(path))
        real = self.folders.get(folder)
        if real is None:
            real = self.folders[folder] = os.path.realpath(folder)
        return os.path.join(real, name)


def input_paths(plans: Sequence[Plan]) -> list[str]:
    """Every file an input names: the manifests and each line's *_path fields, resolved."""
    paths = []
    for plan in plans:
        paths.append(str(plan.manifest))
        base = os.path.dirname(os.path.abspath(plan.manifest))
        for line in plan.lines:
            paths += [os.path.join(base, v) for k, v in line.obj.items()
                      if k.endswith("_path") and type(v) is str and v]
    return paths


def output_problems(plans: Sequence[Plan], out_dir: Path, extra_inputs: Sequence[Path]) -> list[str]:
    """Outputs that would collide with each other or replace an input."""
    if out_dir.exists() and not out_dir.is_dir():
        return [f"--output-dir {out_dir} exists and is not a folder; pass a folder path"]
    real = _RealPaths()
    problems = []
    by_stem: dict[str, Path] = {}
    for plan in plans:
        other = by_stem.setdefault(plan.manifest.stem, plan.manifest)
        if other is plan.manifest:
            continue
        if real(other) == real(plan.manifest):
            problems.append(f"--manifests {plan.manifest} is given twice; give each manifest once")
        else:
            problems.append(f"--manifests {other} and {plan.manifest} would both be written as "
                            f"{out_dir / plan.manifest.stem}...; rename one, or retokenize them into different "
                            "--output-dir folders")
    if problems:
        return problems
    inputs = {real(p): p for p in [*input_paths(plans), *extra_inputs]}
    inodes: dict[tuple[int, int], str | Path] | None = None  # built when an output already exists
    for plan in plans:
        for out in [plan.output] + [out_dir / ids_relpath(plan.manifest, line.number) for line in plan.lines]:
            hit = inputs.get(real(out))
            if hit is None:
                try:
                    st = os.stat(out)
                except OSError:
                    continue  # nothing there: it cannot be an input
                if inodes is None:  # a hard link or a symlink to an input is that input too
                    inodes = {}
                    for path, given in inputs.items():
                        with contextlib.suppress(OSError):
                            info = os.stat(path)
                            inodes[(info.st_dev, info.st_ino)] = given
                hit = inodes.get((st.st_dev, st.st_ino))
            if hit is not None:
                return [f"--output-dir {out_dir}: writing {out} would replace the input {os.path.normpath(hit)}; "
                        "choose an --output-dir that holds no input (e.g. a new folder next to the manifest)"]
    return []


def npy_bytes(ids: Sequence[int]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(ids, dtype="<i4"), allow_pickle=False)
    return buffer.getvalue()


def write_atomic(path: Path, data: bytes, *, sync: bool = False) -> bool:
    """Write through a temporary file and a rename; skip a file that already holds ``data``.
    Return whether the file was (re)written."""
    try:
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return True


def write_plan(plan: Plan, out_dir: Path) -> int:
    """Write a manifest's ids, then the manifest; return how many of these len(lines) + 1 files
    were (re)written."""
    source_dir = os.path.dirname(os.path.abspath(plan.manifest))
    out_abs = os.path.abspath(out_dir)
    rows, written = [], 0
    for line in plan.lines:
        rel = ids_relpath(plan.manifest, line.number)
        written += write_atomic(out_dir / rel, npy_bytes(line.ids))
        rows.append(json.dumps(rewrite_line(line, source_dir, out_abs, rel), ensure_ascii=False))
    written += write_atomic(plan.output, ("\n".join(rows) + "\n").encode("utf-8"), sync=True)
    return written


# ----------------------------------------------------------------------------- driver

@dataclass(frozen=True)
class Config:
    tokenizer: Path
    manifests: tuple[Path, ...]
    output_dir: Path
    config: Path | None = None
    max_text_tokens: int | None = None


def plan_all(cfg: Config) -> tuple[Tokenizer, Limits, list[Plan]]:
    """Read, encode and check everything; raise Refusal listing every problem."""
    limits = resolve_limits(cfg.config, cfg.max_text_tokens)
    tok = load_tokenizer(cfg.tokenizer, limits.start, limits.stop)
    plans, problems = [], []
    for manifest in cfg.manifests:
        lines, found = read_manifest(manifest)
        problems += found
        problems += encode_lines(tok, limits, manifest, lines)
        output = cfg.output_dir / manifest.name
        plans.append(Plan(manifest, output, lines, summarise(tok, manifest, output, lines)))
    if problems:
        raise Refusal(problems)
    extra = [cfg.tokenizer] + ([cfg.config] if cfg.config else [])
    problems = output_problems(plans, cfg.output_dir, extra)
    if problems:
        raise Refusal(problems)
    return tok, limits, plans


def report_text(report: Report) -> list[str]:
    lines = [f"report {report.manifest} -> {report.output}: lines={report.lines} tokens={report.tokens} "
             f"unk={report.unk} unk_rate={report.unk_rate:.6f} lines_with_unk={report.lines_with_unk} "
             f"byte_tokens={report.byte_tokens} max_text_len={report.max_text_len}"]
    if report.lines_with_unk:
        chars = " ".join(repr(c) for c in report.unknown_chars[:MAX_LISTED_CHARS])
        more = len(report.unknown_chars) - MAX_LISTED_CHARS
        lines.append(f"  first line with <unk>: {report.first_line_with_unk}; characters the tokenizer has no piece "
                     f"for: {chars or '-'}" + (f" and {more} more" if more > 0 else ""))
    return lines


def retokenize(cfg: Config, out=None, err=None) -> list[Report]:
    """Check everything, then write; raise Refusal (nothing written) or WriteFailure."""
    out = out or sys.stdout
    err = err or sys.stderr
    tok, limits, plans = plan_all(cfg)
    print(APPLIED_FRONT_END, file=out)
    print(SKIPPED_NORMALISATION, file=out)
    print(f"tokenizer {cfg.tokenizer}: {tok.sp.get_piece_size()} pieces; max_text_tokens "
          f"{limits.max_text_tokens if limits.max_text_tokens is not None else 'not checked'} ({limits.source})",
          file=out)
    if tok.looks_lower_case():
        print(f"warning: --tokenizer {cfg.tokenizer} has lower-case letters and no upper-case ones, but IndexTTS2 "
              "upper-cases text before tokenizing, so Latin letters become <unk> (here and at inference). Use a "
              "tokenizer trained on upper-cased text, as the official bpe.model is", file=err)
    done: list[str] = []
    for plan in plans:
        try:
            written = write_plan(plan, cfg.output_dir)
        except OSError as exc:
            finished = ", ".join(done) or "none"
            raise WriteFailure(f"cannot write {exc.filename or plan.output}: {exc.strerror or exc}; manifests "
                               f"completed: {finished}; {plan.output} was not written (its ids may be partly "
                               "written); fix the cause and run the same command again") from None
        done.append(str(plan.output))
        for line in report_text(plan.report):
            print(line, file=out)
        ids_dir = cfg.output_dir / IDS_DIR / plan.manifest.stem
        print(f"  wrote {plan.output} and {len(plan.lines)} id files under {ids_dir} ({written} of "
              f"{len(plan.lines) + 1} files changed; the others already held these bytes)", file=out)
    if any(p.report.lines_with_unk for p in plans):
        print("warning: some lines hold <unk> ids (see the report lines); the model learns nothing useful from "
              "them: extend the tokenizer (tools/tokenizer/extend_bpe.py) or fix the text", file=err)
    return [p.report for p in plans]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise Refusal([f"{message} (see --help)"])


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = _Parser(prog="retokenize_manifest.py", description=doc.split("\n\n")[0],
                epilog="\n\n".join([
                    f"Writes OUT/<manifest file name> and OUT/{IDS_DIR}/<manifest name without suffix>/<line>.npy "
                    "(1-D int32, no start/stop tokens). The other *_path fields of each line are rewritten relative "
                    "to OUT (absolute ones are kept); all other fields keep their values.",
                    APPLIED_FRONT_END + ".", SKIPPED_NORMALISATION + ".",
                    "Exit status: 0 written; 2 refused, nothing written (every problem is listed as file:line); "
                    "1 a write failed part-way."]),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="SentencePiece .model to make the ids with (the one you will pass to the trainer)")
    p.add_argument("--manifests", type=Path, nargs="+", required=True,
                   help="JSONL manifests (paired or single-utterance form); never modified")
    p.add_argument("--output-dir", type=Path, required=True,
                   help=f"folder for the new manifests (same file names) and their ids ({IDS_DIR}/...); "
                        "it must not hold an input")
    p.add_argument("--config", type=Path,
                   help="IndexTTS2 config.yaml: its gpt.max_text_tokens is the default limit, gpt.max_mel_tokens "
                        "checks the sample fits, gpt.start/stop_text_token are the ids text must not produce")
    p.add_argument("--max-text-tokens", type=int,
                   help="refuse lines with more ids than this (default: gpt.max_text_tokens of --config; without "
                        "either, no limit is checked)")
    return p


def parse_config(argv: Sequence[str] | None) -> Config:
    args = build_parser().parse_args(argv)
    return Config(args.tokenizer, tuple(args.manifests), args.output_dir, args.config, args.max_text_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        retokenize(parse_config(argv))
    except Refusal as exc:
        for problem in exc.problems[:MAX_LISTED_PROBLEMS]:
            print(f"error: {problem}", file=sys.stderr)
        if len(exc.problems) > MAX_LISTED_PROBLEMS:
            print(f"error: ... and {len(exc.problems) - MAX_LISTED_PROBLEMS} more problems", file=sys.stderr)
        print(f"error: nothing written ({len(exc.problems)} problem(s))", file=sys.stderr)
        return EXIT_REFUSED
    except WriteFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
