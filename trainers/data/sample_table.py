"""The samples of a run as one compact table: numpy columns and string pools, no Python object per sample.

A list of Sample objects costs about 1.5 KB per sample (the objects, their strings, the allocator's
fragments), and forked loader workers copy the pages of every object they touch, since reading a
Python object writes its reference count. Here a sample is 40 bytes of int32 columns plus its id,
and every feature file, folder, speaker and language is stored once. The arrays are never written
after the table is built, so forked workers share them; a table read from the run's data cache
(trainers.data.manifest_cache) is memory-mapped, so the processes of a torchrun job share one copy
too. A Sample is made only when one sample is asked for (table[i]).
"""
from __future__ import annotations

import operator
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, overload

import numpy as np

# Per sample, int32: lengths, where the line is (manifest index, line number), language and speaker
# (-1: none) and the four feature files (indices into the file pool).
SAMPLE_COLUMNS = ("text_len", "code_len", "manifest", "line", "lang", "speaker",
                  "text_ids", "codes", "condition", "emo_vec")
# The roles of a sample's files (several may name one archive); "condition" is the prompt's conditioning file,
# whatever its model family keeps there (IndexTTS2: the [32, D] latents), read by the family's FeatureSpec.
PATH_ROLES = ("text_ids", "codes", "condition", "emo_vec")
# String pools: "<name>_data" (UTF-8 bytes end to end) and "<name>_offsets" (int64, one more than strings).
POOLS = ("id", "file", "folder", "manifest_name", "lang_name", "speaker_name")
NO_LINE = 0  # a sample not read from a manifest line (Sample.source is the manifest name alone)


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample, made on demand from its table row (index is its row)."""

    index: int
    id: str
    source: str  # "manifest:line", what every message about the sample starts with
    text_ids_path: str
    codes_path: str
    condition_path: str
    emo_vec_path: str
    text_len: int
    code_len: int
    lang: str | None
    speaker: str | None


class StringPool:
    """Strings stored end to end: string k is data[offsets[k]:offsets[k + 1]], decoded."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: np.ndarray, offsets: np.ndarray) -> None:
        self.data, self.offsets = data, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k: int) -> str:
        # surrogatepass: JSON may hold lone surrogates ("\ud800"), which plain UTF-8 cannot carry.
        return self.data[self.offsets[k]: self.offsets[k + 1]].tobytes().decode("utf-8", "surrogatepass")

    def strings(self) -> list[str]:
        return [self[k] for k in range(len(self))]

    def as_bytes(self, indices: Sequence[int] | None = None) -> list[bytes]:
        """The strings (or those at `indices`) undecoded, for comparing: no decoding, no str per string."""
        blob, offsets = self.data.tobytes(), self.offsets.tolist()
        return [blob[offsets[k]: offsets[k + 1]] for k in (range(len(self)) if indices is None else indices)]


class PoolBuilder:
    """Appends strings to a pool; with `dedupe`, a string seen before gets its first index back."""

    def __init__(self, dedupe: bool) -> None:
        self.data = bytearray()
        self.offsets = array("q", [0])
        self.index: dict[str, int] | None = {} if dedupe else None

    def add(self, text: str) -> int:
        if self.index is not None:
            known = self.index.get(text)
            if known is not None:
                return known
        self.data += text.encode("utf-8", "surrogatepass")
        self.offsets.append(len(self.data))
        k = len(self.offsets) - 2
        if self.index is not None:
            self.index[text] = k
        return k

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        return {f"{name}_data": np.frombuffer(bytes(self.data), dtype=np.uint8),
                f"{name}_offsets": np.frombuffer(self.offsets, dtype=np.int64).copy()}


class TableBuilder:
    """Collects samples one at a time into columns (array.array: no Python object per sample)."""

    def __init__(self) -> None:
        self.columns = {name: array("i") for name in SAMPLE_COLUMNS}
        self.pools = {name: PoolBuilder(dedupe=name not in ("id", "file")) for name in POOLS}
        self.file_index: dict[str, int] = {}  # full path -> file pool index (the pool holds names only)
        self.file_folder = array("i")
        self.id_hashes = array("q")  # for finding repeated ids without a set of every id

    def __len__(self) -> int:
        return len(self.columns["line"])

    def manifest(self, name: str) -> int:
        return self.pools["manifest_name"].add(name)

    def file(self, path: str) -> int:
        """The pool index of a feature file (added on first sight), stored as its folder and its name."""
        known = self.file_index.get(path)
        if known is None:
            folder, name = os.path.split(path)
            known = self.file_index[path] = self.pools["file"].add(name)
            self.file_folder.append(self.pools["folder"].add(folder))
        return known

    def add(self, sample_id: str, text_len: int, code_len: int, manifest: int, line: int, lang: str | None,
            speaker: str | None, files: Sequence[int]) -> None:
        c = self.columns
        c["text_len"].append(text_len)
        c["code_len"].append(code_len)
        c["manifest"].append(manifest)
        c["line"].append(line)
        c["lang"].append(-1 if lang is None else self.pools["lang_name"].add(lang))
        c["speaker"].append(-1 if speaker is None else self.pools["speaker_name"].add(speaker))
        for role, k in zip(PATH_ROLES, files):
            c[role].append(k)
        self.pools["id"].add(sample_id)
        self.id_hashes.append(hash(sample_id))

    def build(self) -> SampleTable:
        arrays = {name: np.frombuffer(col, dtype=np.int32).copy() for name, col in self.columns.items()}
        for name, pool in self.pools.items():
            arrays.update(pool.arrays(name))
        arrays["file_folder"] = np.frombuffer(self.file_folder, dtype=np.int32).copy()
        return SampleTable(arrays)


class SampleTable(Sequence[Sample]):
    """Read-only samples; `table[i]` is the Sample of index i, the columns are numpy arrays."""

    def __init__(self, arrays: dict[str, np.ndarray], backing: Path | None = None,
                 reopen: Callable[[Path], SampleTable] | None = None) -> None:
        self.arrays = arrays
        self.backing = backing  # the cache file the arrays are mapped from, if any
        self.reopen = reopen  # maps `backing` again (table_file.map_table: the reader, which imports this module)
        pools = {n: StringPool(arrays[f"{n}_data"], arrays[f"{n}_offsets"]) for n in POOLS}
        self.ids, self.files, self.folders = pools["id"], pools["file"], pools["folder"]
        self.speakers = pools["speaker_name"]
        self.manifest_names, self.lang_names = pools["manifest_name"].strings(), pools["lang_name"].strings()

    def __len__(self) -> int:
        return len(self.arrays["line"])

    @property
    def text_len(self) -> np.ndarray:
        return self.arrays["text_len"]

    @property
    def code_len(self) -> np.ndarray:
        return self.arrays["code_len"]

    @overload
    def __getitem__(self, i: int) -> Sample: ...

    @overload
    def __getitem__(self, i: slice) -> list[Sample]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n, i = len(self), operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} of {n}")
        a = self.arrays
        paths = {f"{role}_path": self.path(int(a[role][i])) for role in PATH_ROLES}
        lang, speaker = int(a["lang"][i]), int(a["speaker"][i])
        return Sample(index=i, id=self.ids[i], source=self.source(i), **paths, text_len=int(a["text_len"][i]),
                      code_len=int(a["code_len"][i]), lang=self.lang_names[lang] if lang >= 0 else None,
                      speaker=self.speakers[speaker] if speaker >= 0 else None)

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    def path(self, file: int) -> str:
        return os.path.join(self.folders[int(self.arrays["file_folder"][file])], self.files[file])

    def source(self, i: int) -> str:
        """`manifest:line` of sample i, as every message about it starts."""
        name, line = self.manifest_names[int(self.arrays["manifest"][i])], int(self.arrays["line"][i])
        return name if line == NO_LINE else f"{name}:{line}"

    def languages(self, count: int) -> dict[str, list[int]]:
        """The first `count` sample indices by language ("" for none), in index order."""
        codes = self.arrays["lang"][:count]
        found, first = np.unique(codes, return_index=True)
        return {("" if c < 0 else self.lang_names[c]): np.flatnonzero(codes == c).tolist()
                for c in found[np.argsort(first)]}  # in order of first appearance, as a loop over samples gives

    def language_counts(self) -> dict[str, int]:
        """How many samples each language has ("" for none), in the order the languages first appear."""
        counts = np.bincount(self.arrays["lang"].astype(np.int64) + 1, minlength=len(self.lang_names) + 1)
        return {("" if i == 0 else self.lang_names[i - 1]): int(n) for i, n in enumerate(counts) if n}

    def __reduce__(self):
        # A spawned loader worker maps the same file instead of receiving a pickled copy.
        if self.backing is not None and self.reopen is not None:
            return self.reopen, (self.backing,)
        return SampleTable, (self.arrays,)

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> SampleTable:
        """`samples` as a table (a table is returned as it is)."""
        if isinstance(samples, SampleTable):
            return samples
        builder = TableBuilder()
        for s in samples:
            name, sep, line = s.source.rpartition(":")
            numbered = bool(sep) and line.isdigit() and int(line) > 0
            manifest = builder.manifest(name if numbered else s.source)
            files = [builder.file(getattr(s, f"{role}_path")) for role in PATH_ROLES]
            builder.add(s.id, s.text_len, s.code_len, manifest, int(line) if numbered else NO_LINE, s.lang,
                        s.speaker, files)
        return builder.build()
