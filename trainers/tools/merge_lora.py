"""Fold a LoRA adapter file into its base checkpoint, giving one gpt.pth in the upstream layout that
IndexTTS2 inference loads as it loads the official one.

    python tools/merge_lora.py --adapter voice.lora.pth --base /models/IndexTTS-2/gpt.pth --out merged.pth

The adapter file is verified against the checksums written with it (a damaged one is refused, naming the
tensor; one written before adapter files carried checksums is merged with a warning). It names the base it was
trained on by sha256: another base is refused (the adapters
would be added to weights they were not trained against) unless --allow-other-base says the user knows
it holds the same weights in other bytes. --out must not exist: nothing a user has is replaced. The
merged file keeps the base's layout ({"model": ...} or a bare state dict) and dtype, and holds exactly the
tensors an export of the same run holds (trainers/tools/export_contents.py `exported_state`), for the base's model
family (told by its keys: `family_for_state`; an IndexTTS-2.5 base keeps spk_emb_proj and lang_embedding).
Exit status 0, or 2 with `error: ...` and nothing written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainers.errors import UserError
from trainers.files import file_sha256
from trainers.checkpoint import adapter_file
from trainers.families import family_for_state
from trainers.model.weights import read_state_dict, strip_module_prefix
from trainers.tools import tool_main
from trainers.tools.export_contents import exported_state, listed
from trainers.torch_files import atomic_torch_save, load_checkpoint


def merge(adapter: Path, base: Path, out: Path, allow_other_base: bool = False) -> str:
    """Write the merged checkpoint to `out`; the line to print. UserError when anything is wrong."""
    if out.exists():
        raise UserError(f"--out {out} already exists; choose another path or remove it first")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no such directory {out.parent}")
    found = adapter_file.read(adapter)
    lora = found.adapter
    if not found.verified:
        print(f"warning: --adapter {adapter} was {adapter_file.UNVERIFIABLE}", file=sys.stderr)
    state = read_state_dict(base, flag="--base")
    sha = file_sha256(base)
    if sha != lora.base_sha256 and not allow_other_base:
        raise UserError(f"--base {base} (sha256 {sha[:16]}...) is not the base {adapter} was trained on "
                        f"({lora.base_path}, sha256 {lora.base_sha256[:16]}...); pass that file, or "
                        "--allow-other-base if this one holds the same weights")
    try:
        merged = lora.merged(state)
    except ValueError as exc:
        raise UserError(f"--adapter {adapter} does not fit --base {base}: {exc}") from None
    family = family_for_state(strip_module_prefix(state)[0])
    kept, left_out = exported_state(merged, family)  # exactly what an export of the same run writes
    wrapped = "model" in load_checkpoint(base, mmap=True)
    atomic_torch_save({"model": kept} if wrapped else kept, out)
    s = lora.settings
    dropped = (f"; left out ({family.inference_name}'s UnifiedVoice does not load them): "
               f"{', '.join(listed(left_out))}" if left_out else "")
    return (f"merged {len(lora.adapters) // 2} adapters (rank {s.rank}, alpha {s.alpha:g}) and "
            f"{len(lora.replaced)} replaced tensors into {base} ({family.title}) -> {out}{dropped}")


@tool_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fold a LoRA adapter file into its base gpt.pth (upstream layout).")
    parser.add_argument("--adapter", type=Path, required=True, help="the LoRA adapter file")
    parser.add_argument("--base", type=Path, required=True, help="the base gpt.pth the adapters were trained on")
    parser.add_argument("--out", type=Path, required=True, help="the merged checkpoint to write (must not exist)")
    parser.add_argument("--allow-other-base", action="store_true",
                        help="merge into a base whose sha256 differs from the one the adapter file names")
    args = parser.parse_args(argv)
    print(merge(args.adapter, args.base, args.out, args.allow_other_base))
    return 0
