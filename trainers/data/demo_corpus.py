"""What the demo corpus holds: sentences, a tokenizer, semantic codes, features and manifests.

The semantic codes are a deterministic function of the text tokens and the speaker, so a tiny
GPT can learn them within a minute or two of CPU training: each text token expands to a fixed
short run of consecutive codes, which makes most codes predictable from the previous one and
the rest from the text. Text goes through IndexTTS2's front end for Latin script (upper-casing)
before the tokenizer sees it, in training the tokenizer and in making the ids, exactly as
upstream inference and tools/tokenizer/retokenize_manifest.py do.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from trainers.data.text_front_end import front_end  # on the demo's ASCII sentences: strip, then upper-case

TOKENIZER_NAME = "bpe.model"
FEATURES_DIR = "features"
TRAIN_MANIFEST_NAME = "train.jsonl"
VAL_MANIFEST_NAME = "val.jsonl"

CONDITION_FRAMES = 32
MIN_WORDS, MAX_WORDS = 3, 8
MAX_TEXT_LEN = 48
MAX_CODE_LEN = 150
MIN_PATTERN, MAX_PATTERN = 2, 4
TOKENIZER_SENTENCES = 3000
LANGUAGE = "en"

# Small fixed English word list; a tuple so it cannot be mutated.
WORDS: tuple[str, ...] = (
    "the", "a", "small", "large", "red", "green", "blue", "old", "new", "quiet",
    "happy", "bright", "dark", "cold", "warm", "fast", "slow", "little", "many", "every",
    "cat", "dog", "bird", "river", "mountain", "city", "garden", "window", "table", "teacher",
    "children", "morning", "evening", "story", "music", "letter", "train", "house", "forest", "ocean",
    "runs", "walks", "sings", "reads", "writes", "opens", "closes", "watches", "finds", "carries",
    "remembers", "follows", "builds", "paints", "listens", "travels", "waits", "speaks", "laughs", "dreams",
    "over", "under", "near", "through", "after", "before", "with", "without", "into", "across",
    "and", "but", "because", "while", "again", "today", "tomorrow", "softly", "quickly", "together",
    "yesterday", "always", "never", "somewhere", "everyone", "nothing", "beautiful", "wonderful", "strange", "gentle",
)


@dataclass(frozen=True)
class DemoCorpusSpec:
    model_dim: int = 64  # condition/emo_vec width; must equal the demo model's model_dim
    vocab_size: int = 160  # SentencePiece vocabulary size
    num_codes: int = 128  # codes are 0..num_codes-1; start/stop mel tokens come after
    num_train: int = 384
    num_val: int = 48
    num_speakers: int = 4
    seed: int = 1234


@dataclass(frozen=True)
class _CodeTable:
    """Per-token code pattern: token t -> base[t], base[t]+1, ... (length[t] codes)."""

    base: np.ndarray  # [vocab_size] int64
    length: np.ndarray  # [vocab_size] int64
    speaker_offset: np.ndarray  # [num_speakers] int64


@dataclass(frozen=True)
class _Utterance:
    utt_id: str
    speaker: str
    text: str
    text_ids: np.ndarray  # [L] int32
    codes: np.ndarray  # [T] int32
    emo_vec: np.ndarray  # [D] float32


def corpus_alphabet() -> set[str]:
    return set(front_end("".join(WORDS))) | {"."}


def generate(out: Path, spec: DemoCorpusSpec) -> None:
    # Independent child streams keep each part stable if another part changes.
    tok_rng, table_rng, cond_rng, train_rng, val_rng = (
        np.random.Generator(np.random.PCG64(s))
        for s in np.random.SeedSequence(spec.seed).spawn(5)
    )
    features = out / FEATURES_DIR
    features.mkdir()

    sentences = [front_end(_sentence(tok_rng)) for _ in range(TOKENIZER_SENTENCES)]
    tokenizer_bytes = _train_tokenizer(sentences, spec.vocab_size)
    (out / TOKENIZER_NAME).write_bytes(tokenizer_bytes)
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_bytes)

    table = _code_table(table_rng, spec)
    speakers = [f"spk{i}" for i in range(spec.num_speakers)]
    for speaker in speakers:
        condition = cond_rng.standard_normal((CONDITION_FRAMES, spec.model_dim), dtype=np.float32)
        np.save(features / f"{speaker}_condition.npy", condition, allow_pickle=False)

    train = _utterances("demo_train", spec.num_train, speakers, sp, table, spec, train_rng)
    val = _utterances("demo_val", spec.num_val, speakers, sp, table, spec, val_rng)
    for utt in (*train, *val):
        for kind in ("text_ids", "codes", "emo_vec"):
            np.save(features / f"{utt.utt_id}_{kind}.npy", getattr(utt, kind), allow_pickle=False)

    prompts = _choose_prompts(train, train_rng)
    _write_jsonl(out / TRAIN_MANIFEST_NAME, (_paired_row(t, p) for t, p in zip(train, prompts)))
    _write_jsonl(out / VAL_MANIFEST_NAME, (_single_row(u) for u in val))


def _sentence(rng: np.random.Generator) -> str:
    n_words = int(rng.integers(MIN_WORDS, MAX_WORDS + 1))
    words = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=n_words)]
    return " ".join(words) + " ."


def _train_tokenizer(sentences: Sequence[str], vocab_size: int) -> bytes:
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buffer,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=True,  # exactly vocab_size pieces, or fail loudly
        character_coverage=1.0,
        # Determinism: one thread, every sentence used in the given order.
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        # Ids expected by the GPT: start/stop text tokens are 0/1.
        bos_id=0,
        eos_id=1,
        unk_id=2,
        pad_id=-1,
        minloglevel=2,  # silence the trainer's progress chatter
    )
    return buffer.getvalue()


def _code_table(rng: np.random.Generator, spec: DemoCorpusSpec) -> _CodeTable:
    base = rng.integers(0, spec.num_codes, size=spec.vocab_size)
    length = rng.integers(MIN_PATTERN, MAX_PATTERN + 1, size=spec.vocab_size)
    # Speaker shifts the whole pattern, so the condition carries information.
    offset = (np.arange(spec.num_speakers) * 7) % spec.num_codes
    return _CodeTable(base=base, length=length, speaker_offset=offset)


def _text_to_codes(text_ids: np.ndarray, speaker_index: int, table: _CodeTable, num_codes: int) -> np.ndarray:
    shift = int(table.speaker_offset[speaker_index])
    runs = [
        (int(table.base[t]) + shift + np.arange(int(table.length[t]))) % num_codes
        for t in text_ids
    ]
    return np.concatenate(runs).astype(np.int32)


def _utterances(prefix: str, count: int, speakers: Sequence[str], sp: spm.SentencePieceProcessor,
                table: _CodeTable, spec: DemoCorpusSpec, rng: np.random.Generator) -> list[_Utterance]:
    utterances = []
    for index in range(count):
        speaker_index = index % len(speakers)  # balanced speakers
        while True:  # rejection sampling keeps lengths inside the limits; rarely loops
            text = _sentence(rng)
            text_ids = np.asarray(sp.encode(front_end(text), out_type=int), dtype=np.int32)
            codes = _text_to_codes(text_ids, speaker_index, table, spec.num_codes)
            if 0 < len(text_ids) <= MAX_TEXT_LEN and len(codes) <= MAX_CODE_LEN:
                break
        emo_vec = (0.1 * rng.standard_normal(spec.model_dim)).astype(np.float32)
        utterances.append(
            _Utterance(f"{prefix}_{index:05d}", speakers[speaker_index], text, text_ids, codes, emo_vec)
        )
    return utterances


def _choose_prompts(train: Sequence[_Utterance], rng: np.random.Generator) -> list[_Utterance]:
    """Pick, for each target, a different utterance of the same speaker as prompt."""
    by_speaker: dict[str, list[_Utterance]] = {}
    for utt in train:
        by_speaker.setdefault(utt.speaker, []).append(utt)
    prompts = []
    for utt in train:
        others = [u for u in by_speaker[utt.speaker] if u.utt_id != utt.utt_id]
        prompts.append(others[int(rng.integers(0, len(others)))])
    return prompts


def _rel(name: str) -> str:
    # Manifest paths are relative to the manifest's folder (the demo root).
    return f"{FEATURES_DIR}/{name}"


def _paired_row(target: _Utterance, prompt: _Utterance) -> dict:
    return {
        "id": f"{target.utt_id}__{prompt.utt_id}",
        "speaker": target.speaker,
        "prompt_id": prompt.utt_id,
        "prompt_condition_path": _rel(f"{prompt.speaker}_condition.npy"),
        "prompt_condition_len": CONDITION_FRAMES,
        "prompt_emo_vec_path": _rel(f"{prompt.utt_id}_emo_vec.npy"),
        "target_id": target.utt_id,
        "target_text": target.text,
        "target_text_ids_path": _rel(f"{target.utt_id}_text_ids.npy"),
        "target_text_len": int(len(target.text_ids)),
        "target_codes_path": _rel(f"{target.utt_id}_codes.npy"),
        "target_code_len": int(len(target.codes)),
        "target_emo_vec_path": _rel(f"{target.utt_id}_emo_vec.npy"),
        "language": LANGUAGE,
    }


def _single_row(utt: _Utterance) -> dict:
    return {
        "id": utt.utt_id,
        "speaker": utt.speaker,
        "text": utt.text,
        "text_ids_path": _rel(f"{utt.utt_id}_text_ids.npy"),
        "text_len": int(len(utt.text_ids)),
        "codes_path": _rel(f"{utt.utt_id}_codes.npy"),
        "code_len": int(len(utt.codes)),
        "condition_path": _rel(f"{utt.speaker}_condition.npy"),
        "condition_len": CONDITION_FRAMES,
        "emo_vec_path": _rel(f"{utt.utt_id}_emo_vec.npy"),
        "language": LANGUAGE,
    }


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
