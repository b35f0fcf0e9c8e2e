#!/usr/bin/env python3
"""Export a checkpoint for IndexTTS2 inference: gpt.pth in the upstream layout, its config.yaml and tokenizer.

The command `indextts-export` runs the same; the code and its usage:
trainers/tools/export_checkpoint.py.
"""
import sys

try:
    from trainers.tools.export_checkpoint import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
