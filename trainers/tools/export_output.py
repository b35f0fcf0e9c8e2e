"""The --out directory of an export (tools/export_checkpoint.py): what it may replace, export.json, atomic writes.

An export never replaces a file it did not write: a file may be replaced only if export.json,
written by an earlier export into the same directory, lists it with the sha256 it still has.
Every file is written under a temporary name, fsynced and renamed; while the renames happen
export.json lists both the old and the new files, so a killed export leaves no half-written file
and the next export into the same directory is not refused.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainers.errors import UserError
from trainers.files import file_sha256, fsync_dir, temp_path, write_fsynced, write_text_atomically

RECORD_NAME = "export.json"
RECORD_FORMAT = "indextts2-gpt-export/1"


# ---------------------------------------------------------------- the output directory

@dataclass
class Record:
    """export.json of an earlier export: for each file it wrote, the sha256 it may have."""

    files: dict[str, set[str]]
    hashes: dict[Path, str] = field(default_factory=dict)  # of the files checked, so each is read once

    @classmethod
    def read(cls, out: Path) -> "Record | None":
        path = out / RECORD_NAME
        if not path.exists() and not path.is_symlink():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data["format"] != RECORD_FORMAT:
                raise ValueError(data["format"])
            entries = [*data["files"].items(), *data.get("pending", {}).items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            entries = None
        if entries is None or not all(isinstance(v, str) and _plain_name(k) for k, v in entries):
            raise UserError(f"{path} is not a record written by this tool; choose another --out directory (an "
                            "export never replaces files it did not write)")
        files: dict[str, set[str]] = {}
        for name, sha in entries:
            files.setdefault(name, set()).add(sha)
        return cls(files)

    def wrote(self, name: str, path: Path) -> str | None:
        """The sha256 of `path` if it is a file an export wrote under `name`, unchanged since; else None."""
        if name not in self.files or not path.is_file() or path.is_symlink():
            return None
        if path not in self.hashes:
            self.hashes[path] = file_sha256(path)
        return self.hashes[path] if self.hashes[path] in self.files[name] else None


def _plain_name(name: str) -> bool:
    return isinstance(name, str) and name == Path(name).name and not name.startswith(".")


def check_output(out: Path, names: list[str]) -> Record | None:
    """Refuse unless every file the export writes is new or was written, unchanged, by an earlier export."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory (it is created if missing)")
    if not out.is_dir():
        return None
    record = Record.read(out)
    foreign = [n for n in names if (out / n).exists() or (out / n).is_symlink()]
    foreign = [n for n in foreign if record is None or record.wrote(n, out / n) is None]
    if foreign:
        raise UserError(f"--out {out} already holds {', '.join(foreign)}, which this tool did not write (or which "
                        f"changed since; {RECORD_NAME} records what an export wrote): nothing was written. Choose an "
                        "empty or new directory, or move those files away")
    return record


def _remove_temporaries(out: Path, names: list[str]) -> None:
    """Temporaries of a killed export into this directory."""
    pattern = re.compile(r"^\.(" + "|".join(re.escape(n) for n in names) + r")\.tmp-[0-9]+$")
    for entry in out.iterdir():
        if pattern.match(entry.name) and (entry.is_file() or entry.is_symlink()):
            entry.unlink(missing_ok=True)


def write_export(out: Path, files: dict[str, Callable[[Any], None]], record: Record | None,
                 info: dict[str, Any]) -> dict[str, str]:
    """Write `files` (name -> writer of its bytes) into `out` atomically; their sha256. UserError if a write fails."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        previous = record.files if record else {}
        _remove_temporaries(out, [*files, *previous])
        temps: dict[str, tuple[Path, str]] = {}
        try:
            for name, write in files.items():
                tmp = temp_path(out / name)
                write_fsynced(tmp, write)
                temps[name] = tmp, file_sha256(tmp)
        except BaseException:
            for tmp, _ in temps.values():
                tmp.unlink(missing_ok=True)
            raise
        new = {name: sha for name, (_, sha) in temps.items()}
        # Files an earlier export wrote that are still as it wrote them: replaced below, or removed
        # if this export does not write them again (a tokenizer of another name).
        kept = {name: sha for name in previous if record and (sha := record.wrote(name, out / name))}
        # While files are renamed the record accepts the old and the new bytes, so a kill here leaves
        # a directory the next export may still replace.
        _write_record(out, info, kept, pending=new)
        for name, (tmp, _) in temps.items():
            os.replace(tmp, out / name)
        with contextlib.suppress(OSError):  # a filesystem may refuse; the renames are still atomic
            fsync_dir(out)
        for name in kept:
            if name not in files:
                (out / name).unlink(missing_ok=True)
        _write_record(out, info, new)
        return new
    except OSError as exc:
        raise UserError(f"could not write into --out {out}: {exc.strerror or exc}; no file there is half-written"
                        ) from None


def _write_record(out: Path, info: dict[str, Any], files: dict[str, str], pending: dict[str, str] | None = None
                  ) -> None:
    data = {"format": RECORD_FORMAT, **info, "files": files}
    if pending is not None:
        data["pending"] = pending
    write_text_atomically(out / RECORD_NAME, json.dumps(data, indent=2) + "\n")

