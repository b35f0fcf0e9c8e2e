"""Read and write the few SentencePiece ModelProto records the tokenizer tools need.

This speaks the protobuf wire format directly (varints, fixed32, length-delimited records)
instead of importing protobuf / sentencepiece_model_pb2, whose generated code breaks when the
installed protobuf runtime changes major version. Only the piece list is decoded; every other
top-level field (trainer spec, normalizer spec, self-test data, denormalizer spec) is carried
as its original bytes, so nothing this module does not understand is lost on a rewrite.

ModelProto layout used here (sentencepiece_model.proto):
  ModelProto    1 pieces (repeated SentencePiece), 2 trainer_spec, 3 normalizer_spec,
                4 self_test_data, 5 denormalizer_spec
  SentencePiece 1 piece (string), 2 score (float), 3 type (enum, default NORMAL)
  TrainerSpec   3 model_type (enum, default UNIGRAM), 4 vocab_size (int32), ... 35 byte_fallback
  NormalizerSpec 1 name (string), 3 add_dummy_prefix (bool, default true), 4 remove_extra_whitespaces
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Iterator

# SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# TrainerSpec.ModelType
UNIGRAM, BPE, WORD, CHAR = 1, 2, 3, 4
MODEL_TYPE_NAMES = {UNIGRAM: "unigram", BPE: "bpe", WORD: "word", CHAR: "char"}

# Wire types.
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
FIXED_SIZES = {FIXED32: 4, FIXED64: 8}

# Top-level ModelProto field numbers.
PIECES_FIELD, TRAINER_SPEC_FIELD, NORMALIZER_SPEC_FIELD = 1, 2, 3
# TrainerSpec field numbers.
TRAINER_MODEL_TYPE, TRAINER_VOCAB_SIZE, TRAINER_BYTE_FALLBACK = 3, 4, 35

_MASK64 = (1 << 64) - 1


class ProtoError(ValueError):
    """The bytes are not a well-formed protobuf message of the expected shape."""


@dataclass(frozen=True)
class Field:
    """One wire-format field: decoded value plus the exact bytes it was read from."""

    number: int
    wire_type: int
    value: int | bytes  # int for varints, payload bytes for the other wire types
    raw: bytes  # tag + payload exactly as read; reused verbatim when writing back


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Decode a base-128 varint at ``pos``; return (value, position after it)."""
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ProtoError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise ProtoError("varint longer than 10 bytes")


def encode_varint(value: int) -> bytes:
    """Encode a varint; negative numbers take the 10-byte two's complement form, as protobuf does."""
    value &= _MASK64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def to_int32(value: int) -> int:
    """Reinterpret a decoded varint as a signed int32/int64 (enum and int32 fields)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def iter_fields(data: bytes) -> Iterator[Field]:
    """Yield the fields of one message in wire order; raise ProtoError on malformed bytes."""
    pos = 0
    while pos < len(data):
        start = pos
        tag, pos = read_varint(data, pos)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise ProtoError(f"field number 0 at byte {start}")
        if wire_type == VARINT:
            value, pos = read_varint(data, pos)
            yield Field(number, wire_type, value, data[start:pos])
            continue
        if wire_type == LENGTH_DELIMITED:
            size, pos = read_varint(data, pos)
        elif wire_type in FIXED_SIZES:
            size = FIXED_SIZES[wire_type]
        else:  # 3/4 are the deprecated groups, 6/7 do not exist; sentencepiece uses neither
            raise ProtoError(f"unsupported wire type {wire_type} at byte {start}")
        if pos + size > len(data):
            raise ProtoError(f"field {number} at byte {start} runs past the end of the data")
        pos += size
        yield Field(number, wire_type, data[pos - size:pos], data[start:pos])


def encode_tag(number: int, wire_type: int) -> bytes:
    return encode_varint((number << 3) | wire_type)


def encode_length_delimited(number: int, payload: bytes) -> bytes:
    return encode_tag(number, LENGTH_DELIMITED) + encode_varint(len(payload)) + payload


@dataclass(frozen=True)
class Piece:
    """One vocabulary entry. ``raw`` is the original record, written back unchanged."""

    piece: str
    score: float
    type: int = NORMAL
    raw: bytes = field(default=b"", repr=False, compare=False)

    def record(self) -> bytes:
        """The top-level ``pieces`` record: the original bytes when still accurate, else encoded."""
        if self.raw and _decode_piece(_payload(self.raw)) == (self.piece, self.score, self.type):
            return self.raw
        payload = encode_length_delimited(1, self.piece.encode("utf-8"))
        payload += encode_tag(2, FIXED32) + struct.pack("<f", self.score)
        if self.type != NORMAL:  # sentencepiece leaves the default type out too
            payload += encode_tag(3, VARINT) + encode_varint(self.type)
        return encode_length_delimited(PIECES_FIELD, payload)


def _payload(record: bytes) -> bytes:
    """Strip tag and length from a length-delimited record."""
    (only,) = iter_fields(record)
    return only.value  # type: ignore[return-value]


def _decode_piece(payload: bytes) -> tuple[str, float, int]:
    text, score, piece_type = "", 0.0, NORMAL
    for f in iter_fields(payload):
        if f.number == 1 and f.wire_type == LENGTH_DELIMITED:
            try:
                text = f.value.decode("utf-8")  # type: ignore[union-attr]
            except UnicodeDecodeError as exc:
                raise ProtoError(f"piece text is not UTF-8: {exc}") from None
        elif f.number == 2 and f.wire_type == FIXED32:
            (score,) = struct.unpack("<f", f.value)
        elif f.number == 3 and f.wire_type == VARINT:
            piece_type = to_int32(f.value)  # type: ignore[arg-type]
    return text, score, piece_type


@dataclass
class ModelProto:
    """A parsed .model file: the pieces, and every other top-level field kept verbatim."""

    pieces: list[Piece]
    other_fields: list[Field]

    def _sub_message(self, number: int) -> list[Field] | None:
        for f in self.other_fields:
            if f.number == number and f.wire_type == LENGTH_DELIMITED:
                return list(iter_fields(f.value))  # type: ignore[arg-type]
        return None

    def trainer_spec(self) -> list[Field]:
        """TrainerSpec fields in wire order (empty when the model has none)."""
        return self._sub_message(TRAINER_SPEC_FIELD) or []

    def normalizer_spec(self) -> list[Field]:
        return self._sub_message(NORMALIZER_SPEC_FIELD) or []

    @property
    def model_type(self) -> int:
        return to_int32(last_varint(self.trainer_spec(), TRAINER_MODEL_TYPE, UNIGRAM))

    @property
    def byte_fallback(self) -> bool:
        return bool(last_varint(self.trainer_spec(), TRAINER_BYTE_FALLBACK, 0))

    @property
    def trainer_vocab_size(self) -> int | None:
        value = last_varint(self.trainer_spec(), TRAINER_VOCAB_SIZE, None)
        return None if value is None else to_int32(value)

    def with_trainer_vocab_size(self, vocab_size: int) -> ModelProto:
        """A copy whose TrainerSpec.vocab_size says ``vocab_size``; left absent if it was absent."""
        others = [_replace_varint(f, TRAINER_VOCAB_SIZE, vocab_size)
                  if f.number == TRAINER_SPEC_FIELD and f.wire_type == LENGTH_DELIMITED else f
                  for f in self.other_fields]
        return ModelProto(list(self.pieces), others)


def last_varint(fields: list[Field], number: int, default: int | None) -> int | None:
    """A non-repeated varint field (int32, bool, enum): the last occurrence wins, as in protobuf."""
    value = default
    for f in fields:
        if f.number == number and f.wire_type == VARINT:
            value = f.value  # type: ignore[assignment]
    return value


def _replace_varint(message: Field, number: int, value: int) -> Field:
    inner = [
        Field(f.number, f.wire_type, value, encode_tag(number, VARINT) + encode_varint(value))
        if f.number == number and f.wire_type == VARINT else f
        for f in iter_fields(message.value)  # type: ignore[arg-type]
    ]
    payload = b"".join(f.raw for f in inner)
    return Field(message.number, LENGTH_DELIMITED, payload, encode_length_delimited(message.number, payload))


def parse_model(data: bytes) -> ModelProto:
    """Parse .model bytes; raise ProtoError when they are not a SentencePiece ModelProto."""
    pieces: list[Piece] = []
    others: list[Field] = []
    for f in iter_fields(data):
        if f.number == PIECES_FIELD and f.wire_type == LENGTH_DELIMITED:
            text, score, piece_type = _decode_piece(f.value)  # type: ignore[arg-type]
            pieces.append(Piece(text, score, piece_type, f.raw))
        elif f.number == PIECES_FIELD:
            raise ProtoError(f"pieces field has wire type {f.wire_type}, expected a message")
        else:
            others.append(f)
    if not pieces:
        raise ProtoError("no pieces")
    return ModelProto(pieces, others)


def serialize_model(model: ModelProto) -> bytes:
    """Pieces first (as sentencepiece writes them), then the other fields in their original order."""
    return b"".join([p.record() for p in model.pieces] + [f.raw for f in model.other_fields])
