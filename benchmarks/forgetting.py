#!/usr/bin/env python3
"""Does replay keep a base language while the model learns a new one?

    python benchmarks/forgetting.py [--work-dir DIR] [--seeds 1234 5678] [--smoke]

What it does, on the demo corpus and model (checkpoints/demo.yaml), through the trainer's command line:

1. Splits the demo corpus into two languages: "base" (the first half of its training and validation
   samples, as they are) and "new" (the other half, made a language the base model has never heard:
   every text id above the specials is mapped by a fixed permutation and every code is shifted by half
   the code range, so the same pieces sound different). `two_language_corpus` writes the manifests
   (tests/test_forgetting_runs.py uses it too; `two_language_corpus25` splits the IndexTTS-2.5 demo the same
   way, for the tests only).
2. Trains the base model: the demo's tiny base checkpoint on "base" alone, BASE_STEPS steps.
   The runs call the trainer's main() in this process, as `indextts-train` does.
3. Fine-tunes that model on "new" for FINE_TUNE_STEPS steps with 0%, 10% and 30% replay of "base"
   (`--train-manifest new.jsonl::new --train-manifest base.jsonl::base@0.1`), validating both languages
   (all 24 + 24 validation samples) every VAL_EVERY steps, with the same seed, learning rate and
   schedule; the new language's samples set the epochs in every run.
4. Prints, per replay share, the base language's validation mel loss at the base model (step 0) and at
   the last step, its rise (absolute and relative: the trainer's own forgetting measure, read from the
   run history), the new language's validation mel loss at that same step, and the first validation at
   which the base language was more than 10% worse than at the base model (where `--forgetting-limit 0.1
   --forgetting-stop` would have stopped the run); then, for the first seed, the base language's rise
   at every validation, and the means over --seeds.

--smoke (tests/test_benchmarks.py): 6 base steps and 4 fine-tune steps, one seed: it checks the script
runs, its figures mean nothing. Exit 0 unless a run fails (2).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from trainers.checkpoint import schema  # noqa: E402
from trainers.main import main as main_of_the_trainer  # noqa: E402
from trainers.data.demo_data import DemoCorpusSpec, ensure_demo_assets  # noqa: E402
from trainers.model.demo_base import ensure_demo_base  # noqa: E402
from trainers.model.gpt_model import GPTConfig  # noqa: E402

DEMO_YAML = REPO_ROOT / "checkpoints" / "demo.yaml"
SHARES = (0.0, 0.1, 0.3)
BASE_STEPS, FINE_TUNE_STEPS, VAL_EVERY = 240, 120, 20
SMOKE_STEPS = (6, 4, 2)
GUARD_LIMIT = 0.1  # the table says at which validation a --forgetting-limit of 10% would first have been passed
PAIRED_TEXT, PAIRED_CODES = "target_text_ids_path", "target_codes_path"
SINGLE_TEXT, SINGLE_CODES = "text_ids_path", "codes_path"
FIRST_ID = 3  # the demo tokenizer's specials: 0 start, 1 stop, 2 unknown


class BenchError(RuntimeError):
    pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=None, help="where to build everything [a fresh temp dir]")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 5678, 9012],
                   help="--seed of the fine-tunes (the base model is trained once, with the first)")
    p.add_argument("--smoke", action="store_true", help="a few steps, one seed: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.seeds = args.seeds[:1]
    return args


# --- data ---------------------------------------------------------------------------------------


def demo_assets(root: Path) -> tuple[Path, Path, Path, GPTConfig]:
    """The demo corpus and tiny base checkpoint under `root`: (folder, tokenizer, base checkpoint, config)."""
    gpt = GPTConfig.from_yaml_section(yaml.safe_load(DEMO_YAML.read_text(encoding="utf-8"))["gpt"])
    assets = ensure_demo_assets(root, DemoCorpusSpec(model_dim=gpt.model_dim, vocab_size=gpt.number_text_tokens,
                                                     num_codes=gpt.start_mel_token))
    return assets.root, assets.tokenizer, ensure_demo_base(root, gpt), gpt


def two_language_corpus(demo: Path, out: Path, gpt: GPTConfig) -> dict[str, Path]:
    """Manifests of a "base" and a "new" language made from the demo corpus in `demo`, written to `out`:
    {"base_train", "new_train", "base_val", "new_val"}. The new language's text ids are permuted (the
    specials kept), its text left out (the demo tokenizer does not make those ids from it) and its codes shifted by
    half the code range; its feature files go to out/features."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "features").mkdir(exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(20260))
    ids = np.arange(gpt.number_text_tokens)
    ids[FIRST_ID:] = FIRST_ID + rng.permutation(gpt.number_text_tokens - FIRST_ID)
    codes = gpt.start_mel_token  # codes are 0..start_mel_token-1
    paths = {}
    for split, text_key, codes_key in (("train", PAIRED_TEXT, PAIRED_CODES), ("val", SINGLE_TEXT, SINGLE_CODES)):
        rows = [json.loads(line) for line in (demo / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
        half = len(rows) // 2
        for lang, part in (("base", rows[:half]), ("new", rows[half:])):
            lines = []
            for row in part:
                row = {k: (str(demo / v) if k.endswith("_path") else v) for k, v in row.items()}
                row["language"] = lang
                if lang == "new":
                    row["id"] = f"new_{row['id']}"
                    # Its permuted ids stand for a language of their own, which the demo tokenizer does not write:
                    # the text that made the original ids is not this line's (the start's tokenizer check reads it).
                    for key in ("text", "target_text"):
                        row.pop(key, None)
                    for key, change in ((text_key, lambda a: ids[a]), (codes_key, lambda a: (a + codes // 2) % codes)):
                        source = Path(row[key])
                        target = out / "features" / f"new_{source.name}"
                        np.save(target, change(np.load(source)).astype(np.int32), allow_pickle=False)
                        row[key] = str(target)
                lines.append(json.dumps(row) + "\n")
            paths[f"{lang}_{split}"] = out / f"{lang}_{split}.jsonl"
            paths[f"{lang}_{split}"].write_text("".join(lines), encoding="utf-8")
    return paths


BASE25, NEW25 = "en", "de"  # IndexTTS-2.5's languages are codes of its own (trainers/families/indextts25/languages.py)


def two_language_corpus25(demo: Path, out: Path, gpt: GPTConfig) -> dict[str, Path]:
    """`two_language_corpus` for the IndexTTS-2.5 demo in `demo` (its .npz pair and utterance lines): "en" (the first
    half, as it is) and "de" (the other half: its lines' language, its text ids' language token <|de|>, every other
    id a rank of the tiktoken file mapped by a fixed permutation, the codes shifted by half the code range). The same
    keys; its languages are BASE25 and NEW25 (lang_embedding rows of their own)."""
    from trainers.families.indextts25.languages import SPECIAL_TOKENS

    out.mkdir(parents=True, exist_ok=True)
    (out / "features").mkdir(exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(20260))
    ranks = gpt.number_text_tokens - len(SPECIAL_TOKENS)  # the specials follow the ranks; ids 0 and 1 are dropped
    ids = np.arange(gpt.number_text_tokens)
    ids[2:ranks] = 2 + rng.permutation(ranks - 2)
    ids[ranks + SPECIAL_TOKENS.index(f"<|{BASE25}|>")] = ranks + SPECIAL_TOKENS.index(f"<|{NEW25}|>")
    codes = gpt.start_mel_token
    written: dict[str, str] = {}

    def new_features(raw: str) -> str:
        source = demo / raw
        if raw not in written:
            with np.load(source, allow_pickle=False) as archive:
                arrays = {k: archive[k] for k in archive.files}
            arrays["text_ids"] = ids[arrays["text_ids"]].astype(np.int32)
            arrays["codes"] = ((arrays["codes"] + codes // 2) % codes).astype(np.int32)
            written[raw] = str(out / "features" / f"new_{source.name}")
            np.savez(written[raw], **arrays)
        return written[raw]

    paths = {}
    for split in ("train", "val"):
        rows = [json.loads(line) for line in (demo / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
        half = len(rows) // 2
        for lang, part in (("base", rows[:half]), ("new", rows[half:])):
            lines = []
            for row in part:
                keys = [k for k in ("features", "target_features", "prompt_features") if k in row]
                if lang == "base":
                    row.update({k: str(demo / row[k]) for k in keys})
                else:
                    row.update({k: new_features(row[k]) for k in keys}, id=f"new_{row['id']}", lang=NEW25)
                    row.update({k: NEW25 for k in ("prompt_lang",) if k in row})
                    row.pop("text", None)  # its ids are no longer the tokenizer's reading of this text
                lines.append(json.dumps(row) + "\n")
            paths[f"{lang}_{split}"] = out / f"{lang}_{split}.jsonl"
            paths[f"{lang}_{split}"].write_text("".join(lines), encoding="utf-8")
    return paths


# --- runs ---------------------------------------------------------------------------------------


def train(run_dir: Path, *flags: str) -> str:
    """The trainer's main() in this process (what `indextts-train` runs; torch is imported once), its log kept."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main_of_the_trainer(["--output-dir", str(run_dir), *flags])
    if status != 0:
        raise BenchError(f"{run_dir.name} failed (exit {status}):\n{err.getvalue()[-4000:]}")
    return err.getvalue()


def common_flags(tokenizer: Path) -> list[str]:
    return ["--config", str(DEMO_YAML), "--tokenizer", str(tokenizer), "--effective-batch", "16",
            "--data-order", "random", "--dropout", "0", "--max-val-batches", "0", "--save-interval", "1000",
            "--keep-checkpoints", "1", "--log-interval", "20"]


def fine_tune(work: Path, corpus: dict[str, Path], tokenizer: Path, base: Path, share: float, seed: int,
              steps: int, val_every: int) -> dict[str, float]:
    replay = [f"{corpus['base_train']}::base@{share:g}"] if share else []
    run_dir = work / f"replay{share:g}_seed{seed}"
    train(run_dir, *common_flags(tokenizer), "--base-checkpoint", str(base), "--seed", str(seed),
          "--train-manifest", f"{corpus['new_train']}::new", *(a for r in replay for a in ("--train-manifest", r)),
          "--val-manifest", f"{corpus['base_val']}::base", "--val-manifest", f"{corpus['new_val']}::new",
          "--learning-rate", "3e-3", "--warmup-steps", str(max(1, steps // 10)), "--min-lr-ratio", "0.1",
          "--max-steps", str(steps), "--epochs", "1000", "--val-interval", str(val_every))
    ckpt = schema.read(run_dir / "latest.pth", mmap=True)
    vals = [e for e in ckpt.history if e["kind"] == "val"]
    last, base_figures = vals[-1], ckpt.forgetting["base"]
    past = [e["step"] for e in vals if e["forgetting"]["base"]["mel_loss_rel"] > GUARD_LIMIT]
    curve = [(e["step"], e["forgetting"]["base"]["mel_loss_rel"]) for e in vals[1:]]
    return {"step": last["step"], "past": past[0] if past else None, "curve": curve,
            "base_before": base_figures["base"]["mel_loss"],
            "base_after": last["langs"]["base"]["mel_loss"], "rise": last["forgetting"]["base"]["mel_loss"],
            "rise_rel": last["forgetting"]["base"]["mel_loss_rel"], "new_before": base_figures["new"]["mel_loss"],
            "new_after": last["langs"]["new"]["mel_loss"]}


def main() -> int:
    args = parse_args()
    base_steps, steps, val_every = SMOKE_STEPS if args.smoke else (BASE_STEPS, FINE_TUNE_STEPS, VAL_EVERY)
    given = args.work_dir is not None
    work = args.work_dir.resolve() if given else Path(tempfile.mkdtemp(prefix="forgetting-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        demo, tokenizer, tiny_base, gpt = demo_assets(work / "demo_data")
        corpus = two_language_corpus(demo, work / "two_languages", gpt)
        base_run = work / "base_model"
        if not (base_run / "latest.pth").is_file():
            train(base_run, *common_flags(tokenizer), "--base-checkpoint", str(tiny_base), "--seed",
                  str(args.seeds[0]), "--train-manifest", f"{corpus['base_train']}::base",
                  "--val-manifest", f"{corpus['base_val']}::base", "--learning-rate", "3e-3", "--warmup-steps",
                  str(max(1, base_steps // 12)), "--min-lr-ratio", "0.1", "--max-steps", str(base_steps),
                  "--epochs", "1000", "--val-interval", "0")
        base = base_run / "latest.pth"
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
              f"{platform.python_version()}; demo model, effective batch 16, lr 3e-3, base model trained "
              f"{base_steps} steps on 'base' ({len(corpus['base_train'].read_text().splitlines())} samples), "
              f"fine-tunes {steps} steps on 'new'")
        results: dict[float, list[dict[str, float]]] = {share: [] for share in SHARES}
        print(f"| replay of base | seed | base mel_loss: base model -> step | rise (rel) | new mel_loss: base model "
              f"-> step | base first past +{GUARD_LIMIT:.0%} |")
        print("|---|---|---|---|---|---|")
        for seed in args.seeds:
            for share in SHARES:
                r = fine_tune(work, corpus, tokenizer, base, share, seed, steps, val_every)
                results[share].append(r)
                print(f"| {share:.0%} | {seed} | {r['base_before']:.4f} -> {r['base_after']:.4f} (step {r['step']}) | "
                      f"{r['rise']:+.4f} ({r['rise_rel']:+.1%}) | {r['new_before']:.4f} -> {r['new_after']:.4f} | "
                      f"{'never' if r['past'] is None else 'step %d' % r['past']} |", flush=True)
        print(f"the base language's mel_loss against the base model's at each validation, seed {args.seeds[0]}:")
        for share in SHARES:
            curve = results[share][0]["curve"]
            print(f"  replay {share:>4.0%}: " + "  ".join(f"step {step} {rise:+.1%}" for step, rise in curve))
        print(f"mean over seeds {', '.join(map(str, args.seeds))} (step {steps}):")
        for share in SHARES:
            rows = results[share]
            print(f"  replay {share:>4.0%}: base mel_loss rise {statistics.mean(r['rise'] for r in rows):+.4f} "
                  f"({statistics.mean(r['rise_rel'] for r in rows):+.1%}); new mel_loss "
                  f"{statistics.mean(r['new_after'] for r in rows):.4f}; base past +{GUARD_LIMIT:.0%} in "
                  f"{sum(r['past'] is not None for r in rows)} of {len(rows)} runs")
        print(f"total {time.monotonic() - started:.0f} s")
        return 0
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not given:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
