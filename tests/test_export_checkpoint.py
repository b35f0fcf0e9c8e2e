"""tools/export_checkpoint.py: a demo run exported for IndexTTS2 inference, and every refusal."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.demo_runs import REPO, full_config, train_here
from tests.test_checkpoint_integrity import copy_run, flip_model_byte
from trainers.checkpoint import schema
from trainers.config.inference_keys import missing_inference_keys
from trainers.errors import UserError
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.weights import CARRIED_PREFIXES, read_state_dict
from trainers.run.inputs import read_model_yaml
from trainers.tools import export_checkpoint as ex
from trainers.tools.export_checkpoint import main
from trainers.tools.export_contents import expected_group_a

OFFICIAL = dict(model_dim=1280, layers=24, heads=20, max_text_tokens=600, max_mel_tokens=1815,
                number_text_tokens=12000, number_mel_codes=8194)


def reference_group_a(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The training-path keys and shapes of the reference table (shared/reference/indextts2-gpt.md)."""
    D, Nt, Nm = cfg.model_dim, cfg.number_text_tokens, cfg.number_mel_codes
    table = {
        "text_embedding.weight": (Nt + 1, D),
        "mel_embedding.weight": (Nm, D),
        "text_pos_embedding.emb.weight": (cfg.max_text_tokens + 2, D),
        "mel_pos_embedding.emb.weight": (cfg.max_mel_tokens + 3, D),
        "speed_emb.weight": (2, D),
    }
    for i in range(cfg.layers):
        h = f"gpt.h.{i}."
        table.update({
            h + "ln_1.weight": (D,), h + "ln_1.bias": (D,),
            h + "attn.c_attn.weight": (D, 3 * D), h + "attn.c_attn.bias": (3 * D,),
            h + "attn.c_proj.weight": (D, D), h + "attn.c_proj.bias": (D,),
            h + "ln_2.weight": (D,), h + "ln_2.bias": (D,),
            h + "mlp.c_fc.weight": (D, 4 * D), h + "mlp.c_fc.bias": (4 * D,),
            h + "mlp.c_proj.weight": (4 * D, D), h + "mlp.c_proj.bias": (D,),
        })
    table.update({
        "gpt.ln_f.weight": (D,), "gpt.ln_f.bias": (D,),
        "final_norm.weight": (D,), "final_norm.bias": (D,),
        "text_head.weight": (Nt + 1, D), "text_head.bias": (Nt + 1,),
        "mel_head.weight": (Nm, D), "mel_head.bias": (Nm,),
    })
    return table


def carried_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith(CARRIED_PREFIXES)}


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's gpt section in a full IndexTTS2 config (every key inference reads), as users pass the official one."""
    return full_config(tmp_path_factory.mktemp("config") / "config.yaml")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, demo_assets: list[str], full: Path) -> Path:
    """A real demo run trained with the full config: checkpoints at steps 4 and 6 (latest), its config.yaml and
    tokenizer."""
    out = tmp_path_factory.mktemp("export") / "run"
    done = train_here(out, *demo_assets, "--config", str(full), "--max-steps", "6", "--val-interval", "2",
                      "--save-interval", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def base(demo_assets: list[str]) -> Path:
    return Path(demo_assets[demo_assets.index("--base-checkpoint") + 1])


@pytest.fixture(scope="module")
def tokenizer(demo_assets: list[str]) -> Path:
    return Path(demo_assets[demo_assets.index("--tokenizer") + 1])


@pytest.fixture(scope="module")
def exported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The run's latest checkpoint exported as fp32, fp16 and bf16."""
    root = tmp_path_factory.mktemp("exports")
    outs = {}
    for dtype in ("fp32", "fp16", "bf16"):
        outs[dtype] = root / dtype
        assert main([str(run), "--out", str(outs[dtype]), "--dtype", dtype]) == 0
    return outs


def load_export(out: Path) -> dict[str, torch.Tensor]:
    obj = torch.load(out / "gpt.pth", map_location="cpu", weights_only=True)
    assert list(obj) == ["model"], "gpt.pth must hold only the state dict (no optimizer, no run state)"
    return obj["model"]


def refused(capsys: pytest.CaptureFixture, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


# ---------------------------------------------------------------- the exported files

def test_gpt_pth_has_exactly_the_upstream_keys(run: Path, base: Path, exported: dict[str, Path]):
    state = load_export(exported["fp32"])
    config = yaml.safe_load((exported["fp32"] / "config.yaml").read_text())
    gpt = GPTConfig.from_yaml_section(config["gpt"])
    table = reference_group_a(gpt)
    base_state = read_state_dict(base)
    base_carried = carried_of(base_state)
    assert base_carried, "the demo base must have group-B tensors for this test to mean anything"
    # Every key of the reference table with its shape, every carried key, nothing else.
    assert set(state) == set(table) | set(base_carried)
    for key, shape in table.items():
        assert tuple(state[key].shape) == shape, key
    # Group B bit for bit as in the base checkpoint.
    for key, value in base_carried.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    # Group A loads strictly into the model the exported config describes, and is the run's weights.
    model = UnifiedVoiceGPT(gpt)
    model.load_state_dict({k: state[k] for k in table}, strict=True)
    latest = schema.read(run / "latest.pth")
    for key in table:
        assert torch.equal(state[key], latest.model[key]), key
    assert all(t.dtype == torch.float32 for t in state.values())


def test_reference_table_is_what_the_tool_exports_for_the_official_config():
    """At the official size (on the meta device): the tool's group-A keys are the reference table's."""
    cfg = GPTConfig(**OFFICIAL)
    assert expected_group_a(cfg) == reference_group_a(cfg)
    assert len(reference_group_a(cfg)) == 5 + 12 * 24 + 8


def test_config_keeps_every_section_and_names_the_copied_tokenizer(run: Path, tokenizer: Path,
                                                                    exported: dict[str, Path]):
    out = exported["fp32"]
    trained_with = yaml.safe_load((run / "config.yaml").read_text())
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert list(config) == list(trained_with)
    assert config["gpt"]["number_text_tokens"] == schema.read(run / "latest.pth").text_tokens == 160
    assert config["dataset"]["bpe_model"] == tokenizer.name
    assert config["gpt_checkpoint"] == "gpt.pth"
    # Every other key exactly as the run was trained with.
    for section, values in trained_with.items():
        if isinstance(values, dict):
            for key, value in values.items():
                if (section, key) not in {("gpt", "number_text_tokens"), ("dataset", "bpe_model")}:
                    assert config[section][key] == value, (section, key)
        elif section != "gpt_checkpoint":
            assert config[section] == values, section
    assert (out / tokenizer.name).read_bytes() == tokenizer.read_bytes()
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == 6 and record["dtype"] == "fp32"
    assert set(record["files"]) == {"gpt.pth", "config.yaml", tokenizer.name}


def flat(data: dict, prefix: str = "") -> dict[str, object]:
    """Every leaf of a YAML mapping by its dotted path."""
    out: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


TRIMMED_LACKS = ["w2v_stat", "s2mel_checkpoint", "s2mel", "emo_matrix", "spk_matrix", "qwen_emo_path",
                 "semantic_codec", "emo_num", "vocoder.name"]


@pytest.fixture(scope="module")
def trimmed_run(tmp_path_factory: pytest.TempPathFactory, demo_assets: list[str]) -> Path:
    """A real run (not --demo) of the demo corpus, trained with checkpoints/demo.yaml: a trimmed config, holding
    only what the trainer reads."""
    out = tmp_path_factory.mktemp("trimmed") / "run"
    assert demo_assets[0] == "--demo"
    done = train_here(out, *demo_assets[1:], "--config", str(REPO / "checkpoints" / "demo.yaml"),
                      "--effective-batch", "8", "--max-steps", "1", "--val-interval", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    # The trainer says at the start what the export will ask for.
    assert (f"INFO {out / 'config.yaml'} lacks keys IndexTTS2 inference reads (a trimmed --config: enough to "
            "train):\n") in done.stderr
    listed = re.findall(r"^\S+ \S+ INFO   (\S.*)$", done.stderr, re.M)  # the keys, wrapped on lines of their own
    assert " ".join(listed) == ", ".join(TRIMMED_LACKS), done.stderr
    assert "to export: indextts-export --config with the full config.yaml" in done.stderr
    return out


def test_a_trimmed_config_is_refused_naming_the_missing_keys_and_the_flag(trimmed_run: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture):
    trimmed, demo = trimmed_run, REPO / "checkpoints" / "demo.yaml"
    out = tmp_path / "out"
    err = refused(capsys, [str(trimmed), "--out", str(out)], f"{trimmed / 'config.yaml'} (the trainer's copy of "
                  f"--config {demo})", "lacks keys that IndexTTS2 inference reads: " + ", ".join(TRIMMED_LACKS) + ".",
                  "Pass --config with the full config.yaml from your IndexTTS2 checkpoints folder",
                  "nothing was written")
    assert err.count("\n") == 1, err  # one line
    refused(capsys, [str(trimmed), "--config", str(demo), "--out", str(out)], f"--config {demo} lacks keys")
    assert not out.exists()
    # The repository's trimmed config says what it is, first thing in the file.
    assert (REPO / "checkpoints" / "config.yaml").read_text().startswith("# TRIMMED IndexTTS2 config")


def test_the_full_config_is_kept_but_for_the_three_values_the_export_sets(trimmed_run: Path, tmp_path: Path,
                                                                          tokenizer: Path, full: Path):
    """--config with the full config (for a run trained with a trimmed one): every key kept with its value, only
    gpt.number_text_tokens, dataset.bpe_model and gpt_checkpoint set for this export."""
    trimmed = trimmed_run
    official = yaml.safe_load(full.read_text())
    official["gpt"]["number_text_tokens"] = 12000  # as the official file has them
    official["dataset"]["bpe_model"] = "official_bpe.model"
    official["gpt_checkpoint"] = "official_gpt.pth"
    given = tmp_path / "official.yaml"
    given.write_text(yaml.safe_dump(official, sort_keys=False))
    out = tmp_path / "out"
    assert main([str(trimmed), "--config", str(given), "--out", str(out)]) == 0
    before, after = flat(official), flat(yaml.safe_load((out / "config.yaml").read_text()))
    assert list(after) == list(before)
    changed = {k: after[k] for k in before if after[k] != before[k]}
    assert changed == {"gpt.number_text_tokens": 160, "dataset.bpe_model": tokenizer.name,
                       "gpt_checkpoint": "gpt.pth"}
    assert all(type(after[k]) is type(before[k]) for k in before)  # 2.0 stays a float, "None" a string
    assert missing_inference_keys(yaml.safe_load((out / "config.yaml").read_text())) == []


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_export_is_the_rounded_fp32_export(exported: dict[str, Path], dtype: str):
    full, half = load_export(exported["fp32"]), load_export(exported[dtype])
    target = ex.DTYPES[dtype]
    tolerance = {"fp16": 1e-3, "bf16": 8e-3}[dtype]  # 2**-11 and 2**-8 relative rounding, with margin
    assert set(half) == set(full)
    for key, value in full.items():
        assert half[key].dtype == target, key
        assert torch.equal(half[key], value.to(target)), key  # round to nearest, exactly
        torch.testing.assert_close(half[key].float(), value, rtol=tolerance, atol=tolerance, msg=key)


def test_prints_the_three_files_for_inference(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                              tokenizer: Path):
    out = tmp_path / "out"
    assert main([str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("config.yaml", "gpt.pth", tokenizer.name):
        assert str(out / name) in printed
    assert "step 6" in printed
    # The other models' files, by the names config.yaml gives them, and how to call inference.
    assert (f"copy or link s2mel.pth, wav2vec2bert_stats.pt, feat2.pt, feat1.pt, qwen0.6bemo4-merge/ from your "
            f"IndexTTS2 checkpoints folder into {out}, then use IndexTTS2(cfg_path=\"{out / 'config.yaml'}\", "
            f"model_dir=\"{out}\")") in printed


def test_official_gpt_pth_is_exported_as_is(base: Path, tokenizer: Path, full: Path, tmp_path: Path):
    """A raw DDP-style state dict with an integer buffer: prefix stripped, dropped keys left out,
    the integer buffer kept as it is under --dtype fp16."""
    state = read_state_dict(base)
    buffer = "conditioning_encoder.encoders.0.conv_module.norm.num_batches_tracked"
    state[buffer] = torch.tensor(1234, dtype=torch.int64)
    raw = tmp_path / "raw.pth"
    torch.save({f"module.{k}": v for k, v in state.items()}, raw)
    config = full
    out = tmp_path / "out"
    assert main([str(raw), "--config", str(config), "--tokenizer", str(tokenizer), "--out", str(out),
                 "--dtype", "fp16"]) == 0
    exported = load_export(out)
    assert "inference_model.lm_head.weight" not in exported and "gpt.wte.weight" not in exported
    assert exported[buffer].dtype == torch.int64 and int(exported[buffer]) == 1234
    for key, value in exported.items():
        if key != buffer:
            assert value.dtype == torch.float16 and torch.equal(value, state[key].half()), key


# ---------------------------------------------------------------- which checkpoint

def test_which_step_and_best(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    step4 = schema.read(run / "model_step4.pth")
    assert main([str(run), "--which", "4", "--out", str(tmp_path / "s4")]) == 0
    assert json.loads((tmp_path / "s4" / "export.json").read_text())["step"] == 4
    assert all(torch.equal(v, step4.model[k]) for k, v in load_export(tmp_path / "s4").items())
    no_best = tmp_path / "no_best"  # a run that never validated has no best.pth
    shutil.copytree(run, no_best)
    (no_best / "best.pth").unlink()
    refused(capsys, [str(no_best), "--which", "best", "--out", str(tmp_path / "b")], "best.pth", "--which latest")
    assert not (tmp_path / "b").exists()
    assert main([str(run), "--which", "best", "--out", str(tmp_path / "b")]) == 0  # the trainer wrote it
    assert json.loads((tmp_path / "b" / "export.json").read_text())["step"] == schema.read(run / "best.pth").step
    # A checkpoint file works directly (its run directory supplies config.yaml).
    assert main([str(run / "model_step4.pth"), "--out", str(tmp_path / "f")]) == 0


def test_a_damaged_checkpoint_is_refused_and_a_run_directory_exports_its_newest_intact_one(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """The export verifies the checksums: a damaged file named is refused (exit 2, the file and the tensor); a run
    directory exports the checkpoint --resume auto would continue, past a damaged latest.pth, and says so."""
    damaged = copy_run(run, tmp_path / "damaged")
    key = flip_model_byte(damaged / "model_step6.pth")  # latest.pth is the same file
    refused(capsys, [str(damaged / "model_step6.pth"), "--out", str(tmp_path / "a")],
            str(damaged / "model_step6.pth"), f"tensor model/{key} differs from what was written", "--which STEP")
    assert not (tmp_path / "a").exists()
    before = {p.name: p.read_bytes() for p in damaged.iterdir() if p.is_file()}
    assert main([str(damaged), "--out", str(tmp_path / "b")]) == 0
    said = capsys.readouterr().out
    assert "note: latest.pth (= model_step6.pth) is damaged (corrupt: " in said, said
    assert "exported model_step4.pth, the newest intact checkpoint, which --resume auto would continue" in said
    assert json.loads((tmp_path / "b" / "export.json").read_text())["step"] == 4
    step4 = schema.read(run / "model_step4.pth")
    assert all(torch.equal(v, step4.model[k]) for k, v in load_export(tmp_path / "b").items())
    assert {p.name: p.read_bytes() for p in damaged.iterdir() if p.is_file()} == before  # nothing renamed or changed


# ---------------------------------------------------------------- refusals

def crafted_run(run: Path, where: Path, section: str, **values) -> Path:
    """A copy of the run's latest checkpoint with fields of one section replaced, beside its config.yaml."""
    where.mkdir()
    shutil.copy(run / "config.yaml", where / "config.yaml")
    ckpt = schema.read(run / "latest.pth")
    if section == "model":
        changed = schema.parse(schema.assemble({**ckpt.sections, "model": values["model"]}), where)
    else:
        changed = ckpt.edited(section, **values)
    torch.save(changed.to_file(), where / "latest.pth")
    return where


def test_refusals_leave_nothing_written(run: Path, tmp_path: Path, tokenizer: Path,
                                        capsys: pytest.CaptureFixture):
    out = str(tmp_path / "out")
    junk = tmp_path / "junk.pth"
    torch.save({"weights": torch.zeros(3)}, junk)
    settings = schema.read(run / "latest.pth").settings
    moved = crafted_run(run, tmp_path / "moved", "run",
                        config={**settings, "tokenizer": str(tmp_path / "gone" / "bpe.model")})
    no_b = crafted_run(run, tmp_path / "no_b", "model",
                       model={k: v for k, v in schema.read(run / "latest.pth").model.items()
                              if not k.startswith(CARRIED_PREFIXES)})
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(run / "latest.pth", lone / "x.pth")
    other_tok = tmp_path / "other.model"
    other_tok.write_bytes(tokenizer.read_bytes() + b"\0")
    cases = [
        ([str(tokenizer), "--out", out], ["cannot be read"]),
        ([str(junk), "--out", out], ["neither a checkpoint of this trainer nor an IndexTTS2 gpt.pth"]),
        ([str(tmp_path / "nowhere"), "--out", out], ["no such run directory"]),
        ([str(tmp_path), "--out", out], ["holds no checkpoint"]),
        ([str(run), "--which", "last", "--out", out], ["--which 'last'"]),
        ([str(run), "--which", "5", "--out", out], ["no model_step5.pth", "steps kept: 4, 6"]),
        ([str(run / "latest.pth"), "--which", "4", "--out", out], ["applies to a run directory"]),
        ([str(moved), "--out", out], [str(tmp_path / "gone" / "bpe.model"), "is missing", "--tokenizer"]),
        ([str(run), "--tokenizer", str(other_tok), "--out", out], ["not the tokenizer the run was trained with"]),
        ([str(lone / "x.pth"), "--out", out], ["no config.yaml beside", "--config"]),
        ([str(run), "--config", str(REPO / "checkpoints" / "config.yaml"), "--out", out],
         ["is not the config", "model_dim 1280 (run: 64)"]),
        ([str(no_b), "--out", out], ["lacks the conditioning-encoder tensors", "emovec_layer.*"]),
        ([str(read_base_path(run)), "--out", out], ["records no config", "--config"]),
        ([str(run), "--out", str(run)], ["already holds config.yaml", "did not write"]),
        ([str(run), "--out", str(run / "latest.pth")], ["is a file"]),
    ]
    before = sorted(os.listdir(run))
    for argv, words in cases:
        refused(capsys, argv, *words)
        assert not (tmp_path / "out").exists(), argv
    assert sorted(os.listdir(run)) == before


def test_the_export_and_the_trainer_refuse_a_broken_config_yaml_alike(run: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture):
    """One reader of config.yaml (trainers/config/config_yaml.py): a missing, unparsable, binary or
    foreign file given to the export's --config or the trainer's --config is refused for the same
    reason, in the same words, before the advice each command adds."""
    broken = {"missing": None, "unparsable": "gpt: [1, 2\n", "binary": b"\x80\x81gpt", "foreign": "dataset: {}\n"}
    for name, content in broken.items():
        path = tmp_path / f"{name}.yaml"
        if isinstance(content, str):
            path.write_text(content)
        elif content is not None:
            path.write_bytes(content)
        with pytest.raises(UserError) as trainer:
            read_model_yaml(str(path))
        reason = str(trainer.value).split("; pass ")[0]
        assert reason.startswith(f"--config {path}: ") and len(reason) > len(f"--config {path}: "), name
        refused(capsys, [str(run), "--config", str(path), "--out", str(tmp_path / "out")], reason + "; pass --config")
        assert not (tmp_path / "out").exists()


def read_base_path(run: Path) -> Path:
    return Path(schema.read(run / "latest.pth", mmap=True).settings["base_checkpoint"])


# ---------------------------------------------------------------- the output directory rule

def test_output_directory_rule(run: Path, tmp_path: Path, tokenizer: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main([str(run), "--out", str(out)]) == 0
    # Exporting again replaces what the export wrote (here: another checkpoint, another dtype).
    assert main([str(run), "--which", "4", "--dtype", "fp16", "--out", str(out)]) == 0
    assert load_export(out)["mel_head.bias"].dtype == torch.float16
    # Another tokenizer file name: the earlier export's copy is removed, never anything else.
    renamed = tmp_path / "bpe_copy.model"
    shutil.copy(tokenizer, renamed)
    assert main([str(run), "--tokenizer", str(renamed), "--out", str(out)]) == 0
    assert not (out / tokenizer.name).exists() and (out / renamed.name).is_file()
    assert yaml.safe_load((out / "config.yaml").read_text())["dataset"]["bpe_model"] == renamed.name
    assert (out / "notes.txt").read_text() == "mine"
    # A file changed after the export is no longer the tool's to replace.
    (out / "config.yaml").write_text((out / "config.yaml").read_text() + "# edited\n")
    refused(capsys, [str(run), "--out", str(out)], "config.yaml", "did not write")
    assert (out / "config.yaml").read_text().endswith("# edited\n")
    # A file of an export's name, without a record, is someone else's.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "gpt.pth").write_bytes(b"official weights")
    refused(capsys, [str(run), "--out", str(foreign)], "gpt.pth")
    assert (foreign / "gpt.pth").read_bytes() == b"official weights" and sorted(os.listdir(foreign)) == ["gpt.pth"]


def test_killed_export_leaves_no_half_file(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    out = tmp_path / "out"
    real_save = torch.save
    at_death: list[str] = []

    def killed_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half")  # some bytes reach the disk, then the process dies:
        f.flush()
        at_death.extend(p.name for p in out.iterdir())  # what a SIGKILL here would leave
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_save)
    with pytest.raises(KeyboardInterrupt):
        ex.export(run, out)
    assert at_death and all(name.startswith(".gpt.pth.tmp-") for name in at_death), at_death
    assert [p.name for p in out.iterdir()] == []
    # A SIGKILL leaves its temporary behind: the next export removes it.
    monkeypatch.setattr(torch, "save", real_save)
    (out / ".gpt.pth.tmp-999999").write_bytes(b"half")
    assert main([str(run), "--out", str(out)]) == 0
    assert not (out / ".gpt.pth.tmp-999999").exists()

    # Killed between renames: the new gpt.pth is in place, config.yaml is still the old one.
    real_replace = os.replace

    def killed_replace(src, dst):
        if Path(dst).name == "config.yaml":
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_replace)
    with pytest.raises(KeyboardInterrupt):
        ex.export(run, out, which="4")
    monkeypatch.setattr(os, "replace", real_replace)
    torch.load(out / "gpt.pth", weights_only=True)  # whole
    assert main([str(run), "--out", str(out)]) == 0  # and the directory is still the tool's to replace
    assert json.loads((out / "export.json").read_text())["step"] == 6
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
