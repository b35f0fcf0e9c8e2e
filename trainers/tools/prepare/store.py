"""The output folder of indextts-prepare, and how every write into it survives a kill at any instant.

    OUT/features/         the feature files, each written to a temporary (.NAME.tmp-HOST-PID), fsynced and
                          renamed into place: a file is complete or absent, never half-written (a batch's
                          temporaries are written and fsynced by several threads at once, then renamed in order)
    OUT/.prepare/plan.json          what the features are made from (fingerprints); written once, atomically
    OUT/.prepare/records-I-of-N.jsonl  shard I/N's record of each utterance it finished: kept (its files, their
                          sizes, its lengths) or skipped (why). Appended and fsynced after the utterance's files
                          were renamed and their folder fsynced, so a record always means complete files. A line
                          torn by a kill is cut off when the shard opens its record again.
    OUT/*.jsonl, skipped.txt, prepare_summary.json  written by the merge (manifests.py), each atomically

A rerun with the same command reads every record (of every shard), keeps those whose line is unchanged and
whose files are all there at their recorded sizes, and makes the rest: each utterance ends up in the manifests
once, and a kill costs at most the batch it interrupted. Temporaries left by killed runs are removed by the merge.

Fault points for the tests (INDEXTTS_PREPARE_KILL_AT, the trainer's syntax: trainers/faults.py), each counted
from 1 in the process: plan (plan.json written); feature_tmp:K (the K-th feature file about to be renamed: its
temporary, and those of its batch, fsynced); feature:K (renamed); record:K (the K-th batch's records fsynced);
manifest_tmp:K / manifest:K (the K-th file the merge writes, before / after its rename); merged (the merge done).
"""
from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import socket
import zipfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainers.errors import UserError
from trainers.faults import KillPoint
from trainers.files import fsync_dir
from trainers.tools.prepare.settings import Shard

STATE_DIR = ".prepare"
PLAN_NAME = "plan.json"
FEATURES_DIR = "features"
KILL_VAR = "INDEXTTS_PREPARE_KILL_AT"
WRITERS = 8  # threads writing and fsyncing a batch's feature files at once
FORMAT_VERSION = 1  # of the files written here; bumped when they change
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # every .npz member's date: the same bytes on every run


@dataclass
class Faults:
    """Kill points of this process (KILL_VAR), counted per point."""

    kill: KillPoint = field(default_factory=lambda: KillPoint.from_env(KILL_VAR))
    counts: Counter = field(default_factory=Counter)

    def at(self, point: str) -> None:
        self.counts[point] += 1
        if self.kill.points:
            self.kill.check(point, self.counts[point])


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz archive as np.load reads it, with fixed member dates (np.savez stamps the clock: other bytes per run)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            archive.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME), npy_bytes(array))
    return buffer.getvalue()


def owner(key: str, count: int) -> int:
    """The shard (1..count) an utterance id (or a line's source) belongs to: the same on every machine and run."""
    import hashlib

    return int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big") % count + 1


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def is_temporary(name: str) -> bool:
    return name.startswith(".") and ".tmp-" in name


class Store:
    """OUT and its state folder."""

    def __init__(self, out: Path, faults: Faults | None = None) -> None:
        self.out = out
        self.state = out / STATE_DIR
        self.features = out / FEATURES_DIR
        self.faults = faults or Faults()
        self._pool: ThreadPoolExecutor | None = None  # write_features' writers, made on first use

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # --- the plan -----------------------------------------------------------------------------------

    def read_plan(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.state / PLAN_NAME).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise UserError(f"{self.state / PLAN_NAME} cannot be read ({exc}); it records what the features in "
                            f"{self.out} were made from: restore it, or prepare into a new --out") from None

    def create(self, plan: dict[str, Any], written: tuple[str, ...] = ()) -> dict[str, Any]:
        """Write the plan unless one is there (another shard may be writing it now): the plan that holds. A folder
        without a plan that already holds a file the preparation writes (`written`, or features) is refused: that
        file is someone else's and would be replaced."""
        if not (self.state / PLAN_NAME).exists():
            found = [name for name in (*written, FEATURES_DIR) if (self.out / name).exists()
                     and not (name == FEATURES_DIR and not any((self.out / name).iterdir()))]
            if found:
                raise UserError(f"--out {self.out} already holds {', '.join(found)}, not written by indextts-prepare "
                                f"(it has no {STATE_DIR}/{PLAN_NAME}); pass another --out, or move them away")
        try:
            self.features.mkdir(parents=True, exist_ok=True)
            self.state.mkdir(exist_ok=True)
        except OSError as exc:
            raise UserError(f"--out {self.out}: cannot create it ({exc.strerror or exc}); pass a writable folder") \
                from None
        path = self.state / PLAN_NAME
        tmp = _tmp_name(path)
        self._write(tmp, (json.dumps(plan, indent=1, sort_keys=True) + "\n").encode("utf-8"))
        try:
            os.link(tmp, path)  # fails if the plan exists: the first writer's stands
            fsync_dir(self.state)
            self.faults.at("plan")
            return plan
        except FileExistsError:
            return self.read_plan() or plan
        finally:
            tmp.unlink(missing_ok=True)

    def replace_plan(self, plan: dict[str, Any]) -> None:
        self.write_file(self.state / PLAN_NAME, (json.dumps(plan, indent=1, sort_keys=True) + "\n").encode("utf-8"))

    # --- feature files -----------------------------------------------------------------------------------

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def write_features(self, files: list[tuple[str, bytes]]) -> dict[str, int]:
        """Each (name under features/, bytes) written atomically: every temporary written and fsynced (by
        WRITERS threads at once: a file system commits concurrent fsyncs together, 4-7x faster than one by one),
        then each renamed into place, then the folder fsynced once. Name -> size."""
        paths = [(self.features / name, _tmp_name(self.features / name)) for name, _ in files]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="prepare-write")
        try:
            list(self._pool.map(lambda job: self._write(job[0][1], job[1]), zip(paths, (data for _, data in files))))
            for path, tmp in paths:
                self.faults.at("feature_tmp")
                os.replace(tmp, path)
                self.faults.at("feature")
        except BaseException:
            for _, tmp in paths:
                tmp.unlink(missing_ok=True)  # a failure (disk full) leaves nothing; a SIGKILL cannot get here
            raise
        fsync_dir(self.features)
        return {name: len(data) for name, data in files}

    def write_file(self, path: Path, data: bytes, point: str | None = None) -> None:
        """One file of OUT replaced atomically (the merge's), with fault points `point_tmp` and `point`."""
        tmp = _tmp_name(path)
        try:
            self._write(tmp, data)
            if point:
                self.faults.at(f"{point}_tmp")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
        if point:
            self.faults.at(point)

    def remove_temporaries(self) -> int:
        """Remove the temporaries of killed runs (only when every shard has finished: the merge)."""
        removed = 0
        for folder in (self.features, self.state, self.out):
            if folder.is_dir():
                for entry in os.scandir(folder):
                    if is_temporary(entry.name) and entry.is_file():
                        os.unlink(entry.path)
                        removed += 1
        return removed

    def files_intact(self, sizes: dict[str, int]) -> bool:
        for name, size in sizes.items():
            try:
                if os.stat(self.features / name).st_size != size:
                    return False
            except OSError:
                return False
        return True

    # --- records -------------------------------------------------------------------------------------------

    def records(self, keys: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Every shard's record of each id in `keys` made from that key (the line as it is now); for a kept
        utterance, only one whose files are all there at their recorded sizes. Ids without such a record are
        left out: they are (made) again."""
        found: dict[str, dict[str, Any]] = {}
        if not self.state.is_dir():
            return found
        for path in sorted(self.state.glob("records-*.jsonl")):
            for record in _read_records(path):
                if keys.get(record["id"]) == record.get("key"):
                    found[record["id"]] = record
        return {i: r for i, r in found.items() if r.get("status") != "kept" or self.files_intact(r["sizes"])}

    def journal(self, shard: Shard) -> "Journal":
        return Journal(self.state / f"records-{shard.index}-of-{shard.count}.jsonl", shard, self.faults)


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a file: a last line without its newline (torn by a kill) is not one."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    records = []
    for line in data[: data.rfind(b"\n") + 1].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line of another writer torn mid-way (power loss); its utterance is made again
        if isinstance(record, dict) and isinstance(record.get("id"), str):
            records.append(record)
    return records


class Journal:
    """One shard's record file: locked for as long as the shard runs (a second process on it is refused)."""

    def __init__(self, path: Path, shard: Shard, faults: Faults) -> None:
        self.path, self.shard, self.faults = path, shard, faults
        self._fd: int | None = None

    def open(self) -> "Journal":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK):
                raise UserError(f"another indextts-prepare is preparing shard {self.shard} into "
                                f"{self.path.parent.parent} now; wait for it to finish, or stop it") from None
            raise
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        end = data.rfind(b"\n") + 1
        if end != len(data):  # a record torn by a kill: cut off, its utterance is made again
            os.ftruncate(fd, end)
            os.fsync(fd)
        os.lseek(fd, 0, os.SEEK_END)
        self._fd = fd
        return self

    def append(self, records: list[dict[str, Any]]) -> None:
        """The records of one batch, durable before this returns."""
        assert self._fd is not None
        data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)
        self.faults.at("record")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
