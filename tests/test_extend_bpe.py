"""tools/tokenizer/extend_bpe.py: append pieces for a new script without changing any base id."""
from __future__ import annotations

import io
import json
import os
import random
import stat
import struct
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
import sentencepiece as spm

from tests.slowness import scaled
from trainers.tools.tokenizer import extend_bpe
from trainers.tools.tokenizer import sp_model_proto as proto

TOOLS_DIR = Path(__file__).resolve().parents[1] / "tools" / "tokenizer"  # the scripts users run

ENGLISH_WORDS = (
    "the", "a", "small", "large", "red", "green", "blue", "old", "new", "quiet", "happy", "bright",
    "dark", "cold", "warm", "fast", "slow", "little", "many", "every", "cat", "dog", "bird", "river",
    "mountain", "city", "garden", "window", "table", "teacher", "children", "morning", "evening",
    "story", "music", "letter", "train", "house", "forest", "ocean", "walks", "sings", "reads",
    "finds", "opens", "watches", "carries", "builds", "paints", "follows", "near", "under", "over",
    "behind", "with", "without", "today", "yesterday", "slowly", "quickly", "always", "never",
    "and", "but", "because", "while", "after", "before", "seven", "twelve", "hundred", "yellow",
    "purple", "kitchen", "bridge", "station", "journey", "question", "answer", "picture",
    "jazz", "box", "1990", "2048", "365", "7", ",",  # the whole alphabet, every digit, and the held-out punctuation
)
# Held-out English: unseen combinations, unseen words, digits and punctuation.
HELD_OUT_EXTRA = ("zebra", "quartz", "jukebox", "vexing", "42", "2024", "3.14", "hello,", "why?", "okay!")
ENGLISH_TRAIN_SENTENCES = 3000
ENGLISH_HELD_OUT_SENTENCES = 400

ETHIOPIC_SYLLABLES = 60
ETHIOPIC_STEMS = 150
ETHIOPIC_WORDS = 1200
ETHIOPIC_SENTENCES = 1500
ETHIOPIC_FULL_STOP = "\u1362"  # ።
ENGLISH_EVERY = 25  # every 25th corpus line is plain English
BASE_VOCAB = 300
# Pieces appended in the acceptance runs; unigram training finds fewer candidates in this corpus.
TARGET_EXTRA = {"bpe": 400, "unigram": 200, "bpe_byte_fallback": 400}


# ----------------------------------------------------------------------------- corpora

def english_sentence(rng: random.Random, words: tuple[str, ...]) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 10))) + rng.choice((" .", " ?", " !", ""))


def english_lines(seed: int, count: int, words: tuple[str, ...]) -> list[str]:
    rng = random.Random(seed)
    return [english_sentence(rng, words) for _ in range(count)]


def ethiopic_syllables() -> list[str]:
    assigned = [chr(c) for c in range(0x1200, 0x135B) if unicodedata.category(chr(c)) == "Lo"]
    return sorted(random.Random(7).sample(assigned, ETHIOPIC_SYLLABLES))


def ethiopic_lines(seed: int = 11) -> list[str]:
    """Amharic-like text: words are an optional prefix + stem + optional suffix, so pieces recur
    across words as in a real language; some lines mix in lower-case Latin and digits, and a few
    are plain English, as real corpora do."""
    rng = random.Random(seed)
    syllables = ethiopic_syllables()

    def morph(low: int, high: int) -> str:
        return "".join(rng.choice(syllables) for _ in range(rng.randint(low, high)))

    stems = [morph(1, 3) for _ in range(ETHIOPIC_STEMS)]
    prefixes = [""] * 6 + [morph(1, 1) for _ in range(6)]
    suffixes = [""] * 6 + [morph(1, 2) for _ in range(12)]
    words = [rng.choice(prefixes) + rng.choice(stems) + rng.choice(suffixes) for _ in range(ETHIOPIC_WORDS)]
    lines = []
    for i in range(ETHIOPIC_SENTENCES):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9)))
        if i % 10 == 3:
            sentence += f" ok {rng.randint(1, 99)}"
        if i % ENGLISH_EVERY == 7:
            lines.append(english_sentence(rng, ENGLISH_WORDS))
        else:
            lines.append(sentence + " " + ETHIOPIC_FULL_STOP)
    return lines


def train_base(path: Path, model_type: str, byte_fallback: bool = False) -> Path:
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(line.upper() for line in english_lines(1, ENGLISH_TRAIN_SENTENCES, ENGLISH_WORDS)),
        model_writer=buffer, model_type=model_type,
        vocab_size=BASE_VOCAB + (256 if byte_fallback else 0), byte_fallback=byte_fallback,
        character_coverage=1.0, num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
        bos_id=0, eos_id=1, unk_id=2, pad_id=-1, minloglevel=2,
        hard_vocab_limit=model_type == "bpe",  # unigram finds fewer pieces in this small word list
    )
    path.write_bytes(buffer.getvalue())
    return path


@dataclass
class Assets:
    root: Path
    bases: dict[str, Path]
    jsonl: Path
    plain: Path
    held_out: Path
    held_out_lines: list[str]
    corpus: list[str]
    new_chars: set[str]  # the corpus characters the English base has no piece for


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    root = tmp_path_factory.mktemp("extend_bpe")
    bases = {
        "bpe": train_base(root / "base_bpe.model", "bpe"),
        "unigram": train_base(root / "base_unigram.model", "unigram"),
        "bpe_byte_fallback": train_base(root / "base_bpe_bf.model", "bpe", byte_fallback=True),
    }
    corpus = ethiopic_lines()
    jsonl = root / "am_train.jsonl"
    jsonl.write_text("".join(json.dumps({"audio": f"a{i}.wav", "text": t}, ensure_ascii=False) + "\n"
                             for i, t in enumerate(corpus)), encoding="utf-8")
    plain = root / "am_train.txt"
    plain.write_text("\n".join(corpus) + "\n", encoding="utf-8")
    held_out_lines = english_lines(2, ENGLISH_HELD_OUT_SENTENCES, ENGLISH_WORDS + HELD_OUT_EXTRA)
    held_out = root / "english.txt"
    held_out.write_text("\n".join(held_out_lines) + "\n", encoding="utf-8")
    ethiopic = {c for line in corpus for c in line if 0x1200 <= ord(c) <= 0x137F}
    return Assets(root, bases, jsonl, plain, held_out, held_out_lines, corpus, ethiopic)


def sp_size(path: Path) -> int:
    return spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()


def run_tool(args: list[str]) -> int:
    return extend_bpe.main([str(a) for a in args])


def extend_args(assets: Assets, kind: str, out: Path, target: int, manifest: Path | None = None,
                *extra: object) -> list[object]:
    return ["--base-model", assets.bases[kind], "--manifests", manifest or assets.jsonl,
            "--output-model", out / "ext.model", "--output-vocab", out / "ext.vocab",
            "--target-size", target, "--check-text", assets.held_out, *extra]


@dataclass
class Extended:
    kind: str
    base: Path
    model: Path
    vocab: Path
    report: dict


@pytest.fixture(scope="module", params=["bpe", "unigram", "bpe_byte_fallback"])
def extended(request: pytest.FixtureRequest, assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> Extended:
    kind = request.param
    out = tmp_path_factory.mktemp(f"ext_{kind}")
    base = assets.bases[kind]
    # The unigram run reads the plain-text copy of the corpus, the others the JSONL.
    manifest = assets.plain if kind == "unigram" else assets.jsonl
    assert run_tool(extend_args(assets, kind, out, sp_size(base) + TARGET_EXTRA[kind], manifest)) == 0
    report = json.loads((out / "ext.model.report.json").read_text(encoding="utf-8"))
    return Extended(kind, base, out / "ext.model", out / "ext.vocab", report)


def load(path: Path) -> tuple[spm.SentencePieceProcessor, proto.ModelProto]:
    return spm.SentencePieceProcessor(model_file=str(path)), proto.parse_model(path.read_bytes())


# ----------------------------------------------------------------------------- acceptance

def test_base_pieces_and_english_ids_unchanged_and_new_script_has_no_unk(extended: Extended, assets: Assets) -> None:
    base_sp, base = load(extended.base)
    new_sp, new = load(extended.model)
    assert new_sp.get_piece_size() == len(base.pieces) + TARGET_EXTRA[extended.kind]
    for i, piece in enumerate(base.pieces):
        assert (new.pieces[i].piece, new.pieces[i].score, new.pieces[i].type) == (piece.piece, piece.score, piece.type)
        assert new.pieces[i].raw == piece.raw
        assert (new_sp.id_to_piece(i), new_sp.get_score(i)) == (base_sp.id_to_piece(i), base_sp.get_score(i))
    english = [line.upper() for line in assets.held_out_lines]
    assert new_sp.encode(english) == base_sp.encode(english)

    unknown = {i for i, p in enumerate(base.pieces) if p.type in (proto.UNKNOWN, proto.BYTE)}
    corpus = [line.upper() for line in assets.corpus]
    before = [i for ids in base_sp.encode(corpus) for i in ids if i in unknown]
    after = [i for ids in new_sp.encode(corpus) for i in ids if i in unknown]
    assert before and not after
    assert new_sp.decode(new_sp.encode(corpus[0])) == corpus[0]
    # The appended multi-character pieces are used, not just the single characters.
    ids = [i for line in new_sp.encode(corpus) for i in line]
    multi = [i for i in ids if i >= len(base.pieces) and len(new_sp.id_to_piece(i)) > 1]
    assert len(multi) > 0.2 * len(ids), (len(multi), len(ids))


def test_appended_pieces_are_normal_hold_a_new_char_and_cover_every_new_char(extended: Extended,
                                                                             assets: Assets) -> None:
    _, base = load(extended.base)
    _, new = load(extended.model)
    covered = {c for p in base.pieces if p.type in (proto.NORMAL, proto.USER_DEFINED, proto.UNUSED) for c in p.piece}
    appended = new.pieces[len(base.pieces):]
    assert all(p.type == proto.NORMAL for p in appended)
    assert all(any(c not in covered for c in p.piece) for p in appended)
    assert not any(c != c.upper() for p in appended for c in p.piece), "lower-case pieces are never produced"
    texts = [p.piece for p in appended]
    assert len(set(texts)) == len(texts)
    corpus_new = {c for line in assets.corpus for c in line.upper() if c not in covered and not c.isspace()}
    assert corpus_new == assets.new_chars and ETHIOPIC_FULL_STOP in corpus_new
    assert corpus_new <= set(texts)
    multi = [p for p in appended if len(p.piece) > 1]
    assert len(multi) == extended.report["multi_char_pieces_added"] > 100


def test_appended_piece_scores(extended: Extended) -> None:
    _, base = load(extended.base)
    _, new = load(extended.model)
    appended = new.pieces[len(base.pieces):]
    scores = [p.score for p in appended]
    if extended.kind == "unigram":
        # Log-probabilities inside the base's NORMAL range: unk penalty and user-defined scores unchanged.
        normal = [p.score for p in base.pieces if p.type == proto.NORMAL]
        assert min(normal) <= min(scores) and max(scores) <= max(normal)
        return
    # BPE: strictly below every base score, in candidate rank order, all distinct.
    assert max(scores) < min(p.score for p in base.pieces)
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)
    # Every multi-character piece is the merge of two pieces listed before it.
    vocab = {p.piece for p in base.pieces if p.type == proto.NORMAL} | {p.piece for p in appended if len(p.piece) == 1}
    for piece in (p.piece for p in appended if len(p.piece) > 1):
        assert any(piece[:i] in vocab and piece[i:] in vocab for i in range(1, len(piece))), piece
        vocab.add(piece)


def test_add_unicode_blocks_adds_the_whole_ethiopic_block(assets: Assets, tmp_path: Path) -> None:
    ethiopic = {chr(c) for c in range(0x1200, 0x1380) if unicodedata.category(chr(c)) != "Cn"}
    target = BASE_VOCAB + len(ethiopic) + 100
    assert run_tool(extend_args(assets, "bpe", tmp_path, target, None, "--add-unicode-blocks")) == 0
    sp, new = load(tmp_path / "ext.model")
    texts = {p.piece for p in new.pieces[BASE_VOCAB:]}
    assert ethiopic <= texts
    report = json.loads((tmp_path / "ext.model.report.json").read_text(encoding="utf-8"))
    assert report["unicode_blocks"] == ["Ethiopic"]
    assert report["unicode_block_pieces_added"] == len(ethiopic) - len(assets.new_chars)
    assert report["single_char_pieces_added"] == len(ethiopic)
    assert sp.get_piece_size() == target


def test_report_contents(extended: Extended, assets: Assets) -> None:
    report = extended.report
    assert report["base_size"] == sp_size(extended.base)
    assert report["new_size"] == report["base_size"] + TARGET_EXTRA[extended.kind] == sp_size(extended.model)
    assert report["pieces_added"] == report["multi_char_pieces_added"] + report["single_char_pieces_added"]
    assert report["new_characters_found"] == report["new_characters_covered"] == len(assets.new_chars)
    assert set(report["new_characters"]) == assets.new_chars
    assert report["unk_before"]["unk_rate"] > 0 and report["unk_before"]["lines_with_unk"] > 0
    assert report["unk_after"]["unk_rate"] == 0 and report["unk_after"]["lines_with_unk"] == 0
    assert report["base_lines_changed"] == 0
    # Held-out lines + corpus lines without Ethiopic + synthetic lines.
    english_in_corpus = ETHIOPIC_SENTENCES // ENGLISH_EVERY
    assert report["base_lines_checked"] > ENGLISH_HELD_OUT_SENTENCES + english_in_corpus + 100
    assert report["check_lines_skipped"] == 0
    assert report["model_type"] == ("unigram" if extended.kind == "unigram" else "bpe")


def test_vocab_file_lists_every_piece_with_its_score(extended: Extended) -> None:
    _, new = load(extended.model)
    rows = extended.vocab.read_text(encoding="utf-8").splitlines()
    assert len(rows) == len(new.pieces)
    for row, piece in zip(rows, new.pieces):
        text, score = row.split("\t")
        assert text == piece.piece and float(score) == pytest.approx(piece.score, rel=1e-5, abs=1e-5)


def test_printed_report_lines(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 100)) == 0
    err = capsys.readouterr().err
    assert "report base_lines_changed=0" in err
    assert "report new_size=400" in err
    assert "report unk_after " in err and "unk_tokens=0" in err


# ----------------------------------------------------------------------------- proto reader/writer

@pytest.mark.parametrize("kind", ["bpe", "unigram", "bpe_byte_fallback"])
def test_proto_round_trip_is_byte_identical(assets: Assets, kind: str) -> None:
    data = assets.bases[kind].read_bytes()
    model = proto.parse_model(data)
    assert proto.serialize_model(model) == data
    sp = spm.SentencePieceProcessor(model_proto=data)
    assert [p.piece for p in model.pieces] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert [p.score for p in model.pieces] == [sp.get_score(i) for i in range(sp.get_piece_size())]
    assert model.pieces[2].type == proto.UNKNOWN and model.pieces[0].type == proto.CONTROL
    assert model.model_type == (proto.UNIGRAM if kind == "unigram" else proto.BPE)
    assert model.byte_fallback == (kind == "bpe_byte_fallback")  # TrainerSpec field 35
    # Re-encoding every piece from its decoded fields also reproduces sentencepiece's bytes.
    fresh = proto.ModelProto([proto.Piece(p.piece, p.score, p.type) for p in model.pieces], model.other_fields)
    assert proto.serialize_model(fresh) == data


def test_trainer_spec_vocab_size_is_updated(assets: Assets, extended: Extended) -> None:
    base = proto.parse_model(extended.base.read_bytes())
    new = proto.parse_model(extended.model.read_bytes())
    assert base.trainer_vocab_size == len(base.pieces)
    assert new.trainer_vocab_size == len(new.pieces)
    # Only vocab_size changed in the trainer spec; everything else is carried verbatim.
    strip = [f for f in base.trainer_spec() if f.number != proto.TRAINER_VOCAB_SIZE]
    assert strip == [f for f in new.trainer_spec() if f.number != proto.TRAINER_VOCAB_SIZE]
    assert base.normalizer_spec() == new.normalizer_spec()


def test_proto_fields_and_defaults() -> None:
    # A hand-made model: one piece without score/type fields, one of each special kind, and an
    # unknown top-level field that must survive.
    def record(payload: bytes) -> bytes:
        return proto.encode_length_delimited(1, payload)

    bare = record(proto.encode_length_delimited(1, "▁AB".encode()))
    byte = record(proto.encode_length_delimited(1, b"<0x41>") + proto.encode_tag(2, proto.FIXED32)
                  + struct.pack("<f", -1.5) + proto.encode_tag(3, proto.VARINT) + proto.encode_varint(proto.BYTE))
    trainer = proto.encode_length_delimited(2, proto.encode_tag(3, proto.VARINT) + proto.encode_varint(2))
    unknown = proto.encode_tag(99, proto.VARINT) + proto.encode_varint(2**64 - 1)  # int -1
    data = bare + byte + trainer + unknown
    model = proto.parse_model(data)
    assert model.pieces == [proto.Piece("▁AB", 0.0, proto.NORMAL), proto.Piece("<0x41>", -1.5, proto.BYTE)]
    assert model.model_type == proto.BPE and model.trainer_vocab_size is None
    assert proto.serialize_model(model) == data
    assert proto.serialize_model(model.with_trainer_vocab_size(10)) == data  # absent stays absent
    assert proto.to_int32(proto.read_varint(proto.encode_varint(-1), 0)[0]) == -1
    assert proto.parse_model(trainer + record(proto.encode_length_delimited(1, b"X"))).model_type == proto.BPE
    no_type = proto.ModelProto([proto.Piece("X", 0.0)], [])
    assert no_type.model_type == proto.UNIGRAM  # TrainerSpec.model_type default


@pytest.mark.parametrize("data", [b"", b"\x0a\x05ab", b"\x0a", b"\xff" * 11, b"\x0b\x00", b"not a model at all"])
def test_proto_rejects_malformed_bytes(data: bytes) -> None:
    with pytest.raises(proto.ProtoError):
        proto.parse_model(data)


# ----------------------------------------------------------------------------- refusals

def assert_refused(args: list[object], out: Path, capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    before = sorted(out.rglob("*"))
    assert run_tool(args) == extend_bpe.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") or "\nerror: " in err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    assert sorted(out.rglob("*")) == before, "nothing may be written on failure"
    return err


def test_refuses_target_not_above_base(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_refused(extend_args(assets, "bpe", tmp_path, BASE_VOCAB), tmp_path, capsys, "--target-size 300",
                   "larger than the base model's 300")


def test_refuses_when_new_characters_alone_exceed_target(assets: Assets, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    count = len(assets.new_chars)
    assert_refused(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 10), tmp_path, capsys,
                   f"{count} new characters", f"at least {BASE_VOCAB + count}")
    assert_refused(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + count + 10, None, "--add-unicode-blocks"),
                   tmp_path, capsys, "more from --add-unicode-blocks")
    # Exactly room for the single characters: accepted, with no multi-character piece.
    assert run_tool(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + count)) == 0
    report = json.loads((tmp_path / "ext.model.report.json").read_text(encoding="utf-8"))
    assert (report["multi_char_pieces_added"], report["single_char_pieces_added"]) == (0, count)
    assert report["unk_after"]["unk_tokens"] == 0


def test_refuses_too_few_candidates(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = assert_refused(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 20000), tmp_path, capsys,
                         "admissible candidates", "largest possible target is", "--candidate-size")
    largest = int(err.split("largest possible target is ")[1].split(".")[0])
    assert run_tool(extend_args(assets, "bpe", tmp_path, largest)) == 0


def test_refuses_empty_corpus(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    assert_refused(extend_args(assets, "bpe", tmp_path, 400, empty), tmp_path, capsys, "no text found")


def test_refuses_corrupt_base_model(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(assets.bases["bpe"].read_bytes()[:-7])
    args = extend_args(assets, "bpe", tmp_path, 400)
    args[1] = corrupt
    assert_refused(args, tmp_path, capsys, f"--base-model {corrupt}", "not a valid SentencePiece model")
    vocab_as_model = tmp_path / "bpe.vocab"
    vocab_as_model.write_text("<unk>\t0\n", encoding="utf-8")
    args[1] = vocab_as_model
    assert_refused(args, tmp_path, capsys, "not a valid SentencePiece model")


def test_refuses_output_equal_to_base(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "bpe.model"
    base.write_bytes(assets.bases["bpe"].read_bytes())
    original = base.read_bytes()
    args = extend_args(assets, "bpe", tmp_path, 400)
    args[1] = base
    args[args.index("--output-model") + 1] = tmp_path / "." / "bpe.model"
    assert_refused(args, tmp_path, capsys, "--output-model", "is the --base-model")
    assert base.read_bytes() == original


@pytest.mark.parametrize("line, needle", [
    ('{"text": "ሰላም"', "not valid JSON"),
    ('{"audio": "a.wav"}', 'no text field ("text" or "target_text")'),
    ('["ሰላም"]', "not a JSON object"),
    ('{"text": 5}', '"text" is 5 (int), not a string'),
    ('{"prompt_condition_path": "p.npy", "target_codes_path": "c.npy", "text": "ሰላም"}',
     'no text field ("target_text") in this paired line'),
    ('{"text": "ሰላም", "target_text": "ለዓለም"}', '"text" and "target_text" differ'),
])
def test_refuses_bad_jsonl_line_naming_file_and_line(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     line: str, needle: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ሰላም ለዓለም"}\n\n' + line + "\n", encoding="utf-8")
    assert_refused(extend_args(assets, "bpe", tmp_path, 400, bad), tmp_path, capsys, f"{bad}:3:", needle)


def test_refuses_missing_manifest(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_refused(extend_args(assets, "bpe", tmp_path, 400, tmp_path / "nope.jsonl"), tmp_path, capsys,
                   "nope.jsonl: no such file")


def test_refuses_corpus_without_new_characters(assets: Assets, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert_refused(extend_args(assets, "bpe", tmp_path, 400, assets.held_out), tmp_path, capsys,
                   "no character that the base model lacks")


# ----------------------------------------------------------------------------- details

def test_changed_base_line_is_detected(assets: Assets) -> None:
    """The safety net itself: a piece made only of base characters changes English ids, and the
    comparison used before writing must catch it."""
    base_sp, base = load(assets.bases["unigram"])
    top = max(p.score for p in base.pieces if p.type == proto.NORMAL)
    # Unigram training splits at spaces, so no base piece spans two words.
    bad = proto.ModelProto(base.pieces + [proto.Piece("▁SMALL▁CAT", top)], base.other_fields)
    bad_sp = spm.SentencePieceProcessor(model_proto=proto.serialize_model(bad))
    assert extend_bpe.changed_lines(base_sp, bad_sp, ["the small cat", "a dog"]) == ["THE SMALL CAT"]


def test_lowercase_text_is_harvested_upper_cased(assets: Assets, tmp_path: Path) -> None:
    greek = tmp_path / "greek.txt"
    rng = random.Random(3)
    words = ["".join(rng.choice("αβγδεζηθικλμνξοπρστυφχψω") for _ in range(rng.randint(2, 6))) for _ in range(200)]
    greek.write_text("\n".join(" ".join(rng.choice(words) for _ in range(6)) for _ in range(600)) + "\n",
                     encoding="utf-8")
    assert run_tool(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 150, greek)) == 0
    _, new = load(tmp_path / "ext.model")
    appended = "".join(p.piece for p in new.pieces[BASE_VOCAB:])
    assert not any(c.islower() for c in appended)
    assert "Α" in appended and "α" not in appended


def test_candidate_size_too_small_for_the_corpus_is_retried(assets: Assets, tmp_path: Path) -> None:
    assert run_tool(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 100, None, "--candidate-size", 5)) == 0
    report = json.loads((tmp_path / "ext.model.report.json").read_text(encoding="utf-8"))
    assert report["candidate_size"] > 5


def test_script_runs_from_another_directory(assets: Assets, tmp_path: Path) -> None:
    import subprocess

    script = TOOLS_DIR / "extend_bpe.py"
    args = [str(a) for a in extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 100)]
    done = subprocess.run([sys.executable, str(script), *args, "--report", str(tmp_path / "r.json")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    assert "report base_lines_changed=0" in done.stderr
    assert json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["new_size"] == BASE_VOCAB + 100
    bad = subprocess.run([sys.executable, str(script), "--base-model", "missing.model"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=scaled(120))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr


def test_failed_base_line_check_writes_nothing(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extend_bpe, "changed_lines", lambda old, new, lines: ["THE CAT"])
    assert run_tool(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 100)) == extend_bpe.EXIT_FAILED
    err = capsys.readouterr().err
    assert "error: 1 of" in err and "tokenize differently" in err and "'THE CAT'" in err
    assert list(tmp_path.iterdir()) == []


def test_written_model_check_compares_every_base_piece(assets: Assets, tmp_path: Path) -> None:
    base = extend_bpe.load_base(assets.bases["bpe"])
    pieces = list(base.proto.pieces)
    good = tmp_path / "good.model"
    good.write_bytes(proto.serialize_model(proto.ModelProto(pieces + [proto.Piece("\u1200", -999.0)],
                                                            base.proto.other_fields)))
    extend_bpe.verify_model_file(good, base, len(pieces) + 1)
    pieces[5] = proto.Piece(pieces[5].piece, pieces[5].score - 0.5, pieces[5].type)
    bad = tmp_path / "bad.model"
    bad.write_bytes(proto.serialize_model(proto.ModelProto(pieces + [proto.Piece("\u1200", -999.0)],
                                                           base.proto.other_fields)))
    with pytest.raises(extend_bpe.VerificationError, match="piece 5 differs"):
        extend_bpe.verify_model_file(bad, base, len(pieces) + 1)


def test_manifest_format_is_chosen_by_extension(tmp_path: Path) -> None:
    rows = '{"text": "ሰላም  ለዓለም"}\n\n{"text": "", "note": "empty text is skipped"}\n'
    for name in ("a.jsonl", "a.json", "a.JSONL"):
        (tmp_path / name).write_text(rows, encoding="utf-8")
        assert extend_bpe.read_lines(tmp_path / name, "--manifests") == ["ሰላም ለዓለም"]
    (tmp_path / "a.txt").write_text("\ufeffone line\n\n  {\"text\": \"x\"}  \n", encoding="utf-8")
    assert extend_bpe.read_lines(tmp_path / "a.txt", "--manifests") == ["one line", '{"text": "x"}']


def test_paired_training_manifests_give_their_target_text(assets: Assets, tmp_path: Path) -> None:
    """The manifests retokenize_manifest.py takes: paired lines hold their text in "target_text"; a single-utterance
    line may too. The corpus read from them is the same as from a plain "text" file: the same model bytes."""
    rows = []
    for i, text in enumerate(assets.corpus):
        if i % 3:
            rows.append({"id": f"t{i}__p{i}", "prompt_condition_path": f"c/{i}.npy", "target_codes_path": f"k/{i}.npy",
                         "target_text": text, "target_text_ids_path": f"t/{i}.npy"})
        else:
            rows.append({"text_ids_path": f"t/{i}.npy", "codes_path": f"k/{i}.npy", "target_text": text})
    paired = tmp_path / "pairs.jsonl"
    paired.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    target = BASE_VOCAB + 100
    assert run_tool(extend_args(assets, "bpe", tmp_path / "paired", target, paired)) == 0
    assert run_tool(extend_args(assets, "bpe", tmp_path / "text", target, assets.jsonl)) == 0
    assert (tmp_path / "paired" / "ext.model").read_bytes() == (tmp_path / "text" / "ext.model").read_bytes()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_output_files_honour_the_umask(assets: Assets, tmp_path: Path, umask: int, mode: int) -> None:
    """Like any file a program creates, not 0600 whatever the umask (the temporary file's mode, kept by the rename)."""
    before = os.umask(umask)
    try:
        assert run_tool(extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 100)) == 0
    finally:
        os.umask(before)
    written = sorted(tmp_path.iterdir())
    assert [p.name for p in written] == ["ext.model", "ext.model.report.json", "ext.vocab"]
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == {p.name: oct(mode) for p in written}


def test_same_inputs_give_the_same_bytes(assets: Assets, extended: Extended, tmp_path: Path) -> None:
    manifest = assets.plain if extended.kind == "unigram" else assets.jsonl
    target = sp_size(extended.base) + TARGET_EXTRA[extended.kind]
    assert run_tool(extend_args(assets, extended.kind, tmp_path, target, manifest)) == 0
    assert (tmp_path / "ext.model").read_bytes() == extended.model.read_bytes()
    assert (tmp_path / "ext.vocab").read_bytes() == extended.vocab.read_bytes()


# ----------------------------------------------------------------------------- lower-case base

def train_lowercase_base(path: Path) -> Path:
    """A base trained on text that was NOT upper-cased: it has 'a'..'z' but no 'A'..'Z'."""
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(english_lines(1, ENGLISH_TRAIN_SENTENCES, ENGLISH_WORDS)),
        model_writer=buffer, model_type="bpe", vocab_size=BASE_VOCAB, character_coverage=1.0,
        num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
        bos_id=0, eos_id=1, unk_id=2, pad_id=-1, minloglevel=2)
    path.write_bytes(buffer.getvalue())
    return path


def test_lowercase_base_refusal_exits_2_and_explains_the_upper_casing(assets: Assets, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """IndexTTS2 upper-cases text, so with a lower-case base the corpus's Latin letters ('OK', the
    English lines) count as new characters, and their pieces change how upper-cased base-language
    lines tokenize. That is a problem with the inputs: status 2, the cause and the remedy."""
    base = train_lowercase_base(tmp_path / "lower.model")
    args = extend_args(assets, "bpe", tmp_path, BASE_VOCAB + 150)
    args[1] = base
    err = assert_refused(args, tmp_path, capsys, "tokenize differently", "Cause: the base model was trained on "
                         "text that was not upper-cased", "'a' but not 'A'", "IndexTTS2 upper-cases text",
                         "Remedy: extend a base model trained on upper-cased text")
    assert err.startswith("warning: ") and "has lower-case letters and no upper-case ones" in err.splitlines()[0]
