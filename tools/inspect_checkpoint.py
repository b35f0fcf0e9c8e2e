#!/usr/bin/env python3
"""Describe a GPT checkpoint, verify it (--verify) or measure its base rows' drift (--base).

The command `indextts-inspect` runs the same; the code and its usage:
trainers/tools/inspect_checkpoint.py.
"""
import sys

try:
    from trainers.tools.inspect_checkpoint import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
