"""Extend a SentencePiece tokenizer with pieces for a new script, keeping every existing id.

    python tools/tokenizer/extend_bpe.py --base-model checkpoints/bpe.model \\
        --manifests data/am_train.jsonl --output-model checkpoints/bpe_am.model \\
        --output-vocab checkpoints/bpe_am.vocab --target-size 16000

The base pieces keep their id, text, score and type, so text-embedding rows 0..N-1 of a
checkpoint keep their meaning; new pieces are appended as ids N..target-1.

Why base-language text tokenizes exactly as before: a base character is "covered" when it
occurs in some base piece that sentencepiece matches against text (NORMAL, USER_DEFINED,
UNUSED); control, unknown and byte pieces are symbols, not text. Every appended piece
contains at least one character that is not covered. BPE merges and the unigram lattice only
ever consider pieces that are substrings of the input, so on text made of covered characters
no appended piece can take part and the result cannot change. Coverage is decided from the
piece texts rather than from "encodes to <unk>", because a byte-fallback model never emits
<unk>: it spells an unseen character as <0x..> byte pieces.

Corpus text is harvested the way IndexTTS2 feeds the tokenizer: the line is upper-cased, then
the base model's own normalizer (normally nmt_nfkc) is applied. Pieces the runtime can never
see, such as lower-case letters, would be wasted ids.

Manifests: files ending in .jsonl or .json are JSON Lines, one object per non-blank line, whose
text is read as retokenize_manifest.py reads it: "target_text" in a paired training-manifest
line (prompt_condition_path + target_codes_path), "text" (or "target_text" where there is no
"text") in any other line; any other file is plain text, one sentence per non-blank line.

Base models trained on text that was not upper-cased (lower-case letters, no upper-case ones)
do not fit IndexTTS2: at runtime every Latin letter reaches them upper-cased and becomes <unk>,
and the upper-case letters of the corpus count as new characters, whose pieces then change the
ids of (upper-cased) base-language lines. The base-language check refuses such an extension
and says so; the remedy is a base trained on upper-cased text, like the official bpe.model.

Exit status: 0 success, 1 the extended model failed a self-check that no input should be
able to trigger (an internal error; nothing written), 2 a usage or input problem, including
a base model and corpus that would change base-language ids (message on stderr as
"error: ...", nothing written).
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import random
import re
import struct
import sys
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import sentencepiece as spm

from trainers.errors import UserError
from trainers.files import temp_path, write_fsynced
from trainers.tools import tool_main
from trainers.tools.tokenizer import sp_model_proto as proto
from trainers.tools.tokenizer.retokenize_front_end import lower_case_only
from trainers.tools.tokenizer.retokenize_lines import SINGLE, detect_form, text_of


EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

JSONL_SUFFIXES = frozenset({".jsonl", ".json"})
# Piece types sentencepiece matches against input text (the others are symbols).
TEXT_PIECE_TYPES = frozenset({proto.NORMAL, proto.USER_DEFINED, proto.UNUSED})
# Ids that mean "the base had no piece for this": <unk>, and <0x..> under byte fallback.
UNKNOWN_PIECE_TYPES = frozenset({proto.UNKNOWN, proto.BYTE})
SPACE_MARK = "\u2581"  # sentencepiece's visible space

# Candidate pool: about twice the slots to fill, since many candidates are dropped (no new
# character, or unreachable by BPE merges), plus one id per corpus character, which the
# candidate model spends on single characters.
MIN_CANDIDATE_SIZE = 1000
CANDIDATE_TRAIN_ATTEMPTS = 3

# Base-language check sample sizes: encoding is microseconds per line, so these stay cheap.
MAX_CHECK_TEXT_LINES = 20000
MAX_CORPUS_CHECK_LINES = 2000
SYNTHETIC_CHECK_LINES = 500
SYNTHETIC_MAX_PIECES = 12
MAX_CHANGED_LINES_SHOWN = 5

# Categories --add-unicode-blocks never adds: unassigned, controls, format characters,
# surrogates, private use and separators, which normalizers drop or map to a space.
SKIPPED_CATEGORIES = frozenset({"Cn", "Cc", "Cf", "Cs", "Co", "Zs", "Zl", "Zp"})


@dataclass(frozen=True)
class UnicodeBlock:
    name: str
    start: int
    end: int  # inclusive

    def __contains__(self, char: str) -> bool:
        return self.start <= ord(char) <= self.end


# Blocks of scripts a fine-tune commonly adds; --add-unicode-blocks fills every block in
# which the corpus has at least one new character.
UNICODE_BLOCKS: tuple[UnicodeBlock, ...] = tuple(UnicodeBlock(*row) for row in (
    ("Latin-1 Supplement", 0x0080, 0x00FF),
    ("Latin Extended-A", 0x0100, 0x017F),
    ("Latin Extended-B", 0x0180, 0x024F),
    ("Greek and Coptic", 0x0370, 0x03FF),
    ("Cyrillic", 0x0400, 0x04FF),
    ("Cyrillic Supplement", 0x0500, 0x052F),
    ("Armenian", 0x0530, 0x058F),
    ("Hebrew", 0x0590, 0x05FF),
    ("Arabic", 0x0600, 0x06FF),
    ("Syriac", 0x0700, 0x074F),
    ("Arabic Supplement", 0x0750, 0x077F),
    ("Thaana", 0x0780, 0x07BF),
    ("NKo", 0x07C0, 0x07FF),
    ("Devanagari", 0x0900, 0x097F),
    ("Bengali", 0x0980, 0x09FF),
    ("Gurmukhi", 0x0A00, 0x0A7F),
    ("Gujarati", 0x0A80, 0x0AFF),
    ("Oriya", 0x0B00, 0x0B7F),
    ("Tamil", 0x0B80, 0x0BFF),
    ("Telugu", 0x0C00, 0x0C7F),
    ("Kannada", 0x0C80, 0x0CFF),
    ("Malayalam", 0x0D00, 0x0D7F),
    ("Sinhala", 0x0D80, 0x0DFF),
    ("Thai", 0x0E00, 0x0E7F),
    ("Lao", 0x0E80, 0x0EFF),
    ("Tibetan", 0x0F00, 0x0FFF),
    ("Myanmar", 0x1000, 0x109F),
    ("Georgian", 0x10A0, 0x10FF),
    ("Hangul Jamo", 0x1100, 0x11FF),
    ("Ethiopic", 0x1200, 0x137F),
    ("Ethiopic Supplement", 0x1380, 0x139F),
    ("Cherokee", 0x13A0, 0x13FF),
    ("Unified Canadian Aboriginal Syllabics", 0x1400, 0x167F),
    ("Khmer", 0x1780, 0x17FF),
    ("Mongolian", 0x1800, 0x18AF),
    ("Georgian Extended", 0x1C90, 0x1CBF),  # str.upper() maps Georgian Mkhedruli here
    ("Latin Extended Additional", 0x1E00, 0x1EFF),
    ("Greek Extended", 0x1F00, 0x1FFF),
    ("Ethiopic Extended", 0x2D80, 0x2DDF),
    ("Hiragana", 0x3040, 0x309F),
    ("Katakana", 0x30A0, 0x30FF),
    ("Ethiopic Extended-A", 0xAB00, 0xAB2F),
    ("Hangul Syllables", 0xAC00, 0xD7AF),
))

# (spec, field number, trainer option, default): copied from the base so candidate pieces follow
# its whitespace and splitting conventions (e.g. "▁WORD" vs "WORD▁").
MIRRORED_OPTIONS: tuple[tuple[str, int, str, int | bool], ...] = (
    ("trainer", 20, "max_sentencepiece_length", 16),
    ("trainer", 21, "split_by_unicode_script", True),
    ("trainer", 22, "split_by_whitespace", True),
    ("trainer", 23, "split_by_number", True),
    ("trainer", 24, "treat_whitespace_as_suffix", False),
    ("trainer", 25, "split_digits", False),
    ("trainer", 26, "allow_whitespace_only_pieces", False),
    ("normalizer", 3, "add_dummy_prefix", True),
)


class VerificationError(Exception):
    """The extended model failed a self-check; exit status 1."""


@dataclass(frozen=True)
class ExtendConfig:
    """The command line, one field per flag (defaults live in build_parser)."""

    base_model: Path
    manifests: list[Path]
    output_model: Path
    output_vocab: Path
    report: Path
    target_size: int
    candidate_size: int | None
    character_coverage: float
    add_unicode_blocks: bool
    check_text: list[Path]
    seed: int
    num_threads: int


@dataclass
class UnkStats:
    """How often a model falls back to <unk> (or byte pieces) on a set of lines."""

    lines: int = 0
    lines_with_unk: int = 0
    tokens: int = 0
    unk_tokens: int = 0
    unk_rate: float = 0.0


@dataclass
class ExtendReport:
    base_model: str
    output_model: str
    output_vocab: str
    model_type: str
    base_size: int
    new_size: int
    pieces_added: int
    multi_char_pieces_added: int
    single_char_pieces_added: int
    unicode_block_pieces_added: int
    unicode_blocks: list[str]
    corpus_lines: int
    new_characters_found: int
    new_characters_covered: int
    new_characters: str
    candidate_size: int
    candidate_pieces: int
    admissible_candidates: int
    unk_before: UnkStats
    unk_after: UnkStats
    base_lines_checked: int
    base_lines_changed: int
    check_lines_skipped: int = 0
    uncoverable_characters: str = ""


@dataclass
class BaseModel:
    proto: proto.ModelProto
    sp: spm.SentencePieceProcessor
    covered: frozenset[str]  # characters occurring in a text-matching base piece

    @property
    def size(self) -> int:
        return len(self.proto.pieces)

    def is_new(self, char: str) -> bool:
        return char not in self.covered and not char.isspace()


# ----------------------------------------------------------------------------- input

def load_base(path: Path) -> BaseModel:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"--base-model {path}: cannot read it ({exc.strerror})") from None
    try:
        model = proto.parse_model(data)
        sp = spm.SentencePieceProcessor(model_proto=data)  # also runs the model's self-test
    except (proto.ProtoError, RuntimeError, ValueError, TypeError) as exc:
        raise UserError(f"--base-model {path} is not a valid SentencePiece model ({exc}); "
                        "pass the tokenizer's .model file (e.g. checkpoints/bpe.model), not the .vocab") from None
    if sp.get_piece_size() != len(model.pieces):
        raise UserError(f"--base-model {path}: sentencepiece sees {sp.get_piece_size()} pieces but the file "
                        f"holds {len(model.pieces)}; the file is damaged")
    if model.model_type not in (proto.BPE, proto.UNIGRAM):
        name = proto.MODEL_TYPE_NAMES.get(model.model_type, str(model.model_type))
        raise UserError(f"--base-model {path} is a {name} model; only bpe and unigram models can be extended")
    covered = frozenset(c for p in model.pieces if p.type in TEXT_PIECE_TYPES for c in p.piece)
    return BaseModel(model, sp, covered)


def read_lines(path: Path, flag: str) -> list[str]:
    """Sentences of one manifest: JSONL ``text`` fields or plain-text lines (see module doc)."""
    try:
        content = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"{flag} {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{flag} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    is_jsonl = path.suffix.lower() in JSONL_SUFFIXES
    lines = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        text = _jsonl_text(path, number, line) if is_jsonl else line
        if text.strip():
            lines.append(" ".join(text.split()))  # one sentence per line, even if the text had newlines
    return lines


def _jsonl_text(path: Path, number: int, line: str) -> str:
    where = f"{path}:{number}"
    hint = ('each line of a .jsonl/.json file must be one JSON object with the text in "text" (or "target_text", as '
            "in a paired training manifest)")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg}); {hint}") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: not a JSON object; {hint}")
    # A corpus line without manifest fields reads like a single-utterance line: "text".
    text, problem = text_of(row, detect_form(row) or SINGLE, where)
    if problem:
        raise UserError(problem)
    return text


def runtime_text(sp: spm.SentencePieceProcessor, line: str) -> str:
    """The characters the tokenizer segments at IndexTTS2 runtime: upper-cased, then normalized
    by the base model's own normalizer; spaces are returned as plain spaces."""
    upper = line.upper()
    if hasattr(sp, "normalize"):  # sentencepiece >= 0.2
        return " ".join(sp.normalize(upper).replace(SPACE_MARK, " ").split())
    return " ".join(unicodedata.normalize("NFKC", upper).split())


# ----------------------------------------------------------------------------- characters

def new_characters(base: BaseModel, lines: Iterable[str]) -> list[str]:
    """Characters the base has no piece for, most frequent first (ties by code point)."""
    counts = Counter(c for line in lines for c in line if base.is_new(c))
    return sorted(counts, key=lambda c: (-counts[c], c))


def unicode_block_characters(base: BaseModel, seen: Sequence[str]) -> tuple[list[str], list[str]]:
    """The extra new characters of every table block that holds a seen one, and those blocks' names."""
    blocks = [b for b in UNICODE_BLOCKS if any(c in b for c in seen)]
    known = set(seen)
    extra = []
    for block in blocks:
        for code in range(block.start, block.end + 1):
            char = chr(code)
            if char not in known and base.is_new(char) and _runtime_producible(base, char):
                extra.append(char)
                known.add(char)
    return extra, [b.name for b in blocks]


def _runtime_producible(base: BaseModel, char: str) -> bool:
    # A lower-case letter or a compatibility form never reaches the tokenizer: its piece would
    # be a wasted id.
    return unicodedata.category(char) not in SKIPPED_CATEGORIES and runtime_text(base.sp, char) == char


# ----------------------------------------------------------------------------- candidates

def candidate_trainer_options(base: BaseModel, vocab_size: int, coverage: float, threads: int) -> dict:
    options: dict = dict(
        model_type=proto.MODEL_TYPE_NAMES[base.proto.model_type],
        vocab_size=vocab_size,
        character_coverage=coverage,
        # The text is already normalized by the base's normalizer (see runtime_text).
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        byte_fallback=False,
        unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
        hard_vocab_limit=False,  # a small corpus yields fewer pieces instead of an error
        num_threads=threads,  # 1 keeps the output reproducible
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    specs = {"trainer": base.proto.trainer_spec(), "normalizer": base.proto.normalizer_spec()}
    for spec, number, option, default in MIRRORED_OPTIONS:
        value = proto.last_varint(specs[spec], number, int(default))
        options[option] = bool(value) if isinstance(default, bool) else proto.to_int32(value)  # type: ignore[arg-type]
    return options


def _retry_vocab_size(message: str, requested: int, needed: int) -> int | None:
    """The candidate size to retry with after sentencepiece refused ``requested``, if it says one."""
    too_high = re.search(r"value <= (\d+)", message)
    if too_high:
        return int(too_high.group(1))
    too_small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if too_small:  # the characters alone fill the size: add room for the pieces still needed
        return int(too_small.group(1)) + max(requested, 2 * needed)
    return None


def train_candidates(base: BaseModel, lines: Sequence[str], cfg: ExtendConfig, vocab_size: int,
                     needed: int) -> tuple[list[proto.Piece], int]:
    """Train a candidate model of the base's type on the new corpus; return its NORMAL pieces in
    rank order (BPE: merge order; unigram: best score first) and the size it was trained with."""
    options = candidate_trainer_options(base, vocab_size, cfg.character_coverage, cfg.num_threads)
    for _ in range(CANDIDATE_TRAIN_ATTEMPTS):
        buffer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buffer, **options)
            break
        except RuntimeError as exc:
            retry = _retry_vocab_size(str(exc), options["vocab_size"], needed)
            if retry is None or retry == options["vocab_size"]:
                raise UserError(f"training the candidate model failed: {exc}") from None
            _say(f"candidate size {options['vocab_size']} refused by sentencepiece, retrying with {retry}")
            options["vocab_size"] = retry
    else:
        raise UserError(f"training the candidate model failed after {CANDIDATE_TRAIN_ATTEMPTS} attempts; "
                        "pass an explicit --candidate-size")
    candidate = proto.parse_model(buffer.getvalue())
    return [p for p in candidate.pieces if p.type == proto.NORMAL], options["vocab_size"]


@dataclass
class Selection:
    multi: list[proto.Piece]  # chosen multi-character candidates, rank order, candidate scores
    admissible: int  # how many admissible candidates exist in total


def select_candidates(base: BaseModel, candidates: Sequence[proto.Piece], singles: Sequence[str],
                      needed: int) -> Selection:
    """Admit multi-character candidates in rank order: each must hold a new character and use
    only characters that have a piece; for BPE it must also be the merge of two pieces already
    in the extended vocabulary, or no merge sequence could ever produce it."""
    vocab = {p.piece for p in base.proto.pieces if p.type in TEXT_PIECE_TYPES} | set(singles)
    known_chars = base.covered | set(singles)
    is_bpe = base.proto.model_type == proto.BPE
    chosen: list[proto.Piece] = []
    admissible = 0
    for cand in candidates:
        text = cand.piece
        if len(text) < 2 or text in vocab or not any(base.is_new(c) for c in text):
            continue
        if not set(text) <= known_chars or (is_bpe and not _is_merge(text, vocab)):
            continue
        admissible += 1
        vocab.add(text)  # later candidates may be merges of this one
        if len(chosen) < needed:
            chosen.append(cand)
    return Selection(chosen, admissible)


def _is_merge(text: str, vocab: set[str]) -> bool:
    return any(text[:i] in vocab and text[i:] in vocab for i in range(1, len(text)))


# ----------------------------------------------------------------------------- scores

def f32(value: float) -> float:
    """Round to the float32 the model file stores, so in-memory and on-disk scores agree."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def bpe_pieces(base: BaseModel, multi: Sequence[proto.Piece], singles: Sequence[str]) -> list[proto.Piece]:
    """BPE merges the pair with the highest score first. Appended pieces score strictly below
    every base piece, in candidate rank order, so among themselves they merge in the order the
    candidate model learned them. They never compete with base merges on base text (they all
    hold a new character). Single characters come last, as sentencepiece lays them out: they
    are never the result of a merge, so their score does not affect segmentation."""
    floor = min(p.score for p in base.proto.pieces)
    texts = [p.piece for p in multi] + list(singles)
    return [proto.Piece(text, f32(floor - 1 - rank)) for rank, text in enumerate(texts)]


def unigram_pieces(base: BaseModel, multi: Sequence[proto.Piece], singles: Sequence[str],
                   candidates: Sequence[proto.Piece]) -> list[proto.Piece]:
    """Unigram scores are log-probabilities. Base-language segmentation cannot depend on them (an
    appended piece never matches text without a new character), but they decide how new-script
    words segment next to characters the base covers (spaces, digits, punctuation). The
    candidate's scale is shifted down so its best piece is not above the base's best, then
    clamped into the base's NORMAL score range: sentencepiece derives the unknown-character
    penalty from the lowest NORMAL score, so that stays as in the base too. Single characters the
    candidate did not score get the base's lowest score: still a piece, so never <unk>."""
    normal = [p.score for p in base.proto.pieces if p.type == proto.NORMAL]
    low, high = min(normal), max(normal)
    cand_top = max((p.score for p in candidates), default=high)
    shift = min(0.0, high - cand_top)
    cand_score = {p.piece: p.score for p in candidates}

    def place(score: float) -> float:
        return f32(min(high, max(low, score + shift)))

    pieces = [proto.Piece(p.piece, place(p.score)) for p in multi]
    pieces += [proto.Piece(c, place(cand_score[c]) if c in cand_score else f32(low)) for c in singles]
    return pieces


# ----------------------------------------------------------------------------- checks

def unk_stats(sp: spm.SentencePieceProcessor, unknown_ids: frozenset[int], lines: Sequence[str]) -> UnkStats:
    stats = UnkStats(lines=len(lines))
    for ids in sp.encode(list(lines), out_type=int):
        unk = sum(1 for i in ids if i in unknown_ids)
        stats.tokens += len(ids)
        stats.unk_tokens += unk
        stats.lines_with_unk += unk > 0
    stats.unk_rate = stats.unk_tokens / stats.tokens if stats.tokens else 0.0
    return stats


def base_check_lines(base: BaseModel, check_text: Sequence[str], corpus: Sequence[str],
                     processed: Sequence[str], seed: int) -> tuple[list[str], int]:
    """Base-language lines to compare old and new ids on, and how many --check-text lines were
    skipped because they hold characters the base has no piece for (those may legitimately change)."""
    rng = random.Random(seed)
    check_text = check_text[:MAX_CHECK_TEXT_LINES]
    lines = [line for line in check_text if _only_covered(base, runtime_text(base.sp, line))]
    skipped = len(check_text) - len(lines)
    plain = [line for line, norm in zip(corpus, processed) if _only_covered(base, norm)]
    lines += rng.sample(plain, min(len(plain), MAX_CORPUS_CHECK_LINES))
    lines += synthetic_lines(base, rng, SYNTHETIC_CHECK_LINES)
    return lines, skipped


def _only_covered(base: BaseModel, normalized: str) -> bool:
    return not any(base.is_new(c) for c in normalized)


def synthetic_lines(base: BaseModel, rng: random.Random, count: int) -> list[str]:
    """Text made by decoding random runs of base pieces: reaches pieces a small sample misses."""
    pool = [i for i, p in enumerate(base.proto.pieces) if p.type in (proto.NORMAL, proto.USER_DEFINED)]
    if not pool:
        return []
    lines = (base.sp.decode([rng.choice(pool) for _ in range(rng.randint(2, SYNTHETIC_MAX_PIECES))])
             for _ in range(count))
    return [line for line in lines if line.strip()]


def changed_lines(base_sp: spm.SentencePieceProcessor, new_sp: spm.SentencePieceProcessor,
                  lines: Sequence[str]) -> list[str]:
    """Lines whose ids differ between the two models (upper-cased first, as at runtime)."""
    upper = [line.upper() for line in lines]
    old, new = base_sp.encode(upper, out_type=int), new_sp.encode(upper, out_type=int)
    return [line for line, a, b in zip(upper, old, new) if a != b]


def upper_case_gaps(base: BaseModel) -> dict[str, str]:
    """Base characters whose upper-case form holds a character the base has no piece for,
    mapped to that form ({'a': 'A'} for a base trained on lower-case text)."""
    return {c: c.upper() for c in sorted(base.covered)
            if c.upper() != c and any(base.is_new(u) for u in c.upper())}


def explain_changed_lines(base: BaseModel, changed: Sequence[str]) -> str | None:
    """Why base-language lines change, and what to do; None if no input explains it.

    The appended pieces all hold a character the base has no piece for, so a line can only
    change if it holds one. Check lines are made of base text, so such characters come from
    IndexTTS2's upper-casing: upper-case forms the base lacks (a lower-case base lacks them all)."""
    seen = sorted({c for line in changed for c in runtime_text(base.sp, line) if base.is_new(c)})
    if not seen:
        return None
    gaps = upper_case_gaps(base)
    from_upper = [c for c in seen if any(c in up for up in gaps.values())]
    if not from_upper:
        return (f"Cause: these lines hold characters the base model has no piece for ({_chars(seen)}), and the "
                "extension adds pieces for them. Remedy: remove those characters from --manifests, or extend a "
                "base model that has pieces for them.")
    lows = [low for low, up in gaps.items() if any(c in up for c in from_upper)]
    examples = ", ".join(f"{low!r} but not {gaps[low]!r}" for low in lows[:MAX_CHANGED_LINES_SHOWN])
    if lower_case_only(base.covered):
        what = ("the base model was trained on text that was not upper-cased: it has lower-case letters and no "
                f"upper-case ones ({examples})")
    else:
        what = f"the base model has characters whose upper-case form it lacks ({examples})"
    return (f"Cause: {what}. IndexTTS2 upper-cases text before tokenizing, so at runtime the base turns these "
            f"letters into <unk>; the upper-case letters of --manifests ({_chars(from_upper)}) count as new "
            "characters, and their new pieces change the ids of upper-cased base-language lines. Remedy: extend a "
            "base model trained on upper-cased text, as the official checkpoints/bpe.model is (retrain yours from "
            "upper-cased text); or, if you need only the new script, remove text in these letters from --manifests "
            "so no piece is added for them.")


def _chars(chars: Sequence[str], limit: int = 20) -> str:
    shown = " ".join(repr(c) for c in chars[:limit])
    return shown + (f" and {len(chars) - limit} more" if len(chars) > limit else "")


def verify_model_file(path: Path, base: BaseModel, expected_size: int) -> None:
    """The written file loads in sentencepiece, and its first base-size pieces are the base's."""
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
        written = proto.parse_model(path.read_bytes())
    except (RuntimeError, OSError, proto.ProtoError) as exc:
        raise VerificationError(f"the written model {path} does not load: {exc}") from None
    if sp.get_piece_size() != expected_size or len(written.pieces) != expected_size:
        raise VerificationError(f"the written model has {sp.get_piece_size()} pieces, expected {expected_size}")
    for i, old in enumerate(base.proto.pieces):
        new = written.pieces[i]
        same = (new.raw == old.raw and sp.id_to_piece(i) == old.piece and sp.get_score(i) == old.score
                and sp.is_unknown(i) == (old.type == proto.UNKNOWN)
                and sp.is_control(i) == (old.type == proto.CONTROL)
                and sp.is_unused(i) == (old.type == proto.UNUSED)
                and sp.is_byte(i) == (old.type == proto.BYTE))
        if not same:
            raise VerificationError(f"piece {i} differs from the base: {old} became {new}")
    if any(p.type != proto.NORMAL for p in written.pieces[base.size:]):
        raise VerificationError("an appended piece is not of type NORMAL")


# ----------------------------------------------------------------------------- output

def write_outputs(files: dict[Path, bytes], verify: dict[Path, Callable[[Path], None]]) -> None:
    """Stage every file next to its destination, run the checks on the staged copies, then
    rename them into place: a failure leaves no output behind and never a half-written file."""
    staged: dict[Path, Path] = {}
    try:
        for path, data in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            staged[path] = temp_path(path)
            write_fsynced(staged[path], lambda handle: handle.write(data))
        for path, check in verify.items():
            check(staged[path])
        for path, tmp in staged.items():
            os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write {exc.filename or 'the outputs'}: {exc.strerror}") from None
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)


def vocab_text(pieces: Iterable[proto.Piece]) -> str:
    # "%g" is what sentencepiece's own .vocab writer produces (C++ stream default).
    return "".join(f"{p.piece}\t{p.score:g}\n" for p in pieces)


def report_lines(report: ExtendReport) -> list[str]:
    lines = []
    for key, value in asdict(report).items():
        if isinstance(value, dict):
            lines.append(f"report {key} " + " ".join(f"{k}={_fmt(v)}" for k, v in value.items()))
        else:
            lines.append(f"report {key}={_fmt(value)}")
    return lines


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6f}"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "-"
    return str(value) if value != "" else "-"


# ----------------------------------------------------------------------------- driver

@dataclass
class Corpus:
    lines: list[str]  # as read from the manifests
    processed: list[str]  # as the tokenizer sees them at runtime (see runtime_text)
    check_text: list[str]  # --check-text lines


@dataclass
class Plan:
    found: list[str]  # new characters of the corpus, most frequent first
    extra: list[str]  # new characters added by --add-unicode-blocks
    blocks: list[str]
    candidate_size: int
    candidates: list[proto.Piece]
    selection: Selection
    appended: list[proto.Piece]


def read_corpus(cfg: ExtendConfig, base: BaseModel) -> Corpus:
    lines = [line for path in cfg.manifests for line in read_lines(path, "--manifests")]
    check_text = [line for path in cfg.check_text for line in read_lines(path, "--check-text")]
    if not lines:
        raise UserError("no text found in --manifests " + " ".join(map(str, cfg.manifests))
                        + '; give JSONL files with a "text" field or plain-text files with one sentence per line')
    return Corpus(lines, [runtime_text(base.sp, line) for line in lines], check_text)


def plan_pieces(cfg: ExtendConfig, base: BaseModel, corpus: Corpus) -> Plan:
    """Decide which pieces to append and their scores; refuse targets that cannot be met."""
    found = new_characters(base, corpus.processed)
    if not found:
        raise UserError("the corpus in --manifests has no character that the base model lacks; "
                        "there is nothing to add (is it the right corpus?)")
    extra, blocks = unicode_block_characters(base, found) if cfg.add_unicode_blocks else ([], [])
    singles = found + extra
    needed = cfg.target_size - base.size - len(singles)
    if needed < 0:
        raise UserError(
            f"--target-size {cfg.target_size} is too small: the {len(found)} new characters of the corpus"
            + (f" and {len(extra)} more from --add-unicode-blocks" if extra else "")
            + f" each need a single-character piece, so the target must be at least {base.size + len(singles)}")

    corpus_chars = len({c for line in corpus.processed for c in line})
    size = cfg.candidate_size or max(2 * (cfg.target_size - base.size), MIN_CANDIDATE_SIZE) + corpus_chars
    candidates: list[proto.Piece] = []
    if needed:
        candidates, size = train_candidates(base, corpus.processed, cfg, size, needed)
    selection = select_candidates(base, candidates, singles, needed)
    if len(selection.multi) < needed:
        largest = base.size + len(singles) + selection.admissible
        raise UserError(
            f"--target-size {cfg.target_size} needs {needed} multi-character pieces, but only "
            f"{selection.admissible} admissible candidates were found among {len(candidates)} "
            f"(candidate size {size}); the largest possible target is {largest}. Add more text to "
            f"--manifests, pass a larger --candidate-size, or a --target-size of at most {largest}")

    if base.proto.model_type == proto.BPE:
        appended = bpe_pieces(base, selection.multi, singles)
    else:
        appended = unigram_pieces(base, selection.multi, singles, candidates)
    return Plan(found, extra, blocks, size, candidates, selection, appended)


def check_extended(cfg: ExtendConfig, base: BaseModel, corpus: Corpus, plan: Plan,
                   new_sp: spm.SentencePieceProcessor) -> ExtendReport:
    """Measure <unk> before/after and prove base-language ids unchanged; raise VerificationError if not."""
    unknown_ids = frozenset(i for i, p in enumerate(base.proto.pieces) if p.type in UNKNOWN_PIECE_TYPES)
    upper = [line.upper() for line in corpus.lines]
    check, skipped = base_check_lines(base, corpus.check_text, corpus.lines, corpus.processed, cfg.seed)
    changed = changed_lines(base.sp, new_sp, check)
    if changed:
        shown = "; ".join(repr(line) for line in changed[:MAX_CHANGED_LINES_SHOWN])
        summary = (f"{len(changed)} of {len(check)} base-language lines tokenize differently "
                   f"with the extended model (nothing written): {shown}")
        cause = explain_changed_lines(base, changed)
        if cause is None:  # every character has a base piece: the construction should make this impossible
            raise VerificationError(f"{summary}. Their characters all have base pieces, so this is a fault in "
                                    "extend_bpe itself; please report it with the base model and the corpus")
        raise UserError(f"{summary}. {cause}")
    return ExtendReport(
        base_model=str(cfg.base_model), output_model=str(cfg.output_model), output_vocab=str(cfg.output_vocab),
        model_type=proto.MODEL_TYPE_NAMES[base.proto.model_type], base_size=base.size,
        new_size=base.size + len(plan.appended), pieces_added=len(plan.appended),
        multi_char_pieces_added=len(plan.selection.multi),
        single_char_pieces_added=len(plan.appended) - len(plan.selection.multi),
        unicode_block_pieces_added=len(plan.extra), unicode_blocks=plan.blocks, corpus_lines=len(corpus.lines),
        new_characters_found=len(plan.found),
        new_characters_covered=sum(1 for c in plan.found if new_sp.piece_to_id(c) >= base.size),
        new_characters="".join(plan.found), candidate_size=plan.candidate_size,
        candidate_pieces=len(plan.candidates), admissible_candidates=plan.selection.admissible,
        unk_before=unk_stats(base.sp, unknown_ids, upper), unk_after=unk_stats(new_sp, unknown_ids, upper),
        base_lines_checked=len(check), base_lines_changed=len(changed), check_lines_skipped=skipped,
        uncoverable_characters="".join(_uncoverable_characters(new_sp, corpus.processed, unknown_ids)),
    )


def _uncoverable_characters(new_sp: spm.SentencePieceProcessor, processed: Sequence[str],
                            unknown_ids: frozenset[int]) -> list[str]:
    chars = sorted({c for line in processed for c in line if not c.isspace()})
    encoded = new_sp.encode(chars, out_type=int)
    return [c for c, ids in zip(chars, encoded) if any(i in unknown_ids for i in ids)]


def extend(cfg: ExtendConfig) -> ExtendReport:
    """Build, check and write the extended model; raise UserError / VerificationError, with
    nothing written, on failure."""
    base = load_base(cfg.base_model)
    if cfg.target_size <= base.size:
        raise UserError(f"--target-size {cfg.target_size} must be larger than the base model's "
                        f"{base.size} pieces ({cfg.base_model}); it is the total size of the extended model, "
                        "base pieces included")
    if lower_case_only(base.covered):
        _say(f"warning: the base model {cfg.base_model} has lower-case letters and no upper-case ones, but IndexTTS2 "
             "upper-cases text before tokenizing: at runtime it turns Latin letters into <unk>. Use a base trained "
             "on upper-cased text (as the official bpe.model is)")
    corpus = read_corpus(cfg, base)
    _say(f"base model {cfg.base_model}: {proto.MODEL_TYPE_NAMES[base.proto.model_type]}, {base.size} pieces, byte "
         f"fallback {'on' if base.proto.byte_fallback else 'off'}; corpus: {len(corpus.lines)} lines from "
         f"{len(cfg.manifests)} file(s)")
    plan = plan_pieces(cfg, base, corpus)

    extended = proto.ModelProto(base.proto.pieces + plan.appended, base.proto.other_fields)
    data = proto.serialize_model(extended.with_trainer_vocab_size(cfg.target_size))
    try:
        new_sp = spm.SentencePieceProcessor(model_proto=data)
    except RuntimeError as exc:
        raise VerificationError(f"sentencepiece rejects the extended model: {exc}") from None
    report = check_extended(cfg, base, corpus, plan, new_sp)
    if report.uncoverable_characters:
        _say(f"warning: the extended model still emits <unk> for {report.uncoverable_characters!r}: the base has "
             "these characters only inside longer pieces, and a single-character piece for them could change "
             "base-language text")

    write_outputs(
        {cfg.output_model: data,
         cfg.output_vocab: vocab_text(extended.pieces).encode("utf-8"),
         cfg.report: (json.dumps(asdict(report), indent=2, ensure_ascii=False) + "\n").encode("utf-8")},
        verify={cfg.output_model: lambda tmp: verify_model_file(tmp, base, cfg.target_size)},
    )
    for line in report_lines(report):
        _say(line)
    _say(f"wrote {cfg.output_model} ({report.new_size} pieces), {cfg.output_vocab} and {cfg.report}")
    return report


def _say(line: str) -> None:
    """The tool's messages: plain lines on stderr, warnings and errors prefixed (stdout stays free)."""
    print(line, file=sys.stderr)


# ----------------------------------------------------------------------------- command line

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="extend_bpe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-model", type=Path, required=True, help="SentencePiece .model to extend (never modified)")
    p.add_argument("--manifests", type=Path, nargs="+", required=True,
                   help="new-language text: .jsonl/.json with a 'text' field per line (training manifests: "
                        "'target_text' of paired lines), or plain text")
    p.add_argument("--output-model", type=Path, required=True, help="extended .model to write")
    p.add_argument("--output-vocab", type=Path, help="'piece<TAB>score' list (default: output model with .vocab)")
    p.add_argument("--target-size", type=int, required=True, help="total number of pieces of the extended model")
    p.add_argument("--candidate-size", type=int,
                   help=f"vocab size of the candidate model (default: max(2*(target-base), {MIN_CANDIDATE_SIZE}) "
                        "+ distinct corpus characters)")
    p.add_argument("--character-coverage", type=float, default=1.0, help="candidate training coverage (default 1.0)")
    p.add_argument("--add-unicode-blocks", action="store_true",
                   help="also add every assigned character of the Unicode blocks the new characters belong to")
    p.add_argument("--check-text", type=Path, nargs="+", action="extend", default=[],
                   help="base-language text whose ids must not change (plain text or JSONL)")
    p.add_argument("--report", type=Path, help="JSON report (default: <output-model>.report.json)")
    p.add_argument("--seed", type=int, default=0, help="seed for the sampled base-language check lines")
    p.add_argument("--num-threads", type=int, default=1, help="candidate training threads (1 is reproducible)")
    return p


def parse_config(argv: Sequence[str] | None) -> ExtendConfig:
    args = build_parser().parse_args(argv)
    args.output_vocab = args.output_vocab or args.output_model.with_suffix(".vocab")
    args.report = args.report or Path(f"{args.output_model}.report.json")
    cfg = ExtendConfig(**vars(args))
    validate_config(cfg)
    return cfg


def validate_config(cfg: ExtendConfig) -> None:
    if not 0.0 < cfg.character_coverage <= 1.0:
        raise UserError(f"--character-coverage {cfg.character_coverage} must be in (0, 1]")
    if cfg.candidate_size is not None and cfg.candidate_size < 1:
        raise UserError(f"--candidate-size {cfg.candidate_size} must be positive")
    if cfg.num_threads < 1:
        raise UserError(f"--num-threads {cfg.num_threads} must be positive")
    outputs = {"--output-model": cfg.output_model, "--output-vocab": cfg.output_vocab, "--report": cfg.report}
    for flag, path in outputs.items():
        if _same_file(path, cfg.base_model):
            raise UserError(f"{flag} {path} is the --base-model; write the extended model to a new file")
    for (a, path), (b, other) in itertools.combinations(outputs.items(), 2):
        if _same_file(path, other):
            raise UserError(f"{a} and {b} are the same file ({path}); give them different paths")


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


@tool_main
def main(argv: list[str] | None = None) -> int:
    try:
        extend(parse_config(argv))
    except VerificationError as exc:
        _say(f"error: {exc}")
        return EXIT_FAILED
    return EXIT_OK
