"""The utterance lists indextts-prepare reads, and what is wrong with a line of one.

Four layouts (--format, auto by default):

  jsonl     one JSON object a line: id, audio, text, speaker, language (aliases: audio_path, path, wav,
            audio_filepath; transcript, normalized_text; speaker_id, spk; lang). Without an id, the audio path
            (relative to the list's folder, no suffix) is the id.
  csv       a header line naming the same columns, separated by commas, tabs or | (the first of them the
            header holds); quoted fields as the csv module reads them
  ljspeech  LJSpeech's metadata.csv: no header, `id|text|normalized text` a line, the audio in wavs/ID.wav
            beside it; the normalized text is used where a line has one
  folder    a folder of audio files (WAV, and FLAC, MP3, ... where soundfile or librosa is installed), each
            with its transcript beside it as STEM.txt or STEM.lab; a file in a subfolder is that subfolder's
            speaker; the id is the path below the folder without its suffix

Audio paths are read relative to the list's folder. A line without a speaker is --speaker's (default: the input
folder's name), without a language --language's. Each line becomes an Entry, or a Problem naming its source
(`list.jsonl:LINE`, or the audio file for a folder) that the report prints and counts.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from trainers.errors import UserError
from trainers.files import file_sha256
from trainers.tools.prepare.audio import AUDIO_SUFFIXES

ALIASES = {
    "id": ("id", "utt_id", "utterance_id", "name"),
    "audio": ("audio", "audio_path", "path", "wav", "wav_path", "audio_filepath", "file"),
    "text": ("text", "transcript", "normalized_text", "sentence"),
    "speaker": ("speaker", "speaker_id", "spk"),
    "language": ("language", "lang"),
}
TRANSCRIPT_SUFFIXES = (".txt", ".lab")
DELIMITERS = (",", "\t", "|")


@dataclass(frozen=True)
class Entry:
    """One utterance of the list."""

    source: str  # how messages name it: "list.jsonl:12", or the audio file of a folder
    order: int  # its place in the list (0-based), the manifests' order
    id: str
    audio: Path
    text: str
    speaker: str
    language: str | None

    def key(self) -> str:
        """What the features of this id are made from, apart from the audio's bytes: a changed line has another."""
        blob = json.dumps([self.id, str(self.audio), self.text, self.speaker, self.language], ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class Problem:
    """A line that is skipped: where, what is wrong, what to do, and its reason (the summary's key)."""

    source: str
    reason: str
    what: str
    todo: str

    def __str__(self) -> str:
        return f"{self.source}: {self.what}; {self.todo}"


@dataclass
class Listing:
    """A list read: its entries (ids unique), its problems, and its fingerprint (the bytes it was read from)."""

    path: Path
    layout: str
    entries: list[Entry]
    problems: list[Problem]
    fingerprint: str
    lines: int  # entries + problems: the list's utterance lines


def detect_layout(path: Path) -> str:
    if path.is_dir():
        return "folder"
    if path.suffix.lower() == ".jsonl":
        return "jsonl"
    first = _first_line(path)
    if path.name.lower() == "metadata.csv" and "|" in first and not _header_names(first):
        return "ljspeech"
    if first.lstrip().startswith("{"):
        return "jsonl"
    return "csv"


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            return f.readline()
    except OSError as exc:
        raise UserError(f"--input {path}: {exc.strerror or exc}; pass the utterance list or a folder of audio") \
            from None


def _header_names(line: str) -> dict[str, int]:
    """Column index of each field a header line names (empty: not a header)."""
    delimiter = next((d for d in DELIMITERS if d in line), ",")
    cells = [c.strip().lower() for c in next(csv.reader([line], delimiter=delimiter), [])]
    return {field: cells.index(name) for field, names in ALIASES.items() for name in names if name in cells}


def read_input(path: Path, layout: str, default_speaker: str | None, default_language: str | None) -> Listing:
    """The entries and problems of --input. UserError (exit 2) when the input itself cannot be read."""
    if not path.exists():
        raise UserError(f"--input {path}: no such file or folder; pass the utterance list or a folder of audio")
    layout = detect_layout(path) if layout == "auto" else layout
    if (layout == "folder") != path.is_dir():
        raise UserError(f"--input {path}: --format {layout} needs {'a folder' if layout == 'folder' else 'a file'}")
    speaker = default_speaker or (path if path.is_dir() else path.parent).resolve().name or "speaker"
    reader = {"jsonl": _jsonl, "csv": _csv, "ljspeech": _ljspeech, "folder": _folder}[layout]
    entries: list[Entry] = []
    problems: list[Problem] = []
    first_of: dict[str, str] = {}
    for item in reader(path, speaker, default_language):
        if isinstance(item, Problem):
            problems.append(item)
        elif item.id in first_of:
            problems.append(Problem(item.source, "duplicate_id", f"id {item.id!r} was already used by "
                                    f"{first_of[item.id]}", "give each utterance its own id (this line is skipped)"))
        else:
            first_of[item.id] = item.source
            entries.append(Entry(item.source, len(entries), item.id, item.audio, item.text, item.speaker,
                                 item.language))
    fingerprint = _folder_fingerprint(entries, problems) if layout == "folder" else file_sha256(path)
    return Listing(path, layout, entries, problems, fingerprint, len(entries) + len(problems))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"--input {path}: not UTF-8 (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise UserError(f"--input {path}: {exc.strerror or exc}") from None


def _field(row: dict[str, Any], name: str) -> Any:
    for alias in ALIASES[name]:
        if alias in row and row[alias] not in (None, ""):
            return row[alias]
    return None


def _entry(source: str, row: dict[str, Any], base: Path, speaker: str, language: str | None) -> Entry | Problem:
    """An Entry from a row of named fields, or the Problem that skips it."""
    audio, text = _field(row, "audio"), _field(row, "text")
    missing = [name for name, value in (("audio", audio), ("text", text)) if value is None]
    if missing:
        return Problem(source, "bad_line", f"no {' and no '.join(missing)} field (it has "
                       f"{', '.join(map(str, row)) or 'none'})", f"add {' and '.join(missing)} (accepted names: "
                       f"{'; '.join(', '.join(ALIASES[m]) for m in missing)})")
    values = {"id": _field(row, "id"), "audio": audio, "text": text, "speaker": _field(row, "speaker"),
              "language": _field(row, "language")}
    wrong = [k for k, v in values.items() if v is not None and not isinstance(v, (str, int))]
    if wrong:
        return Problem(source, "bad_line", f"{', '.join(wrong)} must be text, got "
                       f"{', '.join(type(values[k]).__name__ for k in wrong)}", "write them as strings")
    audio_path = base / str(audio)
    utt_id = str(values["id"]) if values["id"] is not None else _id_of(Path(str(audio)))
    return Entry(source, -1, utt_id, audio_path, str(text).strip(), str(values["speaker"] or speaker),
                 str(values["language"]) if values["language"] is not None else language)


def _id_of(relative: Path) -> str:
    return relative.with_suffix("").as_posix()


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(number, line) of a text file, split at newlines only, as an editor numbers them (splitlines() would also
    split at U+2028, which a JSON string may hold unescaped)."""
    for number, line in enumerate(_read_text(path).split("\n"), start=1):
        yield number, line.removesuffix("\r")


def _jsonl(path: Path, speaker: str, language: str | None) -> Iterator[Entry | Problem]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        source = f"{path.name}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            yield Problem(source, "bad_line", f"not JSON ({exc.msg} at column {exc.colno})",
                          "write one JSON object per line")
            continue
        if not isinstance(row, dict):
            yield Problem(source, "bad_line", f"a JSON {type(row).__name__}, not an object",
                          "write one JSON object per line")
            continue
        yield _entry(source, row, path.parent, speaker, language)


def _csv(path: Path, speaker: str, language: str | None) -> Iterator[Entry | Problem]:
    text = _read_text(path)
    header = text.split("\n", 1)[0]
    columns = _header_names(header)
    if "audio" not in columns or "text" not in columns:
        raise UserError(f"--input {path}: its first line is not a header naming the audio and text columns (it is "
                        f"{header[:80]!r}); add a header such as id,audio,text,speaker,language, or pass --format "
                        "ljspeech for an LJSpeech metadata.csv")
    delimiter = next((d for d in DELIMITERS if d in header), ",")
    reader = csv.reader(io.StringIO(text), delimiter=delimiter)
    next(reader)
    start = reader.line_num
    for cells in reader:
        number, start = start + 1, reader.line_num
        if not any(c.strip() for c in cells):
            continue
        source = f"{path.name}:{number}"
        if len(cells) <= max(columns.values()):
            yield Problem(source, "bad_line", f"{len(cells)} fields where the header has {max(columns.values()) + 1}",
                          f"write every field (separated by {delimiter!r}; quote fields holding it)")
            continue
        yield _entry(source, {name: cells[i].strip() for name, i in columns.items()}, path.parent, speaker, language)


def _ljspeech(path: Path, speaker: str, language: str | None) -> Iterator[Entry | Problem]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        source = f"{path.name}:{number}"
        cells = line.split("|")
        if len(cells) < 2 or not cells[0].strip():
            yield Problem(source, "bad_line", "not `id|text` or `id|text|normalized text`",
                          "fix the line (LJSpeech's metadata.csv has no header)")
            continue
        text = cells[2] if len(cells) > 2 and cells[2].strip() else cells[1]
        utt_id = cells[0].strip()
        yield Entry(source, -1, utt_id, path.parent / "wavs" / f"{utt_id}.wav", text.strip(), speaker, language)


def _folder(path: Path, speaker: str, language: str | None) -> Iterator[Entry | Problem]:
    for audio in sorted(p for p in path.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file()):
        relative = audio.relative_to(path)
        source = relative.as_posix()
        transcript = next((audio.with_suffix(s) for s in TRANSCRIPT_SUFFIXES if audio.with_suffix(s).is_file()), None)
        if transcript is None:
            yield Problem(source, "bad_line", f"has no transcript {audio.stem}.txt or {audio.stem}.lab beside it",
                          "add one, or move the audio out of the folder")
            continue
        try:
            text = transcript.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            yield Problem(source, "bad_line", f"its transcript {transcript.name} cannot be read as UTF-8 ({exc})",
                          "save the transcript as UTF-8")
            continue
        who = relative.parts[0] if len(relative.parts) > 1 else speaker
        yield Entry(source, -1, _id_of(relative), audio, " ".join(text.split()), who, language)


def _folder_fingerprint(entries: list[Entry], problems: list[Problem]) -> str:
    """A folder's listing: each audio file's path and transcript (the audio's own bytes are checked per clip)."""
    listing = [(e.source, e.text, e.speaker) for e in entries] + [(p.source, p.what) for p in problems]
    return hashlib.sha256(json.dumps(listing, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()
