"""The model limits a manifest line is checked against: max_text_tokens (from --max-text-tokens
or the config), max_mel_tokens and the start/stop text ids, read from an IndexTTS2 config.yaml,
and the trainer's check that a sample fits the position tables."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainers.tools.tokenizer.retokenize_errors import Refusal

START_TEXT_TOKEN, STOP_TEXT_TOKEN = 0, 1  # official config; --config may say otherwise
PREFIX_POSITIONS = 34  # 32 conditioning vectors + 2 speed embeddings


@dataclass(frozen=True)
class Limits:
    max_text_tokens: int | None = None
    max_mel_tokens: int | None = None
    source: str = "none"
    start: int = START_TEXT_TOKEN
    stop: int = STOP_TEXT_TOKEN
    prefix: int = PREFIX_POSITIONS  # the model's conditioning prefix (IndexTTS-2.5: 3)
    version: str | None = None  # the config's `version` (2.5: an IndexTTS-2.5 config)
    number_text_tokens: int | None = None

    def positions_problem(self, text_len: int, code_len: Any) -> str | None:
        """The trainer's check that a sample fits the text and mel position tables."""
        if self.max_text_tokens is None or self.max_mel_tokens is None or type(code_len) is not int:
            return None
        needed = self.prefix + (text_len + 2) + (code_len + 2)
        room = (self.max_mel_tokens + 3) + (self.max_text_tokens + 2)
        if needed <= room:
            return None
        return (f"the sample needs {needed} positions ({self.prefix}+({text_len}+2)+({code_len}+2)) but "
                f"(gpt.max_mel_tokens+3)+(gpt.max_text_tokens+2) is {room}, so the trainer refuses it; "
                "drop or split this sample")


def _config_int(gpt: dict, key: str, path: Path, required: bool) -> int | None:
    value = gpt.get(key)
    if value is None and not required:
        return None
    if type(value) is not int or value < (0 if key.endswith("_token") else 1):
        raise Refusal([f"--config {path}: gpt.{key} is {value!r}; it must be "
                       + ("a non-negative integer" if key.endswith("_token") else "a positive integer")
                       + " (is it an IndexTTS2 config.yaml?)"])
    return value


def resolve_limits(config: Path | None, max_text_tokens: int | None) -> Limits:
    if max_text_tokens is not None and max_text_tokens < 1:
        raise Refusal([f"--max-text-tokens {max_text_tokens} must be at least 1"])
    if config is None:
        source = "--max-text-tokens" if max_text_tokens is not None else "none"
        return Limits(max_text_tokens, None, source)
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Refusal([f"--config {config}: no such file; pass the config.yaml the trainer will use"]) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise Refusal([f"--config {config}: cannot read it as YAML ({exc}); pass an IndexTTS2 config.yaml"]) from None
    gpt = data.get("gpt") if isinstance(data, dict) else None
    if not isinstance(gpt, dict):
        raise Refusal([f"--config {config}: no 'gpt' section; pass an IndexTTS2 config.yaml"])
    from_config = _config_int(gpt, "max_text_tokens", config, required=True)
    start = _config_int(gpt, "start_text_token", config, required=False)
    stop = _config_int(gpt, "stop_text_token", config, required=False)
    return Limits(
        max_text_tokens if max_text_tokens is not None else from_config,
        _config_int(gpt, "max_mel_tokens", config, required=False),
        "--max-text-tokens" if max_text_tokens is not None else f"{config} gpt.max_text_tokens",
        START_TEXT_TOKEN if start is None else start, STOP_TEXT_TOKEN if stop is None else stop,
        version=str(data.get("version")), number_text_tokens=_config_int(gpt, "number_text_tokens", config, False))
