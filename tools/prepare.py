#!/usr/bin/env python3
"""From audio and transcripts to the manifests and feature files the trainer reads.

The command `indextts-prepare` runs the same; the code and its usage: trainers/tools/prepare/cli.py.
"""
import sys

try:
    from trainers.tools.prepare.cli import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
