#!/usr/bin/env python3
"""Render a run's generated validation samples to WAV files (and TensorBoard) with the user's IndexTTS2.

The command `indextts-render` runs the same; the code and its usage: trainers/tools/render_samples.py.
"""
import sys

try:
    from trainers.tools.render_samples import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
