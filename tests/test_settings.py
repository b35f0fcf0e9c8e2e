"""Each setting is declared once (trainers/config/declare.py), and what is derived from the declarations holds:
every field of TrainConfig is classified for resume and compared, every range refuses by name, the flags parse
into the fields, and another command's dataclass can declare its settings the same way. Torch-free and
in-process: well under a second."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import pytest

from trainers.config.bounds import count, finite
from trainers.config.declare import (
    Resume, SettingsParser, declared, given_values, setting, undeclared, value_problems,
)
from trainers.config.flags import CommandLine, build_parser, parse_command_line
from trainers.config.manifest_flags import absolute_manifest
from trainers.config.settings import TrainConfig, compare, saved_settings


def test_every_setting_of_a_run_is_declared_and_classified_for_resume():
    """A field without a resume class would change silently on a resume (or be refused for nothing)."""
    assert undeclared(TrainConfig) == []


def test_a_resume_reports_a_change_of_every_setting_as_its_class_says():
    base = TrainConfig()
    for s in declared(TrainConfig):
        changes = compare(base, replace(base, **{s.name: object()}), {}, {})
        assert [(c.key, c.breaks_exactness) for c in changes] == [(s.name, s.resume is Resume.RESULT)], s.name


def test_every_range_refuses_a_value_outside_it_by_name_and_accepts_the_defaults():
    assert value_problems(TrainConfig, TrainConfig().to_dict()) == []
    for cls in (TrainConfig, CommandLine):
        for s in (s for s in declared(cls) if s.bound):
            outside = s.bound.low if s.bound.low_open else s.bound.low - 1
            assert value_problems(cls, {s.name: outside}) == [
                f"{s.called()} must be {s.bound.describe()}, got {outside!r}"], s.name
    assert value_problems(TrainConfig, {"adam_beta2": 1.5, "data_order": "sorted"}) == [
        "the setting adam_beta2 saved with the run must be a finite number >= 0 and < 1, got 1.5",
        "--data-order must be one of grouped, random, got 'sorted'"]


def test_every_flag_sets_its_field():
    parser = build_parser()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    for cls in (TrainConfig, CommandLine):
        for s in declared(cls):
            assert (by_flag[s.flag].dest if s.flag else None) == (s.name if s.flag else None), s.name
    assert {a.dest for a in parser._actions} - {"help"} == {s.name for c in (TrainConfig, CommandLine)
                                                           for s in declared(c) if s.flag}
    cmd = parse_command_line(["--val-manifest", "v.jsonl::en", "--base-language", " en", "--base-language", "en",
                              "--no-tf32", "--amp", "--no-tokenizer-check", "--rewarm-steps", "5"])
    assert cmd.given == {"val_manifests": (absolute_manifest("v.jsonl::en"),), "base_languages": ("en",),
                         "tf32": False, "amp": "auto"}
    assert (cmd.tokenizer_check, cmd.rewarm, cmd.rewarm_steps) == (False, True, 5)


def test_older_runs_get_the_values_they_trained_with():
    completed = saved_settings({})
    assert {s.name: completed[s.name] for s in declared(TrainConfig) if s.name in completed} == {
        s.name: s.legacy for s in declared(TrainConfig) if s.name in completed}
    assert completed["dropout_masks"] == "v1" and completed["data_order"] == "random"
    assert set(TrainConfig().to_dict()) == {f.name for f in fields(TrainConfig)} - {
        "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "new_languages", "new_rows_lr_scale", "ema_decay",
        "ema_start"}


@dataclass(frozen=True)
class _ToolSettings:
    """A command without runs: every range is checked as the flags are parsed."""

    out: str = setting("out", "where to write", section="files", absolute=lambda p: "/abs/" + p)
    workers: int = setting(2, "processes", bound=count(1))
    share: float = setting(0.5, "a share", bound=finite(0.0, 1.0), section="")
    force: bool = setting(False, "overwrite")


def test_another_commands_dataclass_declares_its_flags_the_same_way(capsys):
    parser = SettingsParser("tool", "A tool of its own.", _ToolSettings)
    typed = vars(parser.parse_args(["--out", "x", "--workers", "3", "--force"]))
    assert _ToolSettings(**given_values(_ToolSettings, typed)) == _ToolSettings("/abs/x", 3, 0.5, True)
    assert "processes (>= 1) [2]" in parser.format_help() and "files:" in parser.format_help()
    for argv, error in ((["--workers", "0"], "--workers: must be a whole number from 1 to 2**31-1, got '0'"),
                        (["--share", "-1e-3"], "--share: must be a finite number >= 0 and <= 1, got '-1e-3'"),
                        (["--froce"], "unrecognized arguments: --froce; did you mean --force?")):
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args(argv)
        assert stopped.value.code == 2 and capsys.readouterr().err.endswith(f"{error}\n"), argv
