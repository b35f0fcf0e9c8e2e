"""Audio files to mono float32 waveforms at the rate a backend asks for.

WAV is read by this module with the standard library alone (RIFF chunks: PCM of 8, 16, 24 or 32 bits, IEEE
float of 32 or 64 bits, WAVE_FORMAT_EXTENSIBLE of either), so the pipeline needs no audio package. Every other
format (FLAC, MP3, OGG, ...) is decoded by soundfile when it is importable, else by librosa when it is; without
either such a file is reported for its line with what to install. Samples are scaled to [-1, 1] as soundfile and
librosa scale them (integers divided by 2^(bits-1)), channels averaged to mono as librosa does, and the result
resampled by resample.py.

`audio_info` reads only a file's header (WAV; soundfile's info for other formats), so the pipeline knows every
clip's length, and so its batch and its limits, before it decodes anything.
"""
from __future__ import annotations

import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from trainers.tools.prepare.backend import AudioProblem, Clip
from trainers.tools.prepare.resample import resample, resampled_length

PCM, IEEE_FLOAT, EXTENSIBLE = 1, 3, 0xFFFE
WAV_SUFFIXES = (".wav", ".wave")
AUDIO_SUFFIXES = (".wav", ".wave", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".aiff", ".aif")
NO_DECODER = "pip install soundfile, or convert it to WAV"


@dataclass(frozen=True)
class AudioInfo:
    """What a file's header says: frames per channel, their rate, the channels."""

    frames: int
    rate: int
    channels: int

    def samples_at(self, rate: int) -> int:
        return resampled_length(self.frames, self.rate, rate)


@dataclass(frozen=True)
class _WavLayout:
    info: AudioInfo
    format: int
    bits: int
    data_offset: int
    data_bytes: int


def _wav_layout(path: Path) -> _WavLayout:
    """The format and data chunk of a RIFF WAVE file; AudioProblem for anything else."""
    size = path.stat().st_size
    if size == 0:
        raise AudioProblem("is an empty file (0 bytes)", "record or convert it again, or remove the line", "empty")
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            raise AudioProblem("is not a RIFF WAVE file", "convert it to WAV, or give it its format's suffix")
        fmt = None
        while True:
            chunk = f.read(8)
            if len(chunk) < 8:
                raise AudioProblem("has no data chunk (the file ends before the audio)", "the file is truncated or "
                                   "damaged: record or convert it again")
            name, length = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if name == b"fmt ":
                body = f.read(length)
                if len(body) < 16:
                    raise AudioProblem("has a damaged format chunk", "convert it to WAV again")
                tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
                if tag == EXTENSIBLE and len(body) >= 26:
                    tag = struct.unpack("<H", body[24:26])[0]  # the subformat GUID's first two bytes
                fmt = (tag, channels, rate, bits)
            elif name == b"data":
                if fmt is None:
                    raise AudioProblem("has its data before its format chunk", "convert it to WAV again")
                offset = f.tell()
                length = min(length, size - offset)  # streamed writers leave 0 or 0xFFFFFFFF here
                tag, channels, rate, bits = fmt
                if tag not in (PCM, IEEE_FLOAT) or (tag == PCM and bits not in (8, 16, 24, 32)) or (
                        tag == IEEE_FLOAT and bits not in (32, 64)):
                    raise AudioProblem(f"is a WAV of format {tag} with {bits}-bit samples, which is not PCM "
                                       "(8/16/24/32 bits) or float (32/64 bits)", "convert it to 16-bit PCM WAV")
                if channels < 1 or rate < 1:
                    raise AudioProblem(f"says it has {channels} channels at {rate} Hz", "convert it to WAV again")
                frame = channels * bits // 8
                if length < frame:
                    raise AudioProblem("holds no audio samples", "record or convert it again, or remove the line",
                                       "empty")
                frames = length // frame
                return _WavLayout(AudioInfo(frames, rate, channels), tag, bits, offset, frames * frame)
            else:
                f.seek(length + (length & 1), 1)  # chunks are padded to even sizes


def _read_wav(path: Path) -> tuple[np.ndarray, int]:
    layout = _wav_layout(path)
    with open(path, "rb") as f:
        f.seek(layout.data_offset)
        raw = f.read(layout.data_bytes)
    info, bits = layout.info, layout.bits
    if layout.format == IEEE_FLOAT:
        samples = np.frombuffer(raw, dtype="<f4" if bits == 32 else "<f8").astype(np.float32)
    elif bits == 8:
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif bits == 24:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        samples = (np.where(value >= 1 << 23, value - (1 << 24), value) / float(1 << 23)).astype(np.float32)
    else:
        dtype = "<i2" if bits == 16 else "<i4"
        samples = (np.frombuffer(raw, dtype=dtype).astype(np.float64) / float(1 << (bits - 1))).astype(np.float32)
    return samples.reshape(-1, info.channels).T, info.rate


def _read_other(path: Path) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except ImportError:
        soundfile = None
    if soundfile is not None:
        try:
            data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        except Exception as exc:  # soundfile raises its own error types for undecodable files
            raise AudioProblem(f"cannot be decoded by soundfile ({' '.join(str(exc).split())})",
                               "check the file, or convert it to WAV") from None
        return data.T, int(rate)
    try:
        import librosa
    except ImportError:
        raise AudioProblem(f"needs soundfile or librosa to be decoded ({path.suffix or 'not WAV'})",
                           NO_DECODER) from None
    try:
        data, rate = librosa.load(str(path), sr=None, mono=False)
    except Exception as exc:  # librosa falls back to audioread, whose errors vary
        raise AudioProblem(f"cannot be decoded by librosa ({' '.join(str(exc).split())})",
                           "check the file, or convert it to WAV") from None
    return np.atleast_2d(np.asarray(data, dtype=np.float32)), int(rate)


@contextmanager
def _opening(path: Path) -> Iterator[None]:
    """A file that cannot be opened as the AudioProblem of its line."""
    try:
        yield
    except FileNotFoundError:
        raise AudioProblem("not found", "fix the path (relative paths are read from the list's folder)",
                           "missing_audio") from None
    except IsADirectoryError:
        raise AudioProblem("is a folder, not an audio file", "fix the path") from None
    except OSError as exc:
        raise AudioProblem(f"cannot be read ({exc.strerror or exc})", "check the file's permissions") from None


def read_audio(path: Path) -> tuple[np.ndarray, int]:
    """The file's samples [channels, frames] float32 in [-1, 1] and its rate; AudioProblem when it cannot be read."""
    with _opening(path):
        if path.suffix.lower() in WAV_SUFFIXES:
            return _read_wav(path)
        return _read_other(path)


def audio_info(path: Path) -> AudioInfo | None:
    """The header's length, rate and channels without decoding; None where only decoding tells (no soundfile for a
    non-WAV file). AudioProblem when the file is missing or its header is damaged."""
    with _opening(path):
        if path.suffix.lower() in WAV_SUFFIXES:
            return _wav_layout(path).info
        if not path.is_file():
            raise FileNotFoundError
        try:
            import soundfile
        except ImportError:
            return None
        try:
            info = soundfile.info(str(path))
        except Exception:  # noqa: BLE001 - decoding will say what is wrong, on its line
            return None
        return AudioInfo(int(info.frames), int(info.samplerate), int(info.channels))


@dataclass(frozen=True)
class AudioLoader:
    """Decode, average the channels, resample to `rate`: a Clip (what the demo backend's `audio` returns)."""

    rate: int

    def load(self, path: Path, clip_id: str) -> Clip:
        samples, rate = read_audio(path)
        mono = samples.mean(axis=0, dtype=np.float32) if samples.shape[0] > 1 else samples[0]
        return Clip(clip_id, resample(mono, rate, self.rate), self.rate, rate, int(samples.shape[0]))
