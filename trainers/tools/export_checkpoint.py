"""Export a checkpoint for IndexTTS2 inference: gpt.pth in the upstream layout, its config.yaml and tokenizer.

    python tools/export_checkpoint.py runs/my_voice --out exports/my_voice [--which latest|best|STEP] [--dtype fp16]
    python tools/export_checkpoint.py runs/my_voice/model_step4000.pth --out exports/step4000
    python tools/export_checkpoint.py runs/my_voice --config ~/IndexTTS2/checkpoints/config.yaml --out exports/my_voice
    python tools/export_checkpoint.py ~/IndexTTS2/checkpoints/gpt.pth --config ~/IndexTTS2/checkpoints/config.yaml \
        --out exports/official

Writes into the --out directory:

    gpt.pth       {"model": state dict}: the trained tensors (group A) and the conditioning encoders
                  carried from the base checkpoint (group B), nothing else (no optimizer, no run state),
                  readable with torch.load(weights_only=True); --dtype casts the floating tensors
    config.yaml   the full IndexTTS2 config (--config, default: the run directory's copy of the
                  config the run was trained with), every key kept, with gpt.number_text_tokens of
                  this run, dataset.bpe_model naming the copied tokenizer and gpt_checkpoint naming
                  gpt.pth; refused if it lacks a key inference reads (trainers/config/inference_keys.py),
                  as a trimmed config such as this repository's checkpoints/config.yaml does
    <tokenizer>   a copy of the run's SentencePiece model, under its own file name
    export.json   the record of this export: what was exported and the sha256 of every file written

The output directory rule: an export never replaces a file it did not write. A file of one of
those names may be replaced only if export.json (written by an earlier export into the same
directory) lists it with the sha256 it still has. Anything else there is left alone; files an
earlier export wrote and this one does not write again (a tokenizer of another name) are removed.

Every file is written under a temporary name, fsynced and renamed, and export.json lists both the
old and the new files while the renames happen, so a killed export leaves no half-written file and
the next export into the same directory is not refused.

What goes into the files is in export_contents.py, the --out directory rule and the atomic
writes in export_output.py (beside this file).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from trainers.config.inference_keys import other_model_files
from trainers.errors import UserError
from trainers.tools import tool_main
from trainers.tools.export_contents import (
    CONFIG_NAME, GPT_NAME, Inference, Selection, Source, cast, exported_tokenizer_name, inference_config, listed,
    read_source, resolve_inference, select_tensors,
)
from trainers.tools.export_output import check_output, write_export
from trainers.checkpoint import adapter_file
from trainers.checkpoint.lora_export import ADAPTER_NAME, adapter_file_of, merged_state
from trainers.tools.run_files import WHICH_HELP
from trainers.training.ema import with_averages

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- the export

@dataclass
class Export:
    source: Source
    out: Path
    dtype: str
    selection: Selection
    inference: Inference
    text_tokens: int
    files: dict[str, str]

    def lines(self) -> list[str]:
        sel, inf, out = self.selection, self.inference, self.out
        family = inf.family
        tok, name, key = exported_tokenizer_name(inf.tokenizer, family), family.inference_name, family.tokenizer_config_key
        values = sum(t.numel() for t in sel.state.values())
        lines = [f"exported {self.source.describe()} as {self.dtype} to {out}",
                 f"  {GPT_NAME}: {len(sel.state)} tensors ({sel.trained} trained, {sel.carried} carried), "
                 f"{values:,} values",
                 f"  {CONFIG_NAME}: from {inf.config_source}; gpt.number_text_tokens {self.text_tokens}, "
                 + (f"{key} {tok}, " if key else "") + f"gpt_checkpoint {GPT_NAME}",
                 f"  {tok}: copy of {inf.tokenizer} ({self.text_tokens} pieces"
                 + (")" if key else f"; the name {name} inference opens in model_dir)")]
        lines += [f"note: {n}" for n in [*self.source.notes, *inf.notes]]
        if sel.left_out:
            lines.append(f"left out (upstream's UnifiedVoice does not load them): {', '.join(listed(sel.left_out))}")
        model = "IndexTTS2" if key else "indextts.infer_v2_5.IndexTTS2"  # upstream's 2.5 class keeps the name
        lines += [f"point {name} inference at:",
                  f"  config     {out / CONFIG_NAME}",
                  f"  gpt        {out / GPT_NAME}",
                  f"  tokenizer  {out / tok}",
                  f"config.yaml names every model file by its name in model_dir, like the official one: copy or link "
                  f"{', '.join(other_model_files(inf.config))} from your {name} checkpoints folder into {out}, then use "
                  f"{model}(cfg_path=\"{out / CONFIG_NAME}\", model_dir=\"{out}\")"]
        return lines


def export(target: Path, out: Path, which: str | None = None, dtype: str = "fp32", config: Path | None = None,
           tokenizer: Path | None = None, base: Path | None = None, ema: bool = False) -> Export:
    source = read_source(target, which)
    if ema:  # the moving average of the trained tensors in their place; the rest as it is
        source.checkpoint = with_averages(source.checkpoint, source.path)
        source.state = dict(source.checkpoint.model)
        ckpt = source.checkpoint
        source.notes.append(f"--ema: the moving average of the weights (--ema-decay {ckpt.settings['ema_decay']:g}), "
                            f"not the weights of step {ckpt.step}")
    path = source.path
    lora = source.checkpoint.lora if source.checkpoint else None
    if base is not None and lora is None:
        raise UserError(f"--base is for a LoRA checkpoint (whose base it names); {path} holds its whole model")
    if lora is not None:  # the adapters merged into the base the run names: the upstream layout
        source.state = merged_state(source.checkpoint, path, base)
    inference = resolve_inference(source, config, tokenizer)
    selection = select_tensors(source.state, inference.gpt, path, inference.family)
    tok_name = exported_tokenizer_name(inference.tokenizer, inference.family)
    record = check_output(out, [GPT_NAME, CONFIG_NAME, tok_name])
    state = cast(selection.state, DTYPES[dtype])
    text_tokens = inference.gpt.number_text_tokens
    config_text = yaml.safe_dump(inference_config(inference.config, text_tokens, tok_name,
                                                  inference.family.tokenizer_config_key), sort_keys=False)
    tokenizer_bytes = inference.tokenizer.read_bytes()
    ckpt = source.checkpoint
    info = {"source": str(path.resolve()), "kind": source.kind, "step": ckpt.step if ckpt else None,
            "run_id": ckpt.run_id if ckpt else None, "dtype": dtype, "text_tokens": text_tokens,
            **({"ema": True} if ema else {})}
    files = write_export(out, {
        GPT_NAME: lambda f: torch.save({"model": state}, f),
        CONFIG_NAME: lambda f: f.write(config_text.encode("utf-8")),
        tok_name: lambda f: f.write(tokenizer_bytes),
    }, record, info)
    return Export(source, out, dtype, selection, inference, text_tokens, files)


def export_adapter(target: Path, out: Path, which: str | None = None, ema: bool = False) -> str:
    """--adapter-only: a LoRA checkpoint's adapters, trained rows, settings and base as an adapter file in `out`."""
    source = read_source(target, which)
    path, ckpt = source.path, source.checkpoint
    if ema and ckpt is not None and ckpt.lora is not None:
        ckpt = with_averages(ckpt, path)
    if ckpt is None or ckpt.lora is None:
        raise UserError(f"--adapter-only: {path} is not a checkpoint of a LoRA run (--lora-rank); it has no adapters")
    adapter = adapter_file_of(ckpt)
    record = check_output(out, [ADAPTER_NAME])
    info = {"source": str(path.resolve()), "kind": "lora-adapter", "step": ckpt.step, "run_id": ckpt.run_id}
    write_export(out, {ADAPTER_NAME: lambda f: adapter_file.write(adapter, f)}, record, info)
    s = adapter.settings
    return "".join(f"note: {n}\n" for n in source.notes) + (
            f"exported the adapters of {path} (step {ckpt.step}; rank {s.rank}, alpha {s.alpha:g}, "
            f"{len(adapter.adapters) // 2} projections, {len(adapter.replaced)} trained tensors beside them) to "
            f"{out / ADAPTER_NAME}; base {adapter.base_path} (sha256 {adapter.base_sha256[:16]}...): merge it with "
            f"indextts-merge-lora --adapter {out / ADAPTER_NAME} --base {adapter.base_path} --out merged.pth")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Export a checkpoint for IndexTTS2 inference: gpt.pth in the "
                                                 "upstream layout, config.yaml and the tokenizer, into --out.")
    parser.add_argument("source", type=Path, help="run directory, a trainer checkpoint (.pth) or an official gpt.pth")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument("--which", help=WHICH_HELP)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of the floating tensors (integer buffers are kept); default fp32")
    parser.add_argument("--config", type=Path,
                        help="the full IndexTTS2 config.yaml of your checkpoints folder, with every key inference "
                             "reads (default: the run directory's config.yaml, the config the run was trained with; "
                             "required for an official gpt.pth and for a run trained with a trimmed config)")
    parser.add_argument("--tokenizer", type=Path, help="SentencePiece model (default: the one the run recorded; for "
                                                       "an official gpt.pth the config's dataset.bpe_model)")
    parser.add_argument("--base", type=Path, help="a LoRA checkpoint's base gpt.pth, where it is not at the path "
                                                  "saved with the run (it must be the same file: sha256 checked)")
    parser.add_argument("--ema", action="store_true", help="export the moving average of the weights a run kept "
                        "(--ema-decay) instead of its weights")
    parser.add_argument("--adapter-only", action="store_true",
                        help=f"a LoRA checkpoint: write its adapters alone as {ADAPTER_NAME} (an adapter file for "
                             "indextts-merge-lora) instead of the merged model")
    return parser.parse_args(argv)


@tool_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.adapter_only:
        print(export_adapter(args.source, args.out, args.which, args.ema))
        return 0
    result = export(args.source, args.out, args.which, args.dtype, args.config, args.tokenizer, args.base, args.ema)
    print("\n".join(result.lines()))
    return 0
