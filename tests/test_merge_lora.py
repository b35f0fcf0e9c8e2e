"""tools/merge_lora.py: an adapter file folded into its base loads strictly into the plain model (an
extended vocabulary included) and computes what the adapted model computes; another base, an existing
--out, a checkpoint passed as the adapter and a pickled payload are refused with exit 2 and nothing written."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_GPT
from tests.test_gpt_model import make_batch, randomized_model
from trainers.files import file_sha256
from trainers.model.gpt_model import GPTConfig, UnifiedVoiceGPT
from trainers.model.lora import LoraSettings, add_adapters, adapter_state_dict
from trainers.checkpoint import adapter_file
from trainers.model.lora_file import AdapterFile
from trainers.tools.merge_lora import main

SETTINGS = LoraSettings(rank=4, alpha=8.0)
NEW_TOKENS = 3
EXTENDED = GPTConfig(**{**TINY_GPT.to_dict(), "number_text_tokens": TINY_GPT.number_text_tokens + NEW_TOKENS})
TEXT_ROWS = ("text_embedding.weight", "text_head.weight", "text_head.bias")


def trained_run(tmp_path, wrapped: bool = True):
    """A base file (the official vocabulary), and a LoRA model trained on it with an extended vocabulary:
    its adapters are non-zero and its text rows are longer than the base's."""
    model = randomized_model(EXTENDED)
    base_state = {k: (v[: TINY_GPT.number_text_tokens + 1] if k in TEXT_ROWS else v).clone()
                  for k, v in model.state_dict().items()}
    base = tmp_path / "gpt.pth"
    torch.save({"model": base_state} if wrapped else base_state, base)
    add_adapters(model, SETTINGS, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_b"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    replaced = {k: model.state_dict()[k].clone() for k in TEXT_ROWS}
    adapter = tmp_path / "voice.lora.pth"
    adapter_file.write(AdapterFile(SETTINGS, str(base), file_sha256(base), adapter_state_dict(model), replaced), adapter)
    return model.eval(), base, adapter


@pytest.mark.parametrize("wrapped", [True, False], ids=["model_key", "bare_state_dict"])
def test_the_merged_file_loads_strictly_and_computes_what_the_adapted_model_computes(tmp_path, capsys, wrapped):
    model, base, adapter = trained_run(tmp_path, wrapped)
    out = tmp_path / "merged.pth"
    assert main(["--adapter", str(adapter), "--base", str(base), "--out", str(out)]) == 0
    assert "merged 8 adapters (rank 4, alpha 8) and 3 replaced tensors" in capsys.readouterr().out
    saved = torch.load(out, weights_only=True)
    assert ("model" in saved) == wrapped
    plain = UnifiedVoiceGPT(EXTENDED).eval()
    plain.load_state_dict(saved["model"] if wrapped else saved, strict=True)
    batch = make_batch([5, 9, 3], [7, 12, 4], cfg=EXTENDED, seed=3)
    batch["text_ids"][0, 0] = EXTENDED.number_text_tokens - 1  # a new token
    with torch.no_grad():
        for want, got in zip(model(**batch), plain(**batch)):
            assert (want - got).abs().max() < 2e-5


def test_another_base_is_refused_by_name_unless_allowed(tmp_path, capsys):
    _, base, adapter = trained_run(tmp_path)
    other = tmp_path / "other.pth"
    state = torch.load(base, weights_only=True)
    state["model"]["gpt.ln_f.bias"] += 0.5
    torch.save(state, other)
    out = tmp_path / "merged.pth"
    assert main(["--adapter", str(adapter), "--base", str(other), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--base {other}" in err and f"is not the base {adapter} was trained on ({base}" in err
    assert "--allow-other-base" in err and "Traceback" not in err and not out.exists()
    assert main(["--adapter", str(adapter), "--base", str(other), "--out", str(out), "--allow-other-base"]) == 0


def test_an_existing_out_is_never_replaced(tmp_path, capsys):
    _, base, adapter = trained_run(tmp_path)
    out = tmp_path / "merged.pth"
    out.write_bytes(b"the user's file")
    assert main(["--adapter", str(adapter), "--base", str(base), "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err and out.read_bytes() == b"the user's file"


class Payload:
    def __reduce__(self):
        return (print, ("this payload ran",))


@pytest.mark.parametrize("content, reason", [
    ("checkpoint", "not a LoRA adapter file"),
    (Payload(), "cannot be read with torch.load(weights_only=True)"),
    ({"format": "indextts2-lora-adapter/1", "lora": {"rank": 4}}, "damaged adapter file"),
    ({"format": "indextts2-lora-adapter/1", "lora": {"rank": 4, "alpha": 8.0, "targets": ["c_attn"]},
      "base": {"path": "x", "sha256": "y"}, "adapters": {"gpt.h.0.attn.c_attn.weight": torch.zeros(2)}},
     "adapter names must end in .lora_a or .lora_b"),
], ids=["a_checkpoint", "pickled_code", "no_alpha", "not_adapter_names"])
def test_a_file_that_is_not_an_adapter_file_is_refused(tmp_path, capsys, content, reason):
    _, base, _ = trained_run(tmp_path)
    bad = tmp_path / "bad.pth"
    if content == "checkpoint":
        bad.write_bytes(base.read_bytes())
    else:
        torch.save(content, bad)
    out = tmp_path / "merged.pth"
    assert main(["--adapter", str(bad), "--base", str(base), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"--adapter {bad}: " in captured.err and reason in captured.err, captured.err
    assert "this payload ran" not in captured.out and not out.exists()


def test_a_base_saved_under_ddp_names_merges_like_the_plain_one(tmp_path, capsys):
    """A gpt.pth saved from a DDP-wrapped model has every key as "module.<name>"; the trainer accepts it as a
    --base-checkpoint, so the merge command (and the export, through the same AdapterFile.merged) does too."""
    _, base, adapter = trained_run(tmp_path)
    state = torch.load(base, weights_only=True)["model"]
    ddp_base = tmp_path / "ddp_gpt.pth"
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, ddp_base)
    plain, ddp = tmp_path / "plain.pth", tmp_path / "ddp.pth"
    assert main(["--adapter", str(adapter), "--base", str(base), "--out", str(plain)]) == 0
    assert main(["--adapter", str(adapter), "--base", str(ddp_base), "--out", str(ddp),
                 "--allow-other-base"]) == 0, capsys.readouterr().err
    want, got = (torch.load(p, weights_only=True)["model"] for p in (plain, ddp))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
