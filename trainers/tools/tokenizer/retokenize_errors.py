"""The two failures of tools/tokenizer/retokenize_manifest.py, which its main() turns into exit statuses:
Refusal (input problems found before anything is written, status 2) and WriteFailure (a write
failed part-way, status 1)."""
from __future__ import annotations

from typing import Sequence


class Refusal(Exception):
    """Input problems; nothing is written. Each entry is one 'where: what; what to do' line."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class WriteFailure(Exception):
    """Writing an output failed after others were written."""
