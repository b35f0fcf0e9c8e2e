"""One declaration per setting: a dataclass field made by `setting()` carries its flag, help, range, resume class,
the value older runs trained with and the demo's value, and everything else is derived from it.

The settings dataclasses are TrainConfig, the launch flags of CommandLine and other commands' own;
docs/flags.md's tables of ranges and resume classes are generated from them (tests/test_docs.py). Free of
torch: the parser answers --help before torch loads.
"""
from __future__ import annotations

import argparse
import difflib
import enum
import functools
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, NoReturn, Sequence

from trainers.config.bounds import Bound, bounded_number, parses_as_number, real_number, whole_number

_KEY = "setting"


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # not declared (no legacy value: every saved run has the setting; no demo value)


class Resume(enum.Enum):
    """What a resume does with a saved setting given anew (the settings saved with a run are classified)."""

    RESULT = "changes the result: refused on resume without `--allow-config-change`"
    CONTENT = "a file that may move; its content (sha256) changes the result: refused as above"
    FREE = "may change on resume"
    MACHINE = "may change on resume; reused from the saved run only on the same kind of machine"


@dataclass(frozen=True)
class Setting:
    help: str  # --help's text, before the range and the default it appends
    resume: Resume | None = None  # None: never saved (a flag of this launch, or of a command without runs)
    flag: str | None = UNSET  # UNSET: --the-field-name; None: no flag (read from a saved run only)
    bound: Bound | None = None  # a number's range: checked with the saved run's values, or at once if never saved
    choices: tuple[str, ...] | None = None
    legacy: Any = UNSET  # what a saved run that lacks the setting (older than it) trained with, or a function of
    # that run's saved values giving it (UNSET: none)
    upgrade: Callable[[Any], Any] | None = None  # a saved value (in the form an older run saved) -> today's form
    demo: Any = UNSET  # --demo's value
    saved_if: Callable[[Any, Setting], bool] | None = None  # (settings, this) -> saved with the run? None: always
    # argparse: the flag's form
    aliases: tuple[str, ...] = ()
    section: str | None = None  # opens this --help group ("": the top-level options); later fields follow it
    after: str | None = None  # listed after this field of an earlier class
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    repeat: str | None = None  # "each": a tuple of every value given; "once": of each distinct value once
    negatable: bool = False  # --x / --no-x (a bool flag otherwise sets the opposite of its default)
    bare: Any = UNSET  # the value of the flag given without one
    shown: str | None = UNSET  # the default as --help shows it (UNSET: from the value; None: not shown)
    absolute: Callable[[str], str] | None = None  # makes a typed path absolute
    name: str = ""  # the field's, filled in by declared()
    default: Any = None

    def called(self) -> str:
        """How a message names the setting: its flag, or the key a run saves it under."""
        return self.flag or f"the setting {self.name} saved with the run"

    def help_text(self) -> str:
        text = f"{self.help} ({self.bound.range_text()})" if self.bound else self.help
        shown = self.shown
        if shown is UNSET:
            d = self.default
            hidden = d is None or d == () or (isinstance(d, bool) and not self.negatable)
            shown = None if hidden else ("on" if d else "off") if isinstance(d, bool) else str(d)
        return f"{text} [{shown}]" if shown is not None else text

    def argument(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"dest": self.name, "help": self.help_text()}
        if self.bound:  # a saved setting's range is checked with the saved run's values (value_problems)
            kind = whole_number if self.bound.kind is int else real_number
            kw["type"] = kind if self.resume else bounded_number(self.bound)
        elif self.parse:
            kw["type"] = self.parse
        if self.negatable:
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(self.default, bool):
            kw.update(action="store_const", const=not self.default)
        if self.repeat:
            kw["action"] = "append"
        if self.bare is not UNSET:
            kw.update(nargs="?", const=self.bare)
        for key in ("choices", "metavar"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        return kw


def setting(default: Any, help: str, **declared: Any) -> Any:
    """A dataclass field declaring a setting (the keywords are Setting's)."""
    return field(default=default, metadata={_KEY: Setting(help, **declared)})


@functools.cache
def declared(cls: type) -> tuple[Setting, ...]:
    """The declared settings of a dataclass, in field order (fields made without setting() are left out)."""
    found = []
    for f in fields(cls):
        if _KEY in f.metadata:
            s = f.metadata[_KEY]
            flag = "--" + f.name.replace("_", "-") if s.flag is UNSET else s.flag
            found.append(replace(s, name=f.name, default=f.default, flag=flag))
    return tuple(found)


def saved_values(cls: type, saved: dict[str, Any]) -> dict[str, Any]:
    """The cls settings a run saved, completed for runs written by older versions (with the value that run trained
    with, never today's default, which may differ) and in today's form."""
    values = {s.name: saved[s.name] for s in declared(cls) if s.name in saved}
    for s in declared(cls):
        if s.name not in values and s.legacy is not UNSET:
            values[s.name] = s.legacy(values) if callable(s.legacy) else s.legacy
        if s.upgrade and s.name in values:
            values[s.name] = s.upgrade(values[s.name])
    return {k: v for k, v in values.items() if v is not UNSET}


def differs_from_legacy(settings: Any, s: Setting) -> bool:
    """A saved_if: a value the runs older than the setting trained with is left out, as they left it out."""
    return getattr(settings, s.name) != s.legacy


def undeclared(cls: type) -> list[str]:
    """Fields of a settings dataclass made without setting() or, for one saved with runs, without a resume class."""
    classified = {s.name for s in declared(cls) if s.resume}
    return [f.name for f in fields(cls) if f.name not in classified]


def names(cls: type, *kinds: Resume) -> tuple[str, ...]:
    """The settings of cls that a resume treats as one of `kinds`."""
    return tuple(s.name for s in declared(cls) if s.resume in kinds)


def add_flags(parser: argparse.ArgumentParser, *classes: type) -> None:
    """Every declared flag of the classes, in field order, grouped by section (the top-level ones last)."""
    order: list[Setting] = []
    for cls in classes:
        for s in declared(cls):
            if s.after:
                order.insert(1 + [o.name for o in order].index(s.after), s)
            elif s.flag:
                order.append(s)
    placed, section = [], ""
    for s in order:
        section = section if s.section is None else s.section
        placed.append((section, s))
    ranks = list(dict.fromkeys([title for title, _ in placed if title] + [""]))
    groups: dict[str, Any] = {"": parser}
    for title, s in sorted(placed, key=lambda p: ranks.index(p[0])):
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        groups[title].add_argument(s.flag, *s.aliases, **s.argument())


def given_values(cls: type, typed: dict[str, Any]) -> dict[str, Any]:
    """The cls settings among argparse's values (a flag not typed is absent): repeated ones as tuples, paths
    made absolute."""
    values = {}
    for s in declared(cls):
        if s.name in typed:
            value = typed[s.name]
            if s.absolute:
                value = [s.absolute(v) for v in value] if s.repeat else s.absolute(value)
            if s.repeat:
                value = tuple(dict.fromkeys(value) if s.repeat == "once" else value)
            values[s.name] = value
    return values


def value_problems(cls: type, values: dict[str, Any]) -> list[str]:
    """One message per value outside its range or choices, naming the setting, what it accepts and the value."""
    problems = []
    for s in declared(cls):
        value = values.get(s.name)
        if value is None:  # not resolved yet
            continue
        if s.bound and not s.bound.accepts(value):
            problems.append(f"{s.called()} must be {s.bound.describe()}, got {value!r}")
            problems += [advice] if (advice := s.bound.advice(value)) else []
        elif s.choices and not s.repeat and value not in s.choices:
            problems.append(f"{s.called()} must be one of {', '.join(s.choices)}, got {value!r}")
    return problems


class SettingsParser(argparse.ArgumentParser):
    """A command's parser of the classes' declared flags (add_flags). Only whole flag names count (`--lr 1000`
    must not quietly set --lr-decay-steps); a usage error is two lines (what is wrong, where --help is) instead of
    the whole usage, naming the flag an unknown one most likely meant (`--learning_rate` -> `--learning-rate`); a
    negative number after a numeric flag reaches its range check (join_negative_values). Flags not typed are
    absent from the result."""

    def __init__(self, prog: str, description: str, *classes: type) -> None:
        super().__init__(prog=prog, description=description, argument_default=argparse.SUPPRESS, allow_abbrev=False)
        add_flags(self, *classes)
        self.numeric = frozenset(f for c in classes for s in declared(c) if s.bound and s.flag
                                 for f in (s.flag, *s.aliases))

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:
        argv = join_negative_values(sys.argv[1:] if args is None else list(args), self.numeric)
        ns, extras = self.parse_known_args(argv, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self.suggestions(extras)}")
        return ns

    def suggestions(self, extras: Sequence[str]) -> str:
        known = sorted(o for o in self._option_string_actions if o.startswith("--"))
        names = [word.split("=", 1)[0] for word in extras if word.startswith("--")]
        closest = [(name, _closest_flag(name, known)) for name in names]
        meant = [(name, close) for name, close in closest if close]
        if len(meant) == 1:
            return f"; did you mean {meant[0][1]}?"
        return f"; did you mean {', '.join(f'{c} for {n}' for n, c in meant)}?" if meant else ""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"usage: {self.prog} [FLAGS] (--help lists them all)\n{self.prog}: error: {message}\n")


def _closest_flag(name: str, known: Sequence[str]) -> str | None:
    """The flag a mistyped one most likely meant: underscores for dashes, a flag it begins (abbreviations are
    not accepted: allow_abbrev=False), else the most similar name."""
    dashed = name.replace("_", "-")
    if dashed in known:
        return dashed
    begun = [k for k in known if k.startswith(dashed)]
    if begun:
        return min(begun, key=len)
    close = difflib.get_close_matches(dashed, known, n=1, cutoff=0.8)
    return close[0] if close else None


def join_negative_values(argv: Sequence[str], numeric: frozenset[str]) -> list[str]:
    """`--learning-rate -1e-3` -> `--learning-rate=-1e-3` for the `numeric` flags.

    argparse takes a word that starts with '-' for an option unless it looks like '-1' or '-0.5',
    so '-1e-3', '-inf' or '-1.' after a numeric flag end in "expected one argument". Joined with
    '=', the value reaches the range check, which says what is wrong with it. Only whole flag
    names are joined: the parser refuses abbreviations (`--learn -1e-3` is an unknown flag).
    """
    out: list[str] = []
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--":
            return [*out, arg, *rest]
        if arg in numeric and rest and rest[0].startswith("-") and parses_as_number(rest[0]):
            arg = f"{arg}={rest.pop(0)}"
        out.append(arg)
    return out
