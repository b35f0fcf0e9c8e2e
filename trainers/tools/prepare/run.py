"""What indextts-prepare does with its settings (cli.py parses them): the model read, the backend made, the
output's plan checked, this shard's work done (work.py) and, when no shard's work is missing, the merge
(merge.py) and the closing summary. --demo (demo.py) calls `prepare` on the audio it synthesises.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainers.config.config_yaml import read_config_yaml
from trainers.errors import EXIT_OK, UserError
from trainers.families import FAMILIES, family_for_config
from trainers.families.family import ModelFamily
from trainers.hardware.detect import pick_device as pick
from trainers.model.gpt_model import GPTConfig
from trainers.tools.prepare.backend import BackendRequest, FeatureBackend, backend_factory
from trainers.tools.prepare.batching import Encoder
from trainers.tools.prepare.checks import LineLimits
from trainers.tools.prepare.inputs import Listing, read_input
from trainers.tools.prepare.layouts import LAYOUTS
from trainers.tools.prepare.merge import MANIFESTS, SKIPPED_NAME, SUMMARY_NAME, Merged, merge, missing, summary_lines
from trainers.tools.prepare.report import command_lines, say, warn
from trainers.tools.prepare.settings import PrepareSettings, Shard
from trainers.tools.prepare.store import FORMAT_VERSION, Store, owner
from trainers.tools.prepare.work import ShardWork
from trainers.tools.wav_files import safe_names

EXIT_SKIPPED = 3


@dataclass
class Model:
    """The model the features are for: its family, gpt config and files (from --config / --model-dir)."""

    family: ModelFamily
    gpt: GPTConfig
    config: Path
    data: dict[str, Any]
    model_dir: Path | None


def read_model(settings: PrepareSettings) -> Model:

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


def pick_device(name: str) -> torch.device:
    """auto: the GPU of this process (torchrun's LOCAL_RANK) if there is one, else the CPU; else the named device."""
    if name == "auto" and torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    return pick(name)


def tokenizer_path(settings: PrepareSettings, model: Model) -> Path | None:
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


def check_tokenizer(model: Model, tokenizer: Path) -> None:
    """The tokenizer file is the family's kind and fits the config (UserError naming the flag otherwise)."""
    tokens = model.family.tokenizer
    flag = f"--tokenizer {tokenizer}"
    if not tokens.recognises(str(tokenizer)):
        raise UserError(f"{flag}: not a {tokens.kind}; pass the tokenizer of the {model.family.title} model"
                        if tokenizer.is_file() else f"{flag}: no such file")
    problem = tokens.config_size_problem(tokens.size(str(tokenizer)), model.gpt.number_text_tokens)
    if problem:
        raise UserError(f"{flag}: {problem}")


def plan_of(settings: PrepareSettings, model: Model, backend: FeatureBackend, listing: Listing) -> dict[str, Any]:
    """What the output's features are made from: saved with it, compared by every later run (check_plan)."""
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


def check_plan(store: Store, plan: dict[str, Any], update: bool) -> None:
    """The output's plan is this one, or the preparation is refused (UserError); --update takes a changed input."""
    saved = store.create(plan, (*MANIFESTS, SKIPPED_NAME, SUMMARY_NAME))
    if saved == plan:
        return
    other = {k: v for k, v in saved.items() if k != "input"}
    if other != {k: v for k, v in plan.items() if k != "input"}:
        lines = "".join(f"\n  {d}" for d in _differences(other, {k: v for k, v in plan.items() if k != "input"}))
        raise UserError(f"--out {store.out} holds features made otherwise, which would be mixed with these; prepare "
                        f"into a new --out, or delete that folder to start over:{lines}")
    if not update:
        raise UserError(f"--input changed since {store.out} was started (sha256 {saved['input'][:12]}..., now "
                        f"{plan['input'][:12]}...):\n  pass --update to keep the features of unchanged lines and make "
                        "the rest, or prepare into a new --out")
    store.replace_plan(plan)


def training_command(model: Model, tokenizer: Path | None, out: Path, merged: Merged) -> list[str]:
    """The trainer's command for the result."""
    gpt = model.model_dir / str(model.data.get("gpt_checkpoint", "gpt.pth")) if model.model_dir else None
    args = ["--config", str(model.config), "--tokenizer", str(tokenizer or "TOKENIZER"), "--base-checkpoint",
            str(gpt or "GPT.pth"), "--train-manifest", str(out / "train_pairs.jsonl")]
    if "val_pairs.jsonl" in merged.written:
        args += ["--val-manifest", str(out / "val_pairs.jsonl")]
    return ["train on it:", *command_lines("indextts-train", [*args, "--output-dir", "runs/my_voice"])]


def prepare(settings: PrepareSettings, show_command: bool = True) -> int:
    """The whole command but --demo; its exit status (`show_command`: end with the training command)."""

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
    device = pick_device(settings.device)
    tokenizer = tokenizer_path(settings, model)
    if tokenizer is not None:
        check_tokenizer(model, tokenizer)
    request = BackendRequest(model.family.name, model.config, model.model_dir, settings.indextts_dir, tokenizer,
                             str(device))
    backend = backend_factory(settings.backend)(request)
    listing = _listing(settings)
    check_plan(store, plan_of(settings, model, backend, listing), settings.update)
    _work(settings, store, shard, model, backend, listing, device)
    return _finish(settings, store, shard, model, listing, tokenizer if show_command else False)


def _listing(settings: PrepareSettings) -> Listing:
    return read_input(settings.input, settings.input_format, settings.speaker, settings.language)


def _work(settings: PrepareSettings, store: Store, shard: Shard, model: Model, backend: FeatureBackend,
          listing: Listing,
          device: torch.device) -> None:

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


def _finish(settings: PrepareSettings, store: Store, shard: Shard, model: Model, listing: Listing,
            tokenizer: Path | None | bool) -> int:

    merged = merge(store, listing, LAYOUTS[model.family.name], settings)
    if merged is None:
        absent, _ = missing(store, listing)
        print(f"shard {shard} is done; {len(absent)} utterances of other shards are not yet:\n"
              "  the last shard to finish writes the manifests (or --merge, once every shard has finished)", flush=True)
        return EXIT_OK
    command = training_command(model, tokenizer, settings.out, merged) if tokenizer is not False else []
    for line in summary_lines(merged, settings.out) + command:
        print(line, flush=True)
    return EXIT_SKIPPED if merged.problems and "RANK" not in os.environ else EXIT_OK


def merge_only(settings: PrepareSettings, store: Store) -> int:
    """--merge: the manifests from the records there are, with the family the plan names (no model is loaded)."""

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


