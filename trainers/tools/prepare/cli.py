"""indextts-prepare: from audio and transcripts to the manifests and feature files indextts-train reads.

    indextts-prepare --input data/list.jsonl --model-dir checkpoints --out data/prepared      # IndexTTS2
    indextts-prepare --input data/list.jsonl --model-dir checkpoints25 --out data/prepared25  # IndexTTS-2.5
    indextts-prepare --demo [--family indextts25]     # stand-in models on synthesised audio, then a few steps

Run the same command again after any interruption: it continues (store.py). Several GPUs or machines:
`--shard I/N` per process (or torchrun, one process per GPU); the last to finish writes the manifests
(merge.py). docs/data_preparation.md is the user's guide.

Exit status: 0 every line kept; 3 the manifests were written and some lines were skipped (each in
OUT/skipped.txt; under torchrun 0, the summary says it); 2 bad flags, an unreadable input or config, or an --out
holding another preparation (nothing is written); 5 out of memory with a single clip; 130 interrupted.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.console_streams import quiet_broken_pipes
from trainers.errors import EXIT_OK, EXIT_OUT_OF_MEMORY, EXIT_USAGE, UserError

EXIT_SKIPPED = 3


@dataclass
class Model:
    """The model the features are for: its family, gpt config and files (from --config / --model-dir)."""

    family: Any  # trainers.families.family.ModelFamily
    gpt: Any  # its GPTConfig
    config: Path
    data: dict[str, Any]
    model_dir: Path | None


def read_model(settings: Any) -> Model:
    from trainers.config.config_yaml import read_config_yaml
    from trainers.families import FAMILIES, family_for_config

    config = settings.config or (settings.model_dir / "config.yaml" if settings.model_dir else None)
    if config is None:
        raise UserError("--config or --model-dir is needed: the model's config.yaml sets the family and the limits "
                        "of a line (pass the checkpoints folder as --model-dir)")
    flag = "--config" if settings.config else "--model-dir's config.yaml"
    data = read_config_yaml(config, f"{flag} {config}", "pass the model's config.yaml")
    claimed = family_for_config(data)
    family = FAMILIES[settings.family] if settings.family else claimed
    if family is not claimed:
        raise UserError(f"--family {family.name}, but {flag} {config} is an {claimed.title} config; pass the config "
                        f"of the {family.title} model, or leave out --family")
    try:
        gpt = family.read_config(data["gpt"])
    except ValueError as exc:
        raise UserError(f"{flag} {config}: {exc}") from None
    return Model(family, gpt, Path(config), data, settings.model_dir)


def pick_device(name: str) -> Any:
    import torch

    from trainers.hardware.detect import pick_device as pick

    if name == "auto" and torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    return pick(name)


def tokenizer_path(settings: Any, model: Model) -> Path | None:
    """--tokenizer, else the model folder's tokenizer file (the config's dataset.bpe_model, or 2.5's fixed name)."""
    if settings.tokenizer is not None:
        return settings.tokenizer
    if model.model_dir is None:
        return None
    if model.family.tokenizer_config_key:
        name = model.data.get("dataset", {}).get("bpe_model", "bpe.model")
    else:
        name = model.family.export_tokenizer_name
    return model.model_dir / str(name)


def plan_of(settings: Any, model: Model, backend: Any, listing: Any) -> dict[str, Any]:
    from trainers.tools.prepare.store import FORMAT_VERSION

    limits = model.family.data_limits(model.gpt)
    return {"format": FORMAT_VERSION, "family": model.family.name, "features": backend.fingerprint(),
            "settings": settings.fingerprinted(),
            "limits": {"max_text_tokens": limits.max_text_tokens, "max_mel_tokens": limits.max_mel_tokens,
                       "prefix_len": limits.prefix_len},
            "input": listing.fingerprint}


def _differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    found = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}: saved {_short(a)}, now {_short(b)}")
    return found


def _short(value: Any) -> str:
    text = repr(value)
    return text[:15] + "...'" if isinstance(value, str) and len(value) == 64 else text


def check_plan(store: Any, plan: dict[str, Any], update: bool) -> None:
    """The output's plan is this one, or the preparation is refused (UserError); --update takes a changed input."""
    saved = store.create(plan)
    if saved == plan:
        return
    other = {k: v for k, v in saved.items() if k != "input"}
    if other != {k: v for k, v in plan.items() if k != "input"}:
        lines = "; ".join(_differences(other, {k: v for k, v in plan.items() if k != "input"}))
        raise UserError(f"--out {store.out} holds features made otherwise ({lines}): the trainer would get features "
                        "of two models or settings mixed; prepare into a new --out, or delete that folder to start over")
    if not update:
        raise UserError(f"--input changed since {store.out} was started (its lines' sha256 was {saved['input'][:12]}..., "
                        f"now {plan['input'][:12]}...): pass --update to keep the features of unchanged lines and make "
                        "those of new or changed ones, or prepare into a new --out")
    store.replace_plan(plan)


def training_command(model: Model, tokenizer: Path | None, out: Path, merged: Any) -> list[str]:
    gpt = model.model_dir / str(model.data.get("gpt_checkpoint", "gpt.pth")) if model.model_dir else None
    val = " --val-manifest " + str(out / "val_pairs.jsonl") if "val_pairs.jsonl" in merged.written else ""
    return ["train on it:",
            f"  indextts-train --config {model.config} --tokenizer {tokenizer or 'TOKENIZER'} "
            f"--base-checkpoint {gpt or 'GPT.pth'} --train-manifest {out / 'train_pairs.jsonl'}{val} "
            "--output-dir runs/my_voice"]


def prepare(settings: Any, show_command: bool = True) -> int:
    """The whole command but --demo; its exit status (`show_command`: end with the training command)."""
    from trainers.tools.prepare.settings import Shard
    from trainers.tools.prepare.store import Store

    try:
        shard = Shard.parse(settings.shard, dict(os.environ))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    for name, value in (("--input", settings.input), ("--out", settings.out)):
        if value is None:
            raise UserError(f"{name} is needed (see indextts-prepare --help)")
    store = Store(settings.out)
    if settings.merge:
        return merge_only(settings, store)
    model = read_model(settings)
    from trainers.tools.prepare.backend import BackendRequest, backend_factory

    device = pick_device(settings.device)
    tokenizer = tokenizer_path(settings, model)
    request = BackendRequest(model.family.name, model.config, model.model_dir, settings.indextts_dir, tokenizer,
                             str(device))
    backend = backend_factory(settings.backend)(request)
    listing = _listing(settings)
    check_plan(store, plan_of(settings, model, backend, listing), settings.update)
    _work(settings, store, shard, model, backend, listing, device)
    return _finish(settings, store, shard, model, listing, tokenizer if show_command else False)


def _listing(settings: Any) -> Any:
    from trainers.tools.prepare.inputs import read_input

    return read_input(settings.input, settings.input_format, settings.speaker, settings.language)


def _work(settings: Any, store: Any, shard: Any, model: Model, backend: Any, listing: Any, device: Any) -> None:
    from trainers.tools.prepare.batching import Encoder
    from trainers.tools.prepare.checks import LineLimits
    from trainers.tools.prepare.layouts import LAYOUTS
    from trainers.tools.prepare.report import say, warn
    from trainers.tools.prepare.store import owner
    from trainers.tools.prepare.work import ShardWork
    from trainers.tools.wav_files import safe_names

    ids = [e.id for e in listing.entries]
    stems = dict(zip(ids, safe_names(ids)))
    mine = [e for e in listing.entries if owner(e.id, shard.count) == shard.index]
    for problem in listing.problems:
        if owner(problem.source, shard.count) == shard.index:
            say(str(problem))
    journal = store.journal(shard).open()
    try:
        done = store.records({e.id: e.key() for e in mine})
        limits = LineLimits(model.family.data_limits(model.gpt), settings.min_seconds, settings.silence_db,
                            backend.code_rate)
        work = ShardWork(backend, LAYOUTS[model.family.name], limits, store, journal, Encoder(backend, device, 0, warn),
                         stems, model.gpt.model_dim, model.gpt.start_mel_token,
                         model.family.manifest_forms.language_problem, settings.batch_size, device)
        where = f"shard {shard}: " if shard.count > 1 else ""
        say(f"{where}{len(mine)} utterances of {listing.lines} lines ({len(done)} done before), {model.family.title} "
            f"features on {device}")
        work.run(mine, done)
    finally:
        journal.close()


def _finish(settings: Any, store: Any, shard: Any, model: Model, listing: Any, tokenizer: Path | None | bool) -> int:
    from trainers.tools.prepare.layouts import LAYOUTS
    from trainers.tools.prepare.merge import merge, missing, summary_lines

    merged = merge(store, listing, LAYOUTS[model.family.name], settings)
    if merged is None:
        absent, _ = missing(store, listing)
        print(f"shard {shard} is done; {len(absent)} utterances of other shards are not yet: the last shard to "
              "finish writes the manifests (or run with --merge once every shard has finished)", flush=True)
        return EXIT_OK
    command = training_command(model, tokenizer, settings.out, merged) if tokenizer is not False else []
    for line in summary_lines(merged, settings.out) + command:
        print(line, flush=True)
    return EXIT_SKIPPED if merged.problems and "RANK" not in os.environ else EXIT_OK


def merge_only(settings: Any, store: Any) -> int:
    """--merge: the manifests from the records there are, with the family the plan names (no model is loaded)."""
    from trainers.tools.prepare.layouts import LAYOUTS
    from trainers.tools.prepare.merge import merge, missing, summary_lines

    plan = store.read_plan()
    if plan is None:
        raise UserError(f"--out {settings.out} holds no preparation (no {store.state.name}/plan.json); run "
                        "indextts-prepare without --merge first")
    listing = _listing(settings)
    if listing.fingerprint != plan["input"]:
        raise UserError(f"--input is not the list {settings.out} was prepared from (its sha256 differs); pass that "
                        "list, or run without --merge and with --update")
    merged = merge(store, listing, LAYOUTS[plan["family"]], settings)
    if merged is None:
        absent, _ = missing(store, listing)
        raise UserError(f"{len(absent)} utterances have no features yet (e.g. {absent[0].source}): run the shards "
                        "that are not finished (the same command with their --shard) first")
    for line in summary_lines(merged, settings.out):
        print(line, flush=True)
    return EXIT_SKIPPED if merged.problems else EXIT_OK


@quiet_broken_pipes()
def main(argv: list[str] | None = None) -> int:
    from trainers.tools.prepare.settings import parse_settings

    settings = parse_settings(argv)
    from trainers.hardware.oom_recovery import OutOfMemoryStop

    try:
        if settings.demo:
            from trainers.tools.prepare.demo import run_demo

            return run_demo(settings)
        return prepare(settings)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except OutOfMemoryStop as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY
    except KeyboardInterrupt:
        print("interrupted: run the same command again to continue where it stopped", file=sys.stderr, flush=True)
        return 130
