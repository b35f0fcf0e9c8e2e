#!/usr/bin/env python3
"""Make a run directory carry its own tokenizer and config, so it resumes wherever it is copied.

The command `indextts-pack-run` runs the same; the code and its usage: trainers/tools/pack_run.py.
"""
import sys

try:
    from trainers.tools.pack_run import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
