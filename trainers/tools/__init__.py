"""The tools users run around training (export, inspect, plots, pack, tokenizer): their code, called by
the console scripts (indextts-export, ...) and by the scripts in tools/."""
from __future__ import annotations

import functools
import sys
from typing import Callable

from trainers.console_streams import quiet_broken_pipes
from trainers.errors import EXIT_USAGE, UserError

Main = Callable[[list[str] | None], int]


def tool_main(main: Main) -> Main:
    """A tool's main(): quiet once its reader leaves (console_streams), a UserError printed as "error: ..."
    with exit status 2 and no traceback."""

    @functools.wraps(main)
    @quiet_broken_pipes()
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE

    return run
