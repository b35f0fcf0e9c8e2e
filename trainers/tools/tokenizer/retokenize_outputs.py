"""Writing the outputs: the id files' paths, the new manifest's lines (*_path fields re-rooted at
--output-dir), the check that no output collides with another or replaces an input, and the
atomic writes of the .npy id files and then the manifest."""
from __future__ import annotations

import functools
import io
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from trainers.files import file_identity, temp_path
from trainers.tools.tokenizer.retokenize_lines import Line, Plan

IDS_DIR = "text_ids"


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
    if line.language is not None:
        row.setdefault("language", line.language)  # from --language: the trainer reads it from the line
    return row


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
    # os.path.realpath that resolves each folder once: manifests name many files in few folders. A file that is
    # itself a symlink is caught by the inode comparison below.
    real_folder = functools.cache(os.path.realpath)

    def real(path: Path | str) -> str:
        folder, name = os.path.split(os.path.abspath(path))
        return os.path.join(real_folder(folder), name)

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
                identity = file_identity(out)
                if identity is None:
                    continue  # nothing there: it cannot be an input
                if inodes is None:  # a hard link or a symlink to an input is that input too
                    found = ((file_identity(path), given) for path, given in inputs.items())
                    inodes = {ident: given for ident, given in found if ident is not None}
                hit = inodes.get(identity)
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
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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
