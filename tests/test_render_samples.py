"""indextts-render: a step's generated codes to WAV files (and TensorBoard audio) with the user's IndexTTS2.

NOT RUN AGAINST THE REAL MODELS. Upstream's pipeline needs several GB of models (w2v-BERT 2.0, the
MaskGCT codec, s2mel, CAMPPlus, BigVGAN) and IndexTTS2's requirements (librosa, torchaudio, ...). The
whole-command tests put a tiny fake `indextts` package (and a fake `torchaudio`) on --indextts-dir: a
test double whose IndexTTS2 has the attributes infer_v2's own calls use, each returning small tensors
of the shapes upstream's do, and recording how it was called. What they prove is our side: inputs
found and checked, the calls made in infer_v2's order with its arguments, the samples' own text and
conditioning reaching the GPT, WAV files and TensorBoard audio written. Whether the real models sound
right through this path has not been checked.
"""
from __future__ import annotations

import json
import shutil
import sys
import textwrap
import types
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.demo_runs import V1_RUN, full_config
from trainers.run.sample_sets import SampleStore, new_set
from trainers.tools.render_samples import main, write_tensorboard
from trainers.tools.wav_files import PCM16_MAX, safe_name, safe_names, to_pcm16, write_wav

FAKE_TORCHAUDIO = '''
"""Test double of torchaudio: the two functions infer_v2 uses on the prompt audio."""
from types import SimpleNamespace
import torch

class Resample:
    def __init__(self, orig, new):
        self.orig, self.new = orig, new
    def __call__(self, x):
        n = int(x.shape[-1] * self.new / self.orig)
        return x[..., (torch.arange(n) * self.orig // self.new).long()]

def fbank(x, num_mel_bins, dither, sample_frequency):
    frames = x.reshape(-1)[: x.numel() // 160 * 160].reshape(-1, 160)
    return frames.mean(1, keepdim=True).expand(-1, num_mel_bins) + torch.arange(num_mel_bins)

transforms = SimpleNamespace(Resample=Resample)
compliance = SimpleNamespace(kaldi=SimpleNamespace(fbank=fbank))
'''

FAKE_INFER_V2 = '''
"""Test double of indextts/infer_v2.py: NOT the real models (see tests/test_render_samples.py)."""
import math
import wave
from types import SimpleNamespace
import numpy as np
import torch

CALLS = []  # what the command asked of the pipeline, in order

class _Regulator:
    def __call__(self, x, ylens, n_quantizers, f0):
        CALLS.append(("length_regulator", int(ylens[0]), n_quantizers, f0))
        idx = (torch.arange(int(ylens[0])) * x.shape[1] // int(ylens[0])).long()
        return x[:, idx], None

class _CFM:
    def inference(self, cond, lens, ref_mel, style, f0, steps, inference_cfg_rate):
        CALLS.append(("cfm", cond.shape[1], int(lens[0]), ref_mel.shape[-1], tuple(style.shape), steps,
                      inference_cfg_rate))
        return cond.mean(-1, keepdim=True).transpose(1, 2).expand(1, 8, cond.shape[1]).contiguous()

class IndexTTS2:
    def __init__(self, cfg_path, model_dir, use_fp16=False, device=None, use_cuda_kernel=None,
                 use_deepspeed=False, use_qwen_emo=True):
        CALLS.append(("init", cfg_path, model_dir, use_fp16, device, use_cuda_kernel, use_qwen_emo))
        self.device = "cpu"
        self.semantic_codec = SimpleNamespace(quantize=lambda x: (None, x), decode=self._decode,
                                              quantizer=SimpleNamespace(vq2emb=self._vq2emb))
        self.s2mel = SimpleNamespace(models={"gpt_layer": torch.nn.Linear(16, 4), "length_regulator": _Regulator(),
                                             "cfm": _CFM()})
        self.extract_features = lambda wav, sampling_rate, return_tensors: {
            "input_features": wav[:, ::160].unsqueeze(-1), "attention_mask": torch.ones(1, wav[:, ::160].shape[1])}
        self.get_emb = lambda features, mask: features.repeat(1, 1, 4)
        self.mel_fn = lambda wav: torch.zeros(1, 8, wav.shape[-1] // 256)
        self.campplus_model = lambda fbank: fbank.mean(1)[:, :1].expand(1, 192)

    def _decode(self, codes):  # IndexTTS-2.5: 25 Hz codes -> 50 Hz features
        CALLS.append(("decode", codes.tolist()))
        return codes.float().repeat_interleave(2, dim=1).unsqueeze(-1).expand(1, 2 * codes.shape[1], 4)

    def _vq2emb(self, codes):
        CALLS.append(("vq2emb", codes.shape))
        return codes.float().expand(1, 4, codes.shape[-1])

    def _load_and_cut_audio(self, path, seconds, verbose, sr=None):
        CALLS.append(("load_audio", path, seconds))
        with wave.open(path, "rb") as f:
            rate, data = f.getframerate(), np.frombuffer(f.readframes(f.getnframes()), "<i2")
        return torch.from_numpy(data[: seconds * rate] / 32767.0).float().unsqueeze(0), rate

    def gpt(self, cond, text, text_lens, codes, code_lens, emo_cond, cond_mel_lengths=None,
            emo_cond_mel_lengths=None, emo_vec=None, use_speed=None):
        CALLS.append(("gpt", text[0].tolist(), int(text_lens[0]), codes[0].tolist(), int(code_lens[0]),
                      float(cond.sum()), float(emo_vec.sum()), use_speed.tolist()))
        return (cond.mean(1, keepdim=True) + emo_vec.unsqueeze(1)).expand(1, codes.shape[1], cond.shape[-1])

    def bigvgan(self, mel):
        t = torch.arange(mel.shape[-1] * 256, dtype=torch.float32)
        return (0.5 * torch.sin(2 * math.pi * 440 * t / 22050)).reshape(1, 1, -1)
'''

MODEL_FILES = ("gpt.pth", "bpe.model", "s2mel.pth", "wav2vec2bert_stats.pt", "feat1.pt", "feat2.pt")
IDS = ["demo_val_00000", "demo_val_00001", "demo_val_00002"]
STEP = 40


@pytest.fixture
def clean_imports(monkeypatch):
    """Each test imports its own upstream (or none): no `indextts`/`torchaudio` module outlives it."""
    for name in [n for n in sys.modules if n.split(".")[0] in ("indextts", "torchaudio")]:
        monkeypatch.delitem(sys.modules, name)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("indextts", "torchaudio"):
            del sys.modules[name]


def fake_upstream(folder: Path, extra_import: str = "", module: str = "infer_v2") -> Path:
    """A checkout-shaped folder holding the test double of indextts.infer_v2 (or of infer_v2_5: the same double,
    whose codec also decodes)."""
    (folder / "indextts").mkdir(parents=True)
    (folder / "indextts" / "__init__.py").write_text("")
    (folder / "indextts" / f"{module}.py").write_text(extra_import + textwrap.dedent(FAKE_INFER_V2))
    return folder


def fake_torchaudio(monkeypatch) -> None:
    """The test double of torchaudio, as if installed (a real one, where there is one, is set aside)."""
    module = types.ModuleType("torchaudio")
    exec(textwrap.dedent(FAKE_TORCHAUDIO), module.__dict__)
    monkeypatch.setitem(sys.modules, "torchaudio", module)


@pytest.fixture
def setup(tmp_path, clean_imports, monkeypatch):
    """A run with a sample set of step 40 (the third sample stopped at once: no codes), its validation
    manifest, a model folder with a full config.yaml (empty model files) and a prompt clip."""
    fake_torchaudio(monkeypatch)
    data = tmp_path / "data"
    shutil.copytree(V1_RUN / "data", data)
    run = tmp_path / "run"
    SampleStore(run, keep=3).write(new_set(STEP, IDS, ["en"] * 3, [np.arange(5), [7, 8, 9, 10, 11, 12, 13], []],
                                           [True, False, True], [6, 9, 4]))
    (run / "run_config.json").write_text(json.dumps({"config": {"val_manifests": [str(data / "val.jsonl")]}}))
    models = tmp_path / "models"
    models.mkdir()
    full_config(models / "config.yaml", data / "tiny.yaml")
    for name in MODEL_FILES:
        (models / name).write_bytes(b"")
    prompt = tmp_path / "prompt.wav"
    write_wav(prompt, 0.3 * np.sin(np.arange(16000) / 5.0), 16000)
    flags = [str(run), "--indextts-dir", str(fake_upstream(tmp_path / "upstream")), "--model-dir", str(models),
             "--prompt-audio", str(prompt)]
    return run, data, flags


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_wav(path: Path) -> tuple[int, np.ndarray]:
    with wave.open(str(path), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth()) == (1, 2)
        return f.getframerate(), np.frombuffer(f.readframes(f.getnframes()), "<i2")


# ---------------------------------------------------------------- refusals


def test_without_indextts_it_says_what_to_install_and_writes_nothing(setup, monkeypatch, capsys):
    run, _, flags = setup
    before = files_under(run)
    monkeypatch.setitem(sys.modules, "indextts", None)  # not importable, even where it is installed
    no_dir = flags[:1] + flags[3:]  # without --indextts-dir: the installed package
    assert main(no_dir) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: IndexTTS2 cannot be imported in this Python") and "no module named 'indextts'" in err
    assert "git clone https://github.com/index-tts/index-tts && pip install -e ./index-tts" in err
    assert "config.yaml, gpt.pth, bpe.model, s2mel.pth" in err and "Traceback" not in err
    assert files_under(run) == before


def test_a_folder_that_is_not_a_checkout_and_a_missing_requirement_are_refused(setup, tmp_path, capsys):
    run, _, flags = setup
    before = files_under(run)
    assert main([*flags, "--indextts-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "holds no indextts/infer_v2.py (not an IndexTTS2 checkout)" in err and "pip install -e" in err
    assert main([*flags, "--indextts-dir", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
    broken = fake_upstream(tmp_path / "broken", extra_import="import librosa_not_installed_here\n")
    assert main([*flags, "--indextts-dir", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "the module 'librosa_not_installed_here' it needs is missing" in err and "Traceback" not in err
    assert files_under(run) == before


@pytest.mark.parametrize("problem, message", [
    ("none", "holds no sample sets"),
    ("other step", "has no sample set of step 41 (steps kept: 40"),
    ("damaged", "is not a readable sample set"),
])
def test_a_missing_or_damaged_sample_set_is_refused(setup, capsys, problem, message):
    run, _, flags = setup
    set_file = run / "samples" / f"step_{STEP:08d}.npz"
    if problem == "none":
        set_file.unlink()
    elif problem == "damaged":
        set_file.write_bytes(set_file.read_bytes()[:100])
    before = files_under(run)
    assert main([*flags, *(["--step", "41"] if problem == "other step" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert files_under(run) == before and not (run / "samples" / "audio").exists()


def test_inputs_are_checked_before_anything_is_written(setup, tmp_path, capsys):
    run, data, flags = setup
    before = files_under(run)
    models = Path(flags[flags.index("--model-dir") + 1])
    (models / "s2mel.pth").unlink()
    assert main(flags) == 2
    assert "lacks files its config.yaml names (s2mel_checkpoint: s2mel.pth)" in capsys.readouterr().err
    (models / "s2mel.pth").write_bytes(b"")
    other = data / "other.jsonl"  # its feature paths are relative to its folder
    other.write_text((data / "val.jsonl").read_text().splitlines()[0] + "\n")
    assert main([*flags, "--manifest", str(other)]) == 2
    err = capsys.readouterr().err
    assert "1 sample(s) of the set are in no manifest of" in err and "(first: 'demo_val_00001')" in err
    SampleStore(run, keep=3).write(new_set(STEP + 1, IDS[:1], ["en"], [[3, 128]], [False], [2]))
    before = files_under(run)
    assert main([*flags, "--step", str(STEP + 1)]) == 2
    err = capsys.readouterr().err
    assert "sample demo_val_00000 of step 41 holds code 128, outside 0..127" in err
    assert files_under(run) == before


# ---------------------------------------------------------------- the pieces


def test_a_wav_file_reads_back_as_16_bit_pcm(tmp_path):
    wav = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.7, -3.0])
    write_wav(tmp_path / "a.wav", wav, 22050)
    rate, samples = read_wav(tmp_path / "a.wav")
    assert rate == 22050
    assert samples.tolist() == [0, 16384, -16384, PCM16_MAX, -PCM16_MAX, PCM16_MAX, -PCM16_MAX]
    assert [p.name for p in tmp_path.iterdir()] == ["a.wav"]  # no temporary left
    with pytest.raises(ValueError, match="NaN"):
        to_pcm16(np.array([0.1, np.nan]))


def test_sample_ids_become_distinct_safe_file_names(tmp_path):
    ids = ["utt_1", "a/b", "a_b", "../up", ".hidden", "spk 1:x?", "ünï", "Ab", "ab", "lone\ud800", "x" * 300, "я" * 200, ""]
    names = safe_names(ids)
    assert names[0] == "utt_1" and names[2] == "a_b" and names[6] == "ünï"  # good names are kept as they are
    assert len({n.casefold() for n in names}) == len(ids)
    for name in names:
        assert "/" not in name and not name.startswith(".") and 0 < len(name.encode()) < 200
        (tmp_path / f"{name}.wav").write_bytes(b"")
    assert len(list(tmp_path.iterdir())) == len(ids)
    assert safe_name("a/b") == safe_names(["a/b"])[0] and safe_name("a/b").startswith("a_b-")


def test_the_audio_goes_to_tensorboard_at_the_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    clip = 0.25 * np.sin(np.arange(2205) / 3.0)
    write_tensorboard(tmp_path / "logs", 40, [("demo/utt 1", clip), ("b", 2 * clip)], 22050)
    events = EventAccumulator(str(tmp_path / "logs"), size_guidance={"audio": 0})
    events.Reload()
    assert sorted(events.Tags()["audio"]) == ["gen_audio/b", "gen_audio/demo/utt 1"]
    (audio,) = events.Audio("gen_audio/demo/utt 1")
    assert (audio.step, audio.sample_rate, audio.length_frames) == (40, 22050, 2205)
    path = tmp_path / "back.wav"
    path.write_bytes(audio.encoded_audio_string)
    assert read_wav(path)[1].size == 2205


# ---------------------------------------------------------------- the whole command (test double upstream)


def test_the_command_renders_each_sample_through_the_upstream_calls(setup, capsys):
    """With the fake upstream (NOT the real models): one WAV per sample with codes, at 22.05 kHz, as long
    as 1.72 mel frames per code times BigVGAN's 256 samples; the GPT gets the manifest's text ids and
    conditioning with the set's codes; the s2mel and CFM calls carry infer_v2's arguments."""
    run, data, flags = setup
    assert main([*flags, "--tensorboard"]) == 0
    printed = capsys.readouterr()
    out, err = printed.out, printed.err
    calls = sys.modules["indextts.infer_v2"].CALLS
    models = flags[flags.index("--model-dir") + 1]
    assert calls[0] == ("init", f"{models}/config.yaml", models, False, None, False, False)
    audio = run / "samples" / "audio" / f"step_{STEP:08d}"
    assert sorted(p.name for p in audio.iterdir()) == ["demo_val_00000.wav", "demo_val_00001.wav"]
    for name, codes in (("demo_val_00000", 5), ("demo_val_00001", 7)):
        rate, samples = read_wav(audio / f"{name}.wav")
        tone = 0.5 * np.sin(2 * np.pi * 440 * np.arange(int(codes * 1.72) * 256, dtype=np.float32) / 22050)
        assert rate == 22050 and np.abs(samples.astype(int) - to_pcm16(tone)).max() <= 1  # BigVGAN's output
    gpt = [c for c in calls if c[0] == "gpt"]
    line = json.loads((data / "val.jsonl").read_text().splitlines()[1])
    assert gpt[1][1] == np.load(data / line["text_ids_path"]).tolist() and gpt[1][2] == line["text_len"]
    assert gpt[1][3:5] == ([7, 8, 9, 10, 11, 12, 13], 7) and gpt[1][7] == [0]
    assert gpt[1][5] == pytest.approx(float(np.load(data / line["condition_path"]).sum()), rel=1e-5)
    assert gpt[1][6] == pytest.approx(float(np.load(data / line["emo_vec_path"]).sum()), rel=1e-5)
    regulated = [c for c in calls if c[0] == "length_regulator"]
    assert [(c[1], c[2], c[3]) for c in regulated[1:]] == [(8, 3, None), (12, 3, None)]  # int(1.72 * codes)
    assert all(c[5:] == (25, 0.7) and c[4] == (1, 192) for c in calls if c[0] == "cfm")
    assert ("load_audio", flags[-1], 15) in calls
    assert "rendered 2 of 3 samples of step 40" in out and "demo_val_00002 of step 40 has no codes" in err
    assert "warning: --model-dir" in err and "not an indextts-export of this run" in err  # the latent's GPT is not step 40's: said
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "logs"), size_guidance={"audio": 0})
    events.Reload()
    assert sorted(events.Tags()["audio"]) == ["gen_audio/demo_val_00000", "gen_audio/demo_val_00001"]
    assert events.Audio("gen_audio/demo_val_00001")[0].step == STEP


def test_existing_wav_files_are_kept_unless_overwrite_is_given(setup, tmp_path, capsys):
    run, _, flags = setup
    out = tmp_path / "listen"
    assert main([*flags, "--out", str(out), "--manifest", str(tmp_path / "data" / "val.jsonl")]) == 0
    (out / "demo_val_00000.wav").write_bytes(b"mine")
    assert main([*flags, "--out", str(out)]) == 2
    assert "already holds 2 of these WAV files (demo_val_00000.wav, demo_val_00001.wav)" in capsys.readouterr().err
    assert (out / "demo_val_00000.wav").read_bytes() == b"mine"
    assert main([*flags, "--out", str(out), "--overwrite"]) == 0
    assert read_wav(out / "demo_val_00000.wav")[0] == 22050


def test_the_gpt_latent_is_upstreams_forward_over_the_samples_own_conditioning():
    """Against upstream's real UnifiedVoice (its pinned wheel, tests/upstream_models.py; tiny random weights):
    the forward the command calls accepts its arguments and gives, for each code, the hidden state our model's
    teacher-forced pass has there, so the latent the s2mel model reads belongs to the codes and their
    conditioning."""
    import torch

    from tests.test_generation import model, texts
    from tests.upstream_gpt import conformer_model
    from trainers.tools.indextts_upstream import gpt_latent

    ours = model()
    uv = conformer_model(ours)
    batch = texts()
    n = int(batch["text_lens"][1])
    text, codes = batch["text_ids"][1, :n], torch.tensor([3, 17, 5, 5, 9, 0, 21])
    cond, emo = batch["condition"][1], batch["emo_vec"][1]
    latent = gpt_latent(types.SimpleNamespace(gpt=uv, device="cpu"), text.numpy(), codes.numpy(), cond.numpy(),
                        emo.numpy())
    with torch.no_grad():
        _, h_mel, _, _ = ours._teacher_forced({"condition": cond[None], "emo_vec": emo[None]}, text[None],
                                              torch.tensor([n]), codes[None], torch.tensor([7]), None, "upstream")
    assert latent.shape == (1, 7, ours.cfg.model_dim)
    torch.testing.assert_close(latent, h_mel[:, :7], rtol=1e-5, atol=1e-5)  # [start, codes...] positions


def test_an_indextts25_model_renders_its_codes_through_infer_v2_5s_calls(setup, tmp_path, capsys):
    """With the fake upstream (NOT the real models), a --model-dir of IndexTTS-2.5 (`version: 2.5`): infer_v2_5 is
    imported, and each sample's codes go to the codec's decode (25 Hz -> 50 Hz), the length regulator at 1.72
    frames per feature frame, the CFM and BigVGAN; no manifest is read (the run records none here) and no GPT runs."""
    import yaml

    from tests.demo_runs import DEMO25_CONFIG

    run, _, flags = setup
    (run / "run_config.json").write_text(json.dumps({"config": {"val_manifests": []}}))
    models = tmp_path / "models25"
    models.mkdir()
    full_config(models / "config.yaml", DEMO25_CONFIG)
    data = yaml.safe_load((models / "config.yaml").read_text())
    del data["dataset"]
    data["version"] = 2.5
    (models / "config.yaml").write_text(yaml.safe_dump(data))
    for name in ("gpt.pth", "s2mel.pth", "wav2vec2bert_stats.pt", "feat1.pt", "feat2.pt", "codec.pth",
                 "multilingual_zh_ja_yue_char_del.tiktoken"):
        (models / name).write_bytes(b"")
    upstream25 = fake_upstream(tmp_path / "upstream25", module="infer_v2_5")
    argv = [str(run), "--indextts-dir", str(upstream25), "--model-dir", str(models), "--prompt-audio", flags[-1]]
    (models / "codec.pth").unlink()
    assert main(argv) == 2
    assert "lacks files its config.yaml names (codec.pth)" in capsys.readouterr().err
    (models / "codec.pth").write_bytes(b"")
    assert main(argv) == 0, capsys.readouterr().err
    calls = sys.modules["indextts.infer_v2_5"].CALLS
    assert not [c for c in calls if c[0] == "gpt"]
    assert [c[1] for c in calls if c[0] == "decode"] == [[[0, 1, 2, 3, 4]], [[7, 8, 9, 10, 11, 12, 13]]]
    regulated = [c for c in calls if c[0] == "length_regulator"]
    assert [(c[1], c[2]) for c in regulated[1:]] == [(int(10 * 1.72), 3), (int(14 * 1.72), 3)]
    audio = run / "samples" / "audio" / f"step_{STEP:08d}"
    rate, samples = read_wav(audio / "demo_val_00001.wav")
    assert rate == 22050 and samples.size == int(14 * 1.72) * 256
    assert [c[2] for c in calls if c[0] == "load_audio"] == [15, 15]  # the prompt, and again for CAMPPlus
