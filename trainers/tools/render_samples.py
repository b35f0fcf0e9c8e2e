"""Render a validation's generated codes to WAV files with the user's IndexTTS2 (and to TensorBoard).

    python tools/render_samples.py runs/my_voice --indextts-dir ~/index-tts --model-dir exports/step4000 \
        --prompt-audio voice.wav [--step 4000] [--out DIR] [--tensorboard] [--manifest val.jsonl]

Reads the sample set of --step (default: the newest) under RUN_DIR/samples/ and writes one 16-bit PCM
WAV per sample with codes to --out (default RUN_DIR/samples/audio/step_N/), named by sample id (made
safe as a file name: trainers/tools/wav_files.py). --tensorboard adds each one to the run's TensorBoard
(RUN_DIR/logs) as audio `gen_audio/<id>` at the set's step.

What it needs, and why:
  --indextts-dir / the installed `indextts` package: upstream's inference code; its s2mel model and
      BigVGAN vocoder turn codes into sound, called as infer_v2 calls them (indextts_upstream.py).
  --model-dir: the folder IndexTTS2(cfg_path, model_dir) loads (config.yaml, gpt.pth, s2mel.pth, ...).
      The s2mel model also reads the GPT's latent of the codes, computed by --model-dir's gpt.pth: an
      indextts-export of the set's step (with the other model files linked in) makes it that step's
      model; another GPT (the official one) is used as given, and the command says so.
  --prompt-audio: the voice. The s2mel model takes the timbre from a prompt's audio (its mel, semantic
      features and style embedding); the trainer keeps only the prompts' precomputed GPT conditioning,
      not their audio, so one clip is given for every sample (a clip of the target speaker).
  --manifest (default: the run's --val-manifest files): each sample's text ids, conditioning latent and
      emotion vector, found by sample id; the GPT's latent is conditioned on them, as the codes were.
IndexTTS-2.5 (a --model-dir whose config.yaml says `version: 2.5`): upstream's infer_v2_5 renders the codes
alone (its s2mel model reads no GPT latent), so neither the manifest nor the step's export is needed; its
checkpoints folder also holds codec.pth and the .tiktoken file.

Exit status 0; 2 with `error: ...` for a missing IndexTTS2 (what to install), a missing or damaged
sample set, model files, prompt or manifest, and WAV files that exist already (--overwrite replaces
them). Nothing is written before every input has been checked and the models have loaded.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from trainers.errors import UserError
from trainers.run.sample_sets import SAMPLES_DIR, SampleSet, read_step
from trainers.tools import indextts_upstream as upstream_tts
from trainers.tools import tool_main
from trainers.tools.sample_features import SampleInputs, sample_inputs
from trainers.tools.wav_files import safe_names, write_wav

AUDIO_DIR = "audio"
TAG = "gen_audio"


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


@dataclass
class Job:
    """The samples to render and where each one goes."""

    sample_set: SampleSet
    out: Path
    names: list[str]  # file stem per sample, in the set's order


def plan(run_dir: Path, step: int | None, out: Path | None, overwrite: bool) -> Job:
    """The set to render and its output paths; refuses WAV files that exist unless `overwrite`."""
    sample_set = read_step(run_dir, step)
    out = out or run_dir / SAMPLES_DIR / AUDIO_DIR / f"step_{sample_set.step:08d}"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a folder")
    names = safe_names(sample_set.ids)
    existing = [n + ".wav" for n in names if (out / f"{n}.wav").exists()]
    if existing and not overwrite:
        raise UserError(f"--out {out} already holds {len(existing)} of these WAV files ({', '.join(existing[:3])}"
                        f"{', ...' if len(existing) > 3 else ''}); pass --overwrite to replace them, or another --out")
    return Job(sample_set, out, names)


def latent_note(model_dir: Path, step: int) -> str | None:
    """A warning when --model-dir's GPT is not the set's step (the latent s2mel reads comes from it)."""
    exported = upstream_tts.exported_step(model_dir)
    if exported == step:
        return None
    which = f"an export of step {exported}" if exported is not None else "not an indextts-export of this run"
    return (f"--model-dir {model_dir} holds a gpt.pth that is {which}, while the codes are step {step}'s: the "
            "s2mel model reads that GPT's latent of the codes, so the sound is not exactly step "
            f"{step}'s model; export step {step} (indextts-export RUN_DIR --which {step}) for it")


def check_codes(sample_set: SampleSet, rows: Sequence[int], gpt: dict[str, Any], model_dir: Path) -> None:
    """Codes the model's codec cannot embed (ids from a model with more codes) are refused, naming a sample."""
    limit = gpt.get("start_mel_token", 8192)
    for i in rows:
        bad = sample_set.codes[i][(sample_set.codes[i] < 0) | (sample_set.codes[i] >= limit)]
        if bad.size:
            raise UserError(f"sample {sample_set.ids[i]} of step {sample_set.step} holds code {int(bad[0])}, outside "
                            f"0..{limit - 1} of --model-dir {model_dir}'s config (its gpt.start_mel_token): these "
                            "codes were generated by another model; pass its model folder")


def write_tensorboard(log_dir: Path, step: int, clips: Sequence[tuple[str, np.ndarray]], rate: int) -> None:
    """Each clip as audio `gen_audio/<id>` at `step` in a new event file of `log_dir` (no other event is touched)."""
    import torch
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir))
    try:
        for sample_id, wav in clips:
            clip = torch.from_numpy(np.clip(np.asarray(wav, dtype=np.float32), -1.0, 1.0)).reshape(1, -1)
            writer.add_audio(f"{TAG}/{sample_id}", clip, global_step=step, sample_rate=rate)
    finally:
        writer.close()


def render(args: argparse.Namespace) -> list[str]:
    """Check every input, load upstream's models, write the WAVs (and TensorBoard); the summary lines."""
    family = upstream_tts.config_family(args.model_dir)
    upstream = upstream_tts.import_upstream(args.indextts_dir, family)
    job = plan(args.run_dir, args.step, args.out, args.overwrite)
    config = upstream_tts.read_model_dir(args.model_dir)
    if not args.prompt_audio.is_file():
        raise UserError(f"--prompt-audio {args.prompt_audio}: no such file")
    s = job.sample_set
    wanted = [(i, sid) for i, sid in enumerate(s.ids) if len(s.codes[i])]
    check_codes(s, [i for i, _ in wanted], config["gpt"], args.model_dir)
    codes_only = family == upstream_tts.INDEXTTS25  # 2.5's s2mel reads no GPT latent: nothing else is needed
    inputs = {} if codes_only else sample_inputs(args.run_dir, args.manifest, config["gpt"], [sid for _, sid in wanted])
    for i, sid in enumerate(s.ids):
        if not len(s.codes[i]):
            warn(f"sample {sid} of step {s.step} has no codes (it stopped at once): no WAV for it")
    note = None if codes_only else latent_note(args.model_dir, s.step)
    if note:
        warn(note)
    tts = upstream_tts.load_pipeline(upstream, args.model_dir, args.device)
    voice = upstream_tts.prompt_voice(upstream, tts, args.prompt_audio, family)
    job.out.mkdir(parents=True, exist_ok=True)
    clips = [(sid, _render_one(tts, voice, job, i, inputs.get(sid))) for i, sid in wanted]
    if args.tensorboard and clips:
        write_tensorboard(args.run_dir / "logs", s.step, clips, upstream_tts.SAMPLE_RATE)
    lines = [f"rendered {len(clips)} of {len(s.ids)} samples of step {s.step} to {job.out}"]
    if args.tensorboard:
        lines.append(f"tensorboard: {len(clips)} clips as {TAG}/<id> at step {s.step} in {args.run_dir / 'logs'}")
    return lines


def _render_one(tts: Any, voice: upstream_tts.Voice, job: Job, i: int, x: SampleInputs | None) -> np.ndarray:
    """One sample's WAV: IndexTTS2 also needs its text and conditioning (`x`) for the GPT's latent; 2.5 (x None)
    renders the codes alone."""
    s = job.sample_set
    if x is None:
        wav = upstream_tts.render_codes_25(tts, voice, s.codes[i])
    else:
        wav = upstream_tts.render_codes(tts, voice, x.text_ids, s.codes[i], x.condition, x.emo_vec)
    path = job.out / f"{job.names[i]}.wav"
    write_wav(path, wav, upstream_tts.SAMPLE_RATE)
    ended = "stopped" if s.stopped[i] else "hit the length limit"
    print(f"wrote {path} ({wav.size / upstream_tts.SAMPLE_RATE:.2f} s from {len(s.codes[i])} codes, {ended})", flush=True)
    return wav


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Render a run's generated validation samples to WAV files with IndexTTS2.")
    p.add_argument("run_dir", type=Path, help="the run directory (its samples/step_N.npz sets)")
    p.add_argument("--step", type=int, help="the validation step to render (default: the newest set)")
    p.add_argument("--indextts-dir", type=Path, help="IndexTTS2 checkout (default: the installed indextts package)")
    p.add_argument("--model-dir", type=Path, required=True,
                   help="the folder IndexTTS2 (or IndexTTS-2.5) loads: config.yaml, gpt.pth, s2mel.pth, ...")
    p.add_argument("--prompt-audio", type=Path, required=True, help="the voice prompt used for every sample")
    p.add_argument("--manifest", action="append", metavar="JSONL[::LANG]",
                   help="where the samples' text and conditioning are (default: the run's --val-manifest files)")
    p.add_argument("--out", type=Path, help="folder for the WAV files (default RUN_DIR/samples/audio/step_N)")
    p.add_argument("--overwrite", action="store_true", help="replace WAV files of the same names in --out")
    p.add_argument("--tensorboard", action="store_true", help=f"also write the audio to RUN_DIR/logs as {TAG}/<id>")
    p.add_argument("--device", help="torch device for the models (default: IndexTTS2's choice, a GPU if there is one)")
    return p.parse_args(argv)


@tool_main
def main(argv: list[str] | None = None) -> int:
    for line in render(parse_args(argv)):
        print(line)
    return 0
