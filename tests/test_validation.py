"""Bad flags, model configs, base checkpoints and manifests stop before anything is written.

Every case runs the real entry point in this process and checks the house rule: exit status 2,
the flag, config key or file:line named in the message, no traceback, and the output directory
exactly as it was (absent stays absent, a user's files stay untouched).
"""
from __future__ import annotations

import contextlib
import io
import json
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.demo_runs import FAULT_VARS, REPO
from trainers.data.manifest import ManifestError, ManifestSpec, load_manifests
from trainers.data.manifest_lines import DataLimits

DEMO_YAML = REPO / "checkpoints" / "demo.yaml"


@pytest.fixture(autouse=True)
def _no_fault_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FAULT_VARS:
        monkeypatch.delenv(name, raising=False)


def run_main(out: Path, *args: str) -> tuple[int, str]:
    """main() as the script runs it: argparse's exit and an unexpected exception become a status."""
    from trainers.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(["--output-dir", str(out), *args])
        except SystemExit as exc:
            status = exc.code
        except Exception:  # the script would print this traceback and exit 1
            status = 1
            err.write(traceback.format_exc())
    return status, err.getvalue()


def snapshot(root: Path) -> dict[str, bytes] | None:
    if not root.exists():
        return None
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """An output directory that already holds a file of the user's."""
    out = tmp_path / "existing_run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    return out


def assert_refused(out: Path, args: list[str], *expected: str) -> str:
    before = snapshot(out)
    status, err = run_main(out, *args)
    assert "Traceback" not in err, err
    assert status == 2, err
    for text in expected:
        assert text in err, f"{text!r} not in:\n{err}"
    assert snapshot(out) == before, "the output directory was changed"
    return err


def flag_value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


# --- flags --------------------------------------------------------------------------------------

BIG = str(10**30)


@pytest.mark.parametrize("args, named, reason", [
    (["--save-interval", "0"], "--save-interval", "from 1 to"),
    (["--log-interval", "0"], "--log-interval", "from 1 to"),
    (["--seed", "-1"], "--seed", "got -1"),
    (["--seed", str(2**64)], "--seed", str(2**64)),
    (["--learning-rate", "nan"], "--learning-rate", "got nan"),
    (["--learning-rate", "inf"], "--learning-rate", "got inf"),
    (["--learning-rate", "1e39"], "--learning-rate", "<= 1"),
    (["--learning-rate", "-1e-3"], "--learning-rate", "got -0.001"),
    (["--learning-rate=-1e-3"], "--learning-rate", "got -0.001"),
    (["--learning-rate", "-inf"], "--learning-rate", "got -inf"),
    (["--weight-decay", "-0.1"], "--weight-decay", "got -0.1"),
    (["--weight-decay", "nan"], "--weight-decay", "got nan"),
    (["--grad-clip", "-1"], "--grad-clip", "got -1"),
    (["--grad-clip", "inf"], "--grad-clip", "got inf"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio", "got 1.5"),
    (["--min-lr-ratio", "-0.5"], "--min-lr-ratio", "got -0.5"),
    (["--text-loss-weight", "-0.2"], "--text-loss-weight", "got -0.2"),
    (["--mel-loss-weight", "inf"], "--mel-loss-weight", "got inf"),
    (["--text-loss-weight", "0", "--mel-loss-weight", "0"], "--mel-loss-weight", "--text-loss-weight"),
    (["--dropout", "-.5"], "--dropout", "got -0.5"),
    (["--warmup-steps", "1e30"], "--warmup-steps", "whole number"),
    (["--warmup-steps", BIG], "--warmup-steps", BIG),
    (["--epochs", "2.5"], "--epochs", "whole number"),
    (["--batch-size", "-1"], "--batch-size", "got -1"),
    # a percentage typed for the fraction: 10 meant as 10% would be a limit of 1000% that never fires
    (["--forgetting-limit", "10", "--base-language", "en"], "--forgetting-limit 10 is a 1000% rise",
     "for 10% pass 0.1"),
])
def test_bad_flag_value_is_refused_with_the_flag_and_range(tmp_path, demo_assets, args, named, reason):
    # --max-steps 1: should a check ever slip, the case costs a step, not a whole demo run.
    err = assert_refused(tmp_path / "run", [*demo_assets, "--max-steps", "1", *args], named, reason)
    assert "expected one argument" not in err


def test_negative_numbers_reach_the_range_check_in_every_spelling():
    from trainers.config.declare import join_negative_values
    from trainers.config.flags import build_parser, parse_command_line

    for argv in (["--learning-rate", "-1e-3"], ["--learning-rate=-1e-3"], ["--lr", "-1e-3"], ["--lr=-1e-3"]):
        assert parse_command_line(argv).given == {"learning_rate": -1e-3}, argv
    assert parse_command_line(["--seed", "-7"]).given == {"seed": -7}
    # Only numbers after numeric flags are joined; '--' ends the options.
    numeric = build_parser().numeric
    assert join_negative_values(["--device", "-1e-3", "--", "--seed", "-1e3"], numeric) == [
        "--device", "-1e-3", "--", "--seed", "-1e3"]
    assert join_negative_values(["--grad-clip", "-nan", "--seed", "--demo"], numeric) == [
        "--grad-clip=-nan", "--seed", "--demo"]


def test_lr_is_the_learning_rate_and_no_abbreviation_sets_another_flag(capsys):
    """Issue 19.8: `--lr 1000` set --lr-decay-steps (argparse's prefix matching) and `--lr 1e-3` failed on it."""
    from trainers.config.flags import parse_command_line

    assert parse_command_line(["--lr", "1e-3"]).given == {"learning_rate": 1e-3}
    assert parse_command_line(["--lr", "1000"]).given == {"learning_rate": 1000.0}  # then refused by its range
    for argv in (["--lr-decay", "5"], ["--learn", "1e-3"], ["--max-step", "5"], ["--learn", "-1e-3"],
                 ["--rewarm-l", "1e-3"], ["--reconfigure", "--resume", "auto"]):
        with pytest.raises(SystemExit) as stopped:
            parse_command_line(argv)
        assert stopped.value.code == 2, argv
        assert f"unrecognized arguments: {argv[0]}" in capsys.readouterr().err, argv


def test_lr_out_of_range_is_refused_by_the_range_check(tmp_path, demo_assets):
    err = assert_refused(tmp_path / "run", [*demo_assets, "--max-steps", "1", "--lr", "-1e-3"], "--learning-rate",
                         "> 0 and <= 1, got -0.001")
    assert "expected one argument" not in err


def test_a_share_on_a_validation_manifest_is_refused_naming_the_flag(tmp_path, demo_assets):
    """A share draws part of every training step: on --val-manifest it means nothing (IndexTTS2 took 'base@0.5' for
    the language's name, in the logs and metrics)."""
    val = flag_value(demo_assets, "--val-manifest")
    flags = [f"{val}::base@0.5" if flag == val else flag for flag in demo_assets]
    assert_refused(tmp_path / "run", [*flags, "--max-steps", "1"], f"--val-manifest {val}::base@0.5: a share (@0.5)")


def test_every_flag_of_the_readme_table_is_a_whole_flag_name():
    """The flag table of docs/flags.md (the community trainer's flags and ours) against the parser, which
    no longer completes abbreviations: a flag missing from the parser would now be refused."""
    import re

    from trainers.config.flags import build_parser

    known = {s for action in build_parser()._actions for s in action.option_strings}
    text = (REPO / "docs" / "flags.md").read_text()
    table = text[text.index("## Flags"):text.index("## Bad settings and inputs")]
    flags = {f for line in table.splitlines() if line.startswith("| `--")
             for f in re.findall(r"--[a-z0-9-]+", line.split(" | ")[0])}
    assert len(flags) > 40 and "--lr" in flags
    assert flags <= known, sorted(flags - known)


def test_out_of_range_values_saved_with_a_run_are_refused_by_name(tmp_path):
    from trainers.config.flags import CommandLine
    from trainers.errors import UserError
    from trainers.run.resolve import merge_settings
    from trainers.run.run_dir import SavedRun

    saved = SavedRun({"learning_rate": float("nan"), "adam_beta2": 1.5, "seed": "1234", "demo": True}, "cpu")
    with pytest.raises(UserError) as info:
        merge_settings(CommandLine(given={}, resume="auto"), saved, tmp_path / "run", "cpu")
    message = str(info.value)
    assert "--learning-rate must be a finite number > 0 and <= 1, got nan" in message
    assert "adam_beta2" in message and "--seed" in message and "got '1234'" in message


def test_settings_whose_mistake_would_run_away_are_refused_without_a_run(tmp_path):
    """Checked without running the trainer: should the check slip, these would fork thousands of
    workers or train for ever."""
    from trainers.config.flags import CommandLine
    from trainers.config.settings import TrainConfig
    from trainers.errors import UserError
    from trainers.run.resolve import check_horizon, merge_settings

    with pytest.raises(UserError, match="--num-workers must be a whole number from 0 to 256, got 100000"):
        merge_settings(CommandLine(given={"num_workers": 100000, "demo": True}, resume=None), None, tmp_path, "cpu")
    # 2**31-1 epochs of 24 steps: a learning-rate horizon that no resume would accept.
    endless = TrainConfig(epochs=2**31 - 1, lr_decay_steps=(2**31 - 1) * 24)
    with pytest.raises(UserError, match="--epochs 2147483647 over 384 samples .* lower --epochs or pass --max-steps"):
        check_horizon(endless, 384)


# --- the model config's gpt section ---------------------------------------------------------------

@pytest.mark.parametrize("changes, key", [
    ({"heads": 0}, "gpt.heads"),
    ({"heads": 3}, "gpt.heads"),  # 64 is not divisible by 3
    ({"heads": True}, "gpt.heads"),
    ({"max_text_tokens": 0}, "gpt.max_text_tokens"),
    ({"max_mel_tokens": -5}, "gpt.max_mel_tokens"),
    ({"model_dim": 64.0}, "gpt.model_dim"),
    ({"model_dim": "abc"}, "gpt.model_dim"),
    ({"layers": -2}, "gpt.layers"),
    ({"number_mel_codes": 2}, "gpt.number_mel_codes"),
    ({"start_mel_token": 130}, "gpt.start_mel_token"),  # outside the 130 codes
    ({"start_mel_token": 5}, "gpt.start_mel_token"),  # a semantic code, not the first special id
    ({"stop_mel_token": 128}, "gpt.stop_mel_token"),  # same as start
    ({"stop_text_token": 0}, "gpt.stop_text_token"),  # same as start
    ({"start_text_token": 500}, "gpt.start_text_token"),  # outside the text vocabulary
    ({"stop_text_token": -1}, "gpt.stop_text_token"),
    ({"layers": None}, "gpt.layers"),  # missing
    ({"layrs": 6}, "gpt.layrs is not a setting; did you mean gpt.layers?"),  # a typo next to the real key
    ({"max_text_token": 400}, "gpt.max_text_token is not a setting; did you mean gpt.max_text_tokens?"),
])
def test_bad_model_config_names_the_config_and_key(tmp_path, user_dir, demo_assets, changes, key):
    config = yaml.safe_load(DEMO_YAML.read_text())
    for name, value in changes.items():
        if value is None:
            del config["gpt"][name]
        else:
            config["gpt"][name] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    err = assert_refused(user_dir, [*demo_assets, "--config", str(path)], f"--config {path}: {key}")
    assert "not all arguments converted" not in err and "does not fit" not in err


def test_bad_model_config_with_demo_generates_nothing(tmp_path):
    """--demo writes its corpus under OUTPUT_DIR: a bad config must stop it before that."""
    config = yaml.safe_load(DEMO_YAML.read_text())
    config["gpt"]["heads"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    assert_refused(tmp_path / "run", ["--demo", "--config", str(path)], f"--config {path}: gpt.heads")


# --- the base checkpoint ---------------------------------------------------------------------------

@pytest.mark.parametrize("key, dtype", [
    ("text_embedding.weight", torch.int64),
    ("mel_embedding.weight", torch.int32),
    ("mel_head.weight", torch.int64),
    ("gpt.h.0.attn.c_attn.weight", torch.int16),
    ("text_head.bias", torch.bool),
])
def test_base_checkpoint_with_integer_weights_is_refused(tmp_path, user_dir, demo_assets, key, dtype):
    base = Path(flag_value(demo_assets, "--base-checkpoint"))
    ckpt = torch.load(base, map_location="cpu", weights_only=True)
    ckpt["model"][key] = ckpt["model"][key].to(dtype)
    bad = tmp_path / "int_gpt.pth"
    torch.save(ckpt, bad)
    args = [*demo_assets, "--base-checkpoint", str(bad)]
    assert_refused(user_dir, args, f"--base-checkpoint {bad}", key, str(dtype).replace("torch.", ""))


# --- manifests --------------------------------------------------------------------------------------

def _demo_lines(demo_assets: list[str], count: int) -> list[dict]:
    """The first lines of the demo manifest with absolute feature paths, to copy anywhere."""
    manifest = Path(flag_value(demo_assets, "--train-manifest"))
    lines = [json.loads(line) for line in manifest.read_text().splitlines()[:count]]
    for line in lines:
        for k, v in line.items():
            if k.endswith("_path"):
                line[k] = str(manifest.parent / v)
    return lines


def _manifest_args(demo_assets: list[str], manifest: Path) -> list[str]:
    return ["--train-manifest", str(manifest), "--tokenizer", flag_value(demo_assets, "--tokenizer"),
            "--config", str(DEMO_YAML)]


def test_manifest_that_is_not_utf8_names_the_line(tmp_path, user_dir, demo_assets):
    lines = _demo_lines(demo_assets, 3)
    lines[1]["target_text"] = "caf\N{LATIN SMALL LETTER E WITH ACUTE}"
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    manifest = tmp_path / "data" / "latin1.jsonl"
    manifest.parent.mkdir()
    manifest.write_bytes(text.encode("latin-1"))
    err = assert_refused(user_dir, _manifest_args(demo_assets, manifest), f"{manifest}:2:", "UTF-8")
    assert f"{manifest}:1:" not in err and f"{manifest}:3:" not in err and "offset" not in err


@pytest.mark.parametrize("where, expected", [
    ("../elsewhere", "is a directory"),  # escapes the manifest folder, names a folder
    ("../missing.npy", "not found"),
    ("/dev/null", "not a regular file"),  # absolute, a device
    ("sub", "is a directory"),
])
def test_feature_path_that_is_not_a_regular_file(tmp_path, user_dir, demo_assets, where, expected):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    lines = _demo_lines(demo_assets, 2)
    lines[1]["target_codes_path"] = where
    manifest = data / "train.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert_refused(user_dir, _manifest_args(demo_assets, manifest), f"{manifest}:2:", "target_codes_path", expected)


def test_feature_paths_outside_the_manifest_folder_are_accepted_when_regular_files(tmp_path):
    outside = tmp_path / "shared"
    outside.mkdir()
    for name, array in {"t": np.arange(3), "c": np.arange(5), "cond": np.zeros((4, 8)), "e": np.zeros(8)}.items():
        np.save(outside / f"{name}.npy", array)
    manifest = tmp_path / "data" / "train.jsonl"
    manifest.parent.mkdir()
    line = {"id": "u1", "text_ids_path": "../shared/t.npy", "text_len": 3, "codes_path": str(outside / "c.npy"),
            "code_len": 5, "condition_path": "../shared/cond.npy", "emo_vec_path": "../shared/e.npy"}
    manifest.write_text(json.dumps(line) + "\n")
    limits = DataLimits(max_text_tokens=50, max_mel_tokens=50)
    [sample] = load_manifests([ManifestSpec(manifest, None)], limits)
    assert sample.text_ids_path == str(outside / "t.npy") and sample.codes_path == str(outside / "c.npy")
    line["codes_path"] = str(outside)
    manifest.write_text(json.dumps(line) + "\n")
    with pytest.raises(ManifestError, match=rf"{manifest}:1: codes_path .*is a directory"):
        load_manifests([ManifestSpec(manifest, None)], limits)


def test_an_unknown_gpt_key_unlike_any_setting_is_kept_with_a_warning(tmp_path, demo_assets, caplog):
    """Upstream's own keys (the conditioning encoders') are read silently; a key nobody reads is named."""
    from trainers.run.inputs import read_model_yaml

    config = yaml.safe_load(DEMO_YAML.read_text())
    config["gpt"]["condition_type"] = "conformer_perceiver"
    config["gpt"]["my_note"] = "v2 voice"
    path = tmp_path / "extra.yaml"
    path.write_text(yaml.safe_dump(config))
    with caplog.at_level("WARNING", logger="train"):
        assert read_model_yaml(str(path))["gpt"]["my_note"] == "v2 voice"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and "gpt.my_note: neither the trainer nor IndexTTS2 inference reads it" in warned[0], warned
    assert "Remove it if it is a typo" in warned[1]


# --- features of another model size -------------------------------------------------------------


def _wide_features(tmp_path: Path, demo_assets: list[str], width: int) -> Path:
    """The first demo lines with conditioning features `width` wide, as the official extractor writes them."""
    lines = _demo_lines(demo_assets, 6)
    for i, line in enumerate(lines):
        line["prompt_condition_path"] = str(tmp_path / f"cond{i}.npy")
        line["prompt_emo_vec_path"] = str(tmp_path / f"emo{i}.npy")
        np.save(line["prompt_condition_path"], np.zeros((1, 32, width), dtype=np.float32))  # with a batch axis
        np.save(line["prompt_emo_vec_path"], np.zeros(width, dtype=np.float32))
    manifest = tmp_path / "wide.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


@pytest.mark.parametrize("case", ["smaller config", "official features"])
def test_features_of_another_model_size_are_refused_before_the_model_is_built(tmp_path, demo_assets, monkeypatch,
                                                                              case):
    from trainers.model.gpt_model import UnifiedVoiceGPT

    if case == "smaller config":  # the demo's 64-wide features, a config of width 32
        manifest = Path(flag_value(demo_assets, "--train-manifest"))
        config = yaml.safe_load(DEMO_YAML.read_text())
        config["gpt"]["model_dim"] = 32
        path = tmp_path / "small.yaml"
        path.write_text(yaml.safe_dump(config))
        expected = ["gpt.model_dim is 32", "64 wide", "width 64 is gpt.model_dim of checkpoints/demo.yaml",
                    "pass --config checkpoints/demo.yaml"]
    else:  # features of the official model (1280 wide) with the demo config
        manifest, path = _wide_features(tmp_path, demo_assets, 1280), DEMO_YAML
        expected = ["gpt.model_dim is 64", "1280 wide", "width 1280 is gpt.model_dim of checkpoints/config.yaml "
                    "(the official IndexTTS2 model)", "pass --config checkpoints/config.yaml"]
    built = []
    real_init = UnifiedVoiceGPT.__init__
    monkeypatch.setattr(UnifiedVoiceGPT, "__init__", lambda self, *a, **k: built.append(1) or real_init(self, *a, **k))
    out = tmp_path / "run"  # a fresh start: run_config.json, logs/ and the data cache stay absent with the directory
    args = ["--train-manifest", str(manifest), "--tokenizer", flag_value(demo_assets, "--tokenizer"),
            "--config", str(path), "--max-steps", "1"]
    err = assert_refused(out, args, f"--config {path}:", "the features were extracted for another model size",
                         f"{manifest}:1:", *expected)
    assert not out.exists() and built == []
    assert "fix or drop that sample" not in err
