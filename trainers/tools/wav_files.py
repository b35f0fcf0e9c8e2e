"""16-bit PCM WAV files written with the standard library, and file names made from sample ids.

A sample id is free text from a manifest ("spk1/utt 7__prompt", or Cyrillic): as a file name it may
hold a path separator, a leading dot or characters a file system refuses. `safe_names` keeps letters,
digits (of any script), "-", "_" and ".", replaces the rest with "_", and appends a short digest of
the id whenever it changed anything, so two ids never share a file and an id that is already a good
name is kept as it is.
"""
from __future__ import annotations

import hashlib
import io
import re
import wave
from pathlib import Path
from typing import Sequence

import numpy as np

from trainers.files import write_bytes_atomically

PCM16_MAX = 32767  # full scale; -32768 is left out so a waveform and its negation have the same peak
_UNSAFE = re.compile(r"[^\w.-]", re.UNICODE)
MAX_STEM_BYTES = 150  # of the id kept, in UTF-8: file names are limited to 255 bytes on most file systems


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()


def safe_name(sample_id: str) -> str:
    """A file stem for `sample_id`: the id itself when it is a safe name, else a cleaned id + its digest."""
    cleaned = _UNSAFE.sub("_", sample_id)  # no lone surrogates left: they are not \w
    stem = cleaned.encode("utf-8")[:MAX_STEM_BYTES].decode("utf-8", "ignore").lstrip(".")
    if stem == sample_id and stem:
        return stem
    return f"{stem or 'sample'}-{_digest(sample_id)}"


def safe_names(sample_ids: Sequence[str]) -> list[str]:
    """One distinct stem per id (ids differing only in case get a digest too: case-insensitive disks)."""
    stems = [safe_name(i) for i in sample_ids]
    folded = [s.casefold() for s in stems]
    return [s if folded.count(s.casefold()) == 1 or s != i else f"{s}-{_digest(i)}"
            for s, i in zip(stems, sample_ids)]


def to_pcm16(waveform: np.ndarray) -> np.ndarray:
    """A mono float waveform in [-1, 1] (as a vocoder gives it) as int16 samples, clipped at full scale."""
    samples = np.asarray(waveform, dtype=np.float64).reshape(-1)
    if not np.isfinite(samples).all():
        raise ValueError("the waveform holds NaN or inf values")
    return np.clip(np.rint(samples * PCM16_MAX), -PCM16_MAX, PCM16_MAX).astype("<i2")


def write_wav(path: Path, waveform: np.ndarray, sample_rate: int) -> None:
    """A mono 16-bit PCM WAV file of `waveform` (floats in [-1, 1]), written atomically: a kill leaves the previous
    file (or none) or the complete new one."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(int(sample_rate))
        out.writeframes(to_pcm16(waveform).tobytes())
    write_bytes_atomically(Path(path), buffer.getvalue())
