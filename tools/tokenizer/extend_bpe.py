#!/usr/bin/env python3
"""Extend a SentencePiece tokenizer with pieces for a new script, keeping every existing id.

The command `indextts-extend-bpe` runs the same; the code and its usage:
trainers/tools/tokenizer/extend_bpe.py.
"""
import sys

try:
    from trainers.tools.tokenizer.extend_bpe import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
