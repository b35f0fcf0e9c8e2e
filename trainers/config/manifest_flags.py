"""The one reader of a manifest flag's value, PATH[::LANG[@SHARE]] (--train-manifest, --val-manifest).

The language follows the last '::' (a path may hold '::'), a share the last '@' of the language. What they may
hold is checked elsewhere: a share by trainers/data/mixing.py, a language by the model family.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

LANG_SEPARATOR = "::"
SHARE_SEPARATOR = "@"


@dataclass(frozen=True)
class ManifestFlag:
    given: str  # as typed
    path: str
    lang: str | None = None  # after '::', as written (None: no '::')
    share: str | None = None  # after the language's '@', as written (None: no share)

    @property
    def manifest(self) -> str:
        """PATH or PATH::LANG: the value without its share."""
        return self.given if self.share is None else self.given[:-len(SHARE_SEPARATOR + self.share)]

    def moved(self, path: str) -> str:
        """The value with another path: its language and share follow it."""
        return path + self.given[len(self.path):]


def manifest_flag(text: str) -> ManifestFlag:
    path, sep, lang = text.rpartition(LANG_SEPARATOR)
    if not sep:
        return ManifestFlag(text, text)
    name, at, share = lang.rpartition(SHARE_SEPARATOR)
    return ManifestFlag(text, path, name, share) if at else ManifestFlag(text, path, lang)


def absolute_manifest(text: str) -> str:
    """The value with its path absolute (a run must not depend on the directory it was started in)."""
    one = manifest_flag(text)
    return one.moved(os.path.abspath(one.path))


def validation_share_problems(values: Sequence[str]) -> list[str]:
    """A share draws part of every training step from a manifest: on a validation manifest it means nothing (and
    would otherwise end up in the language's name)."""
    return [f"--val-manifest {one.given}: a share (@{one.share}) draws training samples and means nothing for "
            f"validation; write PATH or PATH::LANG" for one in map(manifest_flag, values) if one.share is not None]
