"""`indextts-prepare --demo [--family indextts2|indextts25]`: the whole path from audio to training on a CPU.

1. Synthesises a little speech-like audio under OUT/audio (4 speakers, 10 sentences each, 1-2.4 s, a hum of the
   speaker's pitch per word): WAV files at 16, 22.05, 24 and 44.1 kHz, one speaker in stereo, so the resampling
   and the mixing to mono are shown too; their list.jsonl; the family's tiny demo tokenizer.
2. Prepares them into OUT/prepared with the demo backend: tiny randomly initialised STAND-IN feature models
   (demo_backend.py), not upstream's (the real path: --model-dir with the official checkpoints, --backend upstream).
3. Trains the family's demo config (checkpoints/demo.yaml or demo25.yaml) on the result for --demo-steps steps
   in OUT/run, or with --demo-steps 0 prints the training command.
Everything is made from fixed seeds: the same bytes on every run on one machine. OUT: --out, default
runs/prepare_demo (IndexTTS2) or runs/prepare_demo25 (IndexTTS-2.5).
"""
from __future__ import annotations

import json
import sys
import wave
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from trainers.data.demo_corpus import WORDS, _sentence, _train_tokenizer, front_end
from trainers.errors import EXIT_OK, UserError
from trainers.run.portable import REPO_ROOT
from trainers.tools.prepare.report import command_lines

SPEAKERS = ((16000, 1, 110.0), (22050, 1, 165.0), (24000, 1, 220.0), (44100, 2, 130.0))  # rate, channels, pitch
SENTENCES = 10  # per speaker
MAX_WORDS = 5
SEED = 2024
DEMO_CONFIGS = {"indextts2": "demo.yaml", "indextts25": "demo25.yaml"}


def _word_tone(word: str, pitch: float, seconds: float, rate: int, rng: np.random.Generator) -> np.ndarray:
    """A hum at the speaker's pitch with the word's own harmonics and a little noise, faded in and out."""
    t = np.arange(int(seconds * rate)) / rate
    weights = 0.3 + 0.7 * np.frombuffer(word.encode().ljust(4, b"a")[:4], dtype=np.uint8) / 255.0
    tone = sum(w * np.sin(2 * np.pi * pitch * (k + 1) * t) for k, w in enumerate(weights)) / weights.sum()
    fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.02) if t.size else t
    return 0.5 * tone * fade + 0.01 * rng.standard_normal(t.size)


def _write_wav(path: Path, samples: np.ndarray, rate: int, channels: int) -> None:
    pcm = np.clip(np.rint(samples * 32767), -32767, 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.repeat(pcm, channels).tobytes() if channels > 1 else pcm.tobytes())


def make_audio(folder: Path, family: str, per_speaker: int = SENTENCES) -> tuple[Path, Path]:
    """The demo's audio (`per_speaker` sentences of each speaker), its list and tokenizer under `folder` (kept when
    there): (list.jsonl, tokenizer)."""
    listing = folder / "list.jsonl"
    tokenizer = folder / ("demo.tiktoken" if family == "indextts25" else "bpe.model")
    if listing.is_file() and tokenizer.is_file():
        return listing, tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    if family == "indextts25":
        from trainers.families.indextts25.demo import tiktoken_file

        tokenizer.write_bytes(tiktoken_file(2400))
    else:
        tokenizer.write_bytes(_train_tokenizer([front_end(_sentence(rng)) for _ in range(3000)], 160))
    lines = []
    for s, (rate, channels, pitch) in enumerate(SPEAKERS):
        for k in range(per_speaker):
            words = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=int(rng.integers(2, MAX_WORDS + 1)))]
            seconds = float(np.clip(0.3 * len(words), 1.0, 2.4)) / len(words)
            gap = np.zeros(int(0.05 * rate))
            audio = np.concatenate([np.concatenate([_word_tone(w, pitch, seconds, rate, rng), gap]) for w in words])
            name = f"spk{s}_{k:02d}.wav"
            _write_wav(folder / name, audio, rate, channels)
            lines.append({"id": f"spk{s}_{k:02d}", "audio": name, "text": " ".join(words) + " .",
                          "speaker": f"spk{s}", "language": "en"})
    listing.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return listing, tokenizer


def run_demo(settings: Any) -> int:
    from trainers.tools.prepare.run import EXIT_SKIPPED, prepare

    family = settings.family or "indextts2"
    out = settings.out or Path("runs/prepare_demo" + ("25" if family == "indextts25" else ""))
    config = REPO_ROOT / "checkpoints" / DEMO_CONFIGS[family]
    if not config.is_file():
        raise UserError(f"--demo needs {config} of a clone of this repository (pip install -e . in the clone)")
    listing, tokenizer = make_audio(out / "audio", family)
    prepared = out / "prepared"
    status = prepare(replace(settings, demo=False, input=listing, out=prepared, backend="demo", family=family,
                             config=config, tokenizer=tokenizer, model_dir=None, language=settings.language or "en"),
                     show_command=False)
    if status not in (EXIT_OK, EXIT_SKIPPED):
        return status
    argv = ["--config", str(config), "--tokenizer", str(tokenizer), "--train-manifest",
            str(prepared / "train_pairs.jsonl"), "--val-manifest", str(prepared / "val_pairs.jsonl"),
            "--output-dir", str(out / "run"), "--effective-batch", "8", "--learning-rate", "3e-3",
            "--warmup-steps", "5", "--dropout", "0", "--epochs", "1000", "--max-steps", str(settings.demo_steps or 20),
            "--val-interval", "10", "--save-interval", "10", "--log-interval", "5"]
    print("the stand-in features are shaped as the real ones and mean nothing; for real ones pass --model-dir",
          flush=True)
    command = "\n".join(command_lines("indextts-train", argv))
    if not settings.demo_steps:
        print(f"train on it:\n{command}", flush=True)
        return status
    print(f"training {settings.demo_steps} steps on it:\n{command}", flush=True)
    sys.stdout.flush()
    from trainers.main import main as train

    return train(argv)
