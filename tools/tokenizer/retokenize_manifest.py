#!/usr/bin/env python3
"""Make the text ids of training manifests with a (new or extended) SentencePiece model.

The command `indextts-retokenize` runs the same; the code and its usage:
trainers/tools/tokenizer/retokenize_manifest.py.
"""
import sys

try:
    from trainers.tools.tokenizer.retokenize_manifest import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
