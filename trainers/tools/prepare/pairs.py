"""Which kept utterances are held out for validation, and each target's prompts.

Both choices are made from the seed and the utterances' ids alone (each a rank by sha256 of seed and ids), so
they are the same whatever the list's order, the shards, the batches or the interruptions were:

- validation: the round(val_fraction x kept) utterances of the lowest rank (at least one when the fraction is
  above 0 and two or more were kept; never all of them);
- prompts: a target's candidates are the other utterances of its speaker (never itself: a prompt that is its
  own target teaches the model to copy the prompt), in the target's language unless cross_lingual; the
  pairs_per_target of lowest rank for that target are its prompts. Training targets draw from the training
  utterances; validation targets from all of the speaker's utterances. A target without a candidate gets no
  pair, and its speaker is reported.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Utterance:
    id: str
    speaker: str
    language: str | None


def _rank(*parts: object) -> bytes:
    return hashlib.sha256("\0".join(map(str, parts)).encode("utf-8", "surrogatepass")).digest()


def validation_ids(ids: list[str], fraction: float, seed: int) -> set[str]:
    if fraction <= 0 or len(ids) < 2:
        return set()
    count = min(len(ids) - 1, max(1, round(fraction * len(ids))))
    return set(sorted(ids, key=lambda i: _rank(seed, "validation", i))[:count])


@dataclass
class Pairing:
    pairs: list[tuple[Utterance, Utterance]] = field(default_factory=list)  # (target, prompt)
    # Targets left without a prompt: speaker -> (their ids, whether the speaker has utterances in other languages)
    alone: dict[str, tuple[list[str], bool]] = field(default_factory=dict)


def draw_pairs(targets: list[Utterance], pool: list[Utterance], per_target: int, cross_lingual: bool,
               seed: int) -> Pairing:
    by_speaker: dict[str, list[Utterance]] = {}
    for u in pool:
        by_speaker.setdefault(u.speaker, []).append(u)
    pairing = Pairing()
    for target in targets:
        mates = [u for u in by_speaker.get(target.speaker, []) if u.id != target.id]
        candidates = [u for u in mates if cross_lingual or u.language == target.language]
        if not candidates:
            ids, other_languages = pairing.alone.get(target.speaker, ([], False))
            pairing.alone[target.speaker] = ([*ids, target.id], other_languages or bool(mates))
            continue
        chosen = sorted(candidates, key=lambda u: _rank(seed, "prompt", target.id, u.id))[:per_target]
        pairing.pairs += [(target, prompt) for prompt in chosen]
    return pairing
