#!/usr/bin/env python3
"""Plot the training history of one or more runs into a PNG.

The command `indextts-plot` runs the same; the code and its usage: trainers/tools/plot_runs.py.
"""
import sys

try:
    from trainers.tools.plot_runs import main
except ModuleNotFoundError as exc:
    if exc.name != "trainers":
        raise
    print(f"error: this Python ({sys.executable}) has no trainers package: install the repository with "
          "`pip install -e .` in its folder (the README's set-up command), then run this again", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
