"""Reading an IndexTTS2 config.yaml: one reader for the trainer (--config) and the export, so both
refuse a missing, unreadable or foreign file with the same messages, each naming the file (or the
flag that gave it) and what to pass instead."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trainers.errors import UserError


def read_config_yaml(path: str | Path, label: str, advice: str) -> dict[str, Any]:
    """The file's settings, which have a 'gpt' section; UserError otherwise.

    label: how the messages name the file ("--config PATH" where a flag gave it); advice: what to pass
    instead, e.g. "pass the IndexTTS2 config.yaml".
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{label}: file not found; {advice}") from None
    except OSError as exc:
        raise UserError(f"{label}: {exc.strerror}; {advice}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:  # one line: the parser's message spans several
        raise UserError(f"{label}: not valid YAML ({' '.join(str(exc).split())}); {advice}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpt"), dict):
        raise UserError(f"{label}: no 'gpt' section; {advice}")
    return data
