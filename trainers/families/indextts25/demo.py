"""`--demo --config checkpoints/demo25.yaml`: a tiny IndexTTS-2.5 demo, made on first use like IndexTTS2's.

- a synthetic tiktoken file (demo.tiktoken): the 256 bytes in GPT-2's order (so ranks 0 and 1 are "!" and '"', as
  in upstream's file), a rank for every prefix of each demo word with its leading space (so a word is one
  token), and unreachable 3-byte ranks up to the config's number_text_tokens - 1673 (the special tokens follow);
- the corpus in the form the community 2.5 preprocessing writes: one .npz per utterance (codes, text_ids with the
  `<|en|>` token, spk_emb [192] of its speaker, emo_vec [D]), its pair lines for training and utterance lines
  for validation. A quarter of the sentences end in "!", whose id 0 the trainer drops as upstream inference
  does; the codes are made from the ids the model sees, as IndexTTS2's demo makes them (trainers/data/demo_corpus.py);
- a base checkpoint in the campplus layout, with the emotion branch it carries and keys upstream drops.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from trainers.data.demo_corpus import (
    FEATURES_DIR, MAX_CODE_LEN, MAX_TEXT_LEN, TRAIN_MANIFEST_NAME, VAL_MANIFEST_NAME, WORDS, DemoCorpusSpec,
    _choose_prompts, _code_table, _CodeTable, _sentence, _text_to_codes, _write_jsonl,
)
from trainers.data.demo_data import CorpusMaker, ensure_demo_assets
from trainers.families.indextts25.features import kept_ids
from trainers.families.indextts25.front_end import front_end
from trainers.families.indextts25.languages import SPECIAL_TOKENS
from trainers.families.indextts25.model import SPEAKER_DIM, IndexTTS25GPT
from trainers.families.indextts25.tokenizer import encoding
from trainers.model.demo_base import ensure_demo_base
from trainers.model.gpt_model import GPTConfig

TOKENIZER_NAME = "demo.tiktoken"
LANGUAGE = "en"
EXCLAIMED = 0.25  # sentences ending in "!" (id 0, dropped)


def gpt2_byte_order() -> list[int]:
    """The 256 byte values in GPT-2's rank order: the printable ones first, then the rest."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return printable + [b for b in range(256) if b not in printable]


def tiktoken_file(ids: int) -> bytes:
    """A ranks file whose tokenizer has `ids` ids (ranks + the 1673 special tokens)."""
    import base64

    ranks = [bytes([b]) for b in gpt2_byte_order()]
    seen = set(ranks)
    for word in WORDS:
        text = (" " + word).encode()
        for end in range(2, len(text) + 1):
            if text[:end] not in seen:
                seen.add(text[:end])
                ranks.append(text[:end])
    wanted = ids - len(SPECIAL_TOKENS)
    if wanted < len(ranks):
        raise ValueError(f"the 2.5 demo's tokenizer needs gpt.number_text_tokens >= {len(ranks) + len(SPECIAL_TOKENS)}")
    ranks += [b"\0" + k.to_bytes(2, "big") for k in range(wanted - len(ranks))]  # no merge reaches them
    return b"".join(base64.b64encode(token) + f" {rank}\n".encode() for rank, token in enumerate(ranks))


def generate(out: Path, spec: DemoCorpusSpec) -> None:
    """The corpus under `out` (CorpusMaker.generate)."""
    tok_rng, table_rng, cond_rng, train_rng, val_rng = (
        np.random.Generator(np.random.PCG64(s)) for s in np.random.SeedSequence(spec.seed).spawn(5))
    features = out / FEATURES_DIR
    features.mkdir()
    (out / TOKENIZER_NAME).write_bytes(tiktoken_file(spec.vocab_size))
    enc = encoding(out / TOKENIZER_NAME)
    table = _code_table(table_rng, spec)
    speakers = [f"spk{i}" for i in range(spec.num_speakers)]
    spk_emb = {s: cond_rng.standard_normal(SPEAKER_DIM, dtype=np.float32) for s in speakers}
    rows: dict[str, list[dict]] = {}
    for split, count, rng in (("demo_train", spec.num_train, train_rng), ("demo_val", spec.num_val, val_rng)):
        rows[split] = []
        for index in range(count):
            speaker_index = index % len(speakers)
            text, ids, codes = _sample(rng, enc, table, speaker_index, spec.num_codes)
            name = f"{split}_{index:05d}"
            emo_vec = (0.1 * rng.standard_normal(spec.model_dim)).astype(np.float32)
            np.savez(features / f"{name}.npz", codes=codes, text_ids=ids, spk_emb=spk_emb[speakers[speaker_index]],
                     emo_vec=emo_vec)
            rows[split].append({"id": name, "features": f"{FEATURES_DIR}/{name}.npz", "speaker": speakers[speaker_index],
                                "lang": LANGUAGE, "lang_alias": None, "text": text, "text_len": len(ids),
                                "code_len": len(codes)})
    train = rows["demo_train"]
    by_id = {row["id"]: row for row in train}
    # What _choose_prompts reads of an utterance: its id and speaker.
    utterances = [SimpleNamespace(utt_id=r["id"], speaker=r["speaker"]) for r in train]
    prompts = _choose_prompts(utterances, train_rng)
    _write_jsonl(out / TRAIN_MANIFEST_NAME, (_pair_row(t, by_id[p.utt_id]) for t, p in zip(train, prompts)))
    _write_jsonl(out / VAL_MANIFEST_NAME, rows["demo_val"])


def _sample(rng: np.random.Generator, enc, table: _CodeTable, speaker_index: int,
            num_codes: int) -> tuple[str, np.ndarray, np.ndarray]:
    """A sentence, its ids as upstream's front end makes them for English (front_end.py: "<|en|> " + lower case), and
    codes made from the ids the model keeps; within the demo's limits."""
    while True:
        text = _sentence(rng)
        if rng.random() < EXCLAIMED:
            text = text[:-1] + "!"
        ids = np.asarray(enc.encode(front_end(text, LANGUAGE), allowed_special="all"), dtype=np.int32)
        kept = kept_ids(ids)
        codes = _text_to_codes(kept, speaker_index, table, num_codes)
        if len(kept) <= MAX_TEXT_LEN and len(codes) <= MAX_CODE_LEN:
            return text, ids, codes


def _pair_row(target: dict, prompt: dict) -> dict:
    """A pair line as the community preprocessing writes it (build_pairs)."""
    return {"id": f"{target['id']}__{prompt['id']}", "target_features": target["features"],
            "prompt_features": prompt["features"], "speaker": target["speaker"], "lang": LANGUAGE, "lang_alias": None,
            "prompt_lang": LANGUAGE, "cross_lingual": False, "text_len": target["text_len"],
            "code_len": target["code_len"]}


def _extras(d: int) -> dict[str, torch.Tensor]:
    """The campplus tensors beside the model's: the emotion branch (carried), and keys upstream drops."""
    return {
        "emo_conditioning_encoder.embed.pos_enc.pe": torch.randn(1, 40, 16),
        "emo_perceiver_encoder.latents": torch.randn(1, d),
        "emovec_layer.weight": torch.randn(d, 16),
        "emovec_layer.bias": torch.randn(d),
        "emo_layer.weight": torch.randn(d, d),
        "emo_layer.bias": torch.randn(d),
        "inference_model.lm_head.weight": torch.randn(4, d),
        "gpt.wte.weight": torch.randn(4, d),
    }


MAKER = CorpusMaker(generate, TOKENIZER_NAME, "indextts25-1")


def make_demo(root: Path, gpt: GPTConfig) -> None:
    """ModelFamily.make_demo: the corpus (its tokenizer made to the config's number_text_tokens) and base."""
    ensure_demo_assets(root, DemoCorpusSpec(model_dim=gpt.model_dim, vocab_size=gpt.number_text_tokens,
                                            num_codes=gpt.start_mel_token), MAKER)
    ensure_demo_base(root, gpt, model=IndexTTS25GPT, extras=_extras)
