"""What makes a line unusable, in the words the report prints: `list.jsonl:LINE: what; what to do`.

The limits are the trainer's own (trainers.families: the config's gpt section read by the model family): a line
the pipeline keeps is never refused by the trainer's manifest check (max_text_tokens, max_mel_tokens and the
positions of the model's tables), and a text the tokenizer cannot fully encode is never kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainers.data.manifest_lines import DataLimits
from trainers.tools.prepare.backend import Clip, TextIds
from trainers.tools.prepare.inputs import Entry, Problem

# Every reason a line is skipped, as the summary names it.
REASONS = {
    "bad_line": "malformed line",
    "duplicate_id": "duplicate id",
    "text_empty": "empty text",
    "text_unknown": "text with unknown tokens",
    "text_too_long": "text too long",
    "language": "no or unknown language",
    "missing_audio": "audio file missing",
    "unreadable": "audio unreadable",
    "empty": "audio empty",
    "nan": "audio with NaN/inf",
    "silence": "silence",
    "too_short": "too short",
    "too_long": "too long",
    "backend_error": "feature models failed",
}


@dataclass(frozen=True)
class LineLimits:
    """The limits a line is checked against: the model's (DataLimits) and the command's own."""

    data: DataLimits
    min_seconds: float
    silence_db: float
    code_rate: int

    @property
    def silence_peak(self) -> float:
        return 10 ** (self.silence_db / 20)


def text_problem(entry: Entry, text: TextIds | None, limits: LineLimits, language_problem) -> Problem | None:
    """What is wrong with a line's text and language (None: nothing). `text` None: the text is empty."""
    if language_problem is not None:
        if entry.language is None:
            return Problem(entry.source, "language", "no language (an IndexTTS-2.5 text starts with its language's "
                           "token)", "add a language field to the line, or pass --language")
        if language_problem(entry.language):
            return Problem(entry.source, "language", f"language {entry.language!r} is not one of IndexTTS-2.5's codes",
                           "borrow one it has (docs/indextts25.md, \"A new language\")")
    if text is None or text.ids.size == 0:
        return Problem(entry.source, "text_empty", "the text is empty" if text is None else
                       f"the text {entry.text!r} makes no token", "write its transcript, or remove the line")
    if text.unknown:
        return Problem(entry.source, "text_unknown", f"{text.unknown} of {text.ids.size} tokens unknown "
                       f"({text.normalised[:20]!r})", "fix the text, or extend the tokenizer (indextts-extend-bpe)")
    limit = limits.data.max_text_tokens
    if text.ids.size > limit:
        return Problem(entry.source, "text_too_long", f"its text is {text.ids.size} tokens, more than "
                       f"gpt.max_text_tokens {limit}", "split the utterance into shorter ones")
    return None


def length_problem(entry: Entry, samples: int, rate: int, text_len: int, code_len: int,
                   limits: LineLimits) -> Problem | None:
    """Too short or too long for the model, from the clip's length (known from the header, before decoding)."""
    seconds = samples / rate
    if seconds < limits.min_seconds or code_len < 1:
        return Problem(entry.source, "too_short", f"lasts {seconds:.2f} s, shorter than --min-seconds "
                       f"{limits.min_seconds:g}" if code_len else f"lasts {seconds:.3f} s, too short to make a code",
                       "remove the line, or lower --min-seconds")
    data = limits.data
    longest = data.max_mel_tokens / limits.code_rate
    if code_len > data.max_mel_tokens:
        return Problem(entry.source, "too_long", f"lasts {seconds:.1f} s: {code_len} codes, more than "
                       f"gpt.max_mel_tokens {data.max_mel_tokens}", f"split it into clips of at most "
                       f"{math.floor(longest * 10) / 10:g} s")
    if data.positions(text_len, code_len) > data.max_positions:
        return Problem(entry.source, "too_long", f"its {text_len} text tokens and {code_len} codes need "
                       f"{data.positions(text_len, code_len)} positions, more than the model's {data.max_positions}",
                       "split the utterance into shorter ones")
    return None


def clip_problem(entry: Entry, clip: Clip, limits: LineLimits) -> Problem | None:
    """What is wrong with the decoded audio itself: empty, not finite, silent."""
    wave = clip.waveform
    if wave.size == 0:
        return Problem(entry.source, "empty", f"{entry.audio.name} holds no audio", "record or convert it again, or "
                       "remove the line")
    bad = int(np.count_nonzero(~np.isfinite(wave)))
    if bad:
        return Problem(entry.source, "nan", f"{entry.audio.name} holds {bad} NaN or infinite samples",
                       "convert it again from the original recording")
    peak = float(np.abs(wave).max())
    if peak < limits.silence_peak:
        level = 20 * math.log10(peak) if peak > 0 else -math.inf
        return Problem(entry.source, "silence", f"{entry.audio.name} is silent (peak {level:.0f} dBFS, below "
                       f"--silence-db {limits.silence_db:g})", "check the recording, or lower --silence-db")
    return None
