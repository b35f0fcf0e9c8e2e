#!/usr/bin/env python3
"""Fold a LoRA adapter file into its base checkpoint (upstream layout, for IndexTTS2 inference).

The command `indextts-merge-lora` runs the same; the code and its usage: trainers/tools/merge_lora.py.
"""
import sys

try:
    from trainers.tools.merge_lora import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
