"""indextts-prepare's upstream backends (trainers/tools/prepare/upstream*.py) on tiny, randomly initialised instances
of upstream's own feature models, against upstream's own inference path on the same audio and models
(tests/upstream_features.py says where each piece comes from and what is stood in for).

What holds: the text ids, codes, conditioning latent / CAMPPlus vector and emotion vector the backend computes for a
clip alone equal, bit for bit, what the inference path computes for it as a reference clip; a batch equals each clip
alone (codes identical, floats within 1e-5), which needs the per-clip runs the backends do (the padded batch's rows
differ, shown here on the same models); the conditioning comes from the first 15 s; weights that do not fit are
refused. Not run: the real multi-GB models, real librosa and WeTextProcessing, a GPU.
"""
from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import upstream_features as uf
from trainers.errors import UserError
from trainers.tools.prepare.backend import BackendRequest, Clip, check_features
from trainers.tools.prepare.upstream import PROMPT_KEY, make_backend

FAMILIES = ("indextts2", "indextts25")
SECONDS = (0.45, 0.7, 1.05)
TEXT = "The small cat 2 sees a red bird."


@pytest.fixture(scope="module")
def clips_dir(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("clips")
    return [uf.write_wav(folder / f"clip{i}.wav", uf.voice(s, seed=i)) for i, s in enumerate(SECONDS)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_backend(request):
    return request.param, uf.open_backend(request.param)


def test_torchaudio_code_is_what_indextts25_inference_reimplements():
    """The torchaudio the tests run is torchaudio 2.8.0's own Python code; indextts25-inference calls its own copy of
    Resample and Kaldi fbank bit-identical to it: here they are, on 22.05, 24 and 44.1 kHz input."""
    with uf.stand_ins():
        uf.bare_package(uf.fetched(uf.UPSTREAM_V25_CODE), "indextts25")
        common = importlib.import_module("indextts25.utils.common")
        ta = importlib.import_module("torchaudio")
        g = torch.Generator().manual_seed(0)
        for rate in (22050, 24000, 44100):
            wav = 0.3 * torch.randn(1, rate, generator=g)
            ours = ta.transforms.Resample(rate, 16000)(wav)
            assert torch.equal(ours, common.resample(wav, rate, 16000))
            assert torch.equal(ta.compliance.kaldi.fbank(ours, num_mel_bins=80, dither=0, sample_frequency=16000),
                               common.kaldi_fbank(ours, 80, 16000))


def test_features_equal_upstream_inference_and_a_batch_equals_each_clip_alone(family_backend, clips_dir):
    """Each clip alone: the backend's text ids, codes and conditioning are what the inference path computes for it as
    a reference clip, bit for bit. Then one batch of all three, the last given the first clip as its 15 s prompt:
    each row equals its clip alone; the prompt row's conditioning is the first clip's."""
    family, backend = family_backend
    folder = uf.model_dir(family)
    clips = [backend.audio(p, p.stem) for p in clips_dir]
    alone = [backend.encode([c])[0] for c in clips]
    refs = uf.reference_25(folder, clips_dir, TEXT, "en") if family == "indextts25" else \
        uf.reference_20(folder, clips_dir, TEXT)
    for clip, feats, ref in zip(clips, alone, refs):
        if family == "indextts25":
            ids = [i for i in ref["text_ids"] if i not in (0, 1)]  # the trainer's ids: 0 and 1 dropped
            pairs = {"spk_emb": ref["spk_emb"], "emo_vec": ref["emo_vec"]}
        else:
            ids = ref["text_ids"]
            pairs = {"condition": ref["condition"], "emo_vec": ref["emo_vec"]}
        assert backend.text(TEXT, "en").ids.tolist() == ids
        assert feats.codes.tolist() == ref["codes"].tolist()
        assert len(feats.codes) == backend.code_length(clip.waveform.shape[0]) == uf.code_count(
            int(round(clip.waveform.shape[0] * uf.TEST_RATE / 16000)), family)
        for name, value in pairs.items():
            assert np.array_equal(feats.conditioning[name], value.numpy()), name
    # the normaliser ran (its stand-in writes 2 as the word "small")
    assert "smallcat" in backend.text("2 cat", "en").normalised.lower().replace(" ", "").replace("\u2581", "")

    prompted = Clip(clips[2].id, clips[2].waveform, 16000, 22050, 1, {PROMPT_KEY: clips[0].waveform})
    batch = backend.encode([clips[0], clips[1], prompted])
    check_features(backend, [clips[0], clips[1], prompted], batch)
    for got, want, want_conditioning in zip(batch, alone, (alone[0], alone[1], alone[0])):
        assert got.codes.tolist() == want.codes.tolist()
        for name, value in got.conditioning.items():
            np.testing.assert_allclose(value, want_conditioning.conditioning[name], rtol=0, atol=1e-5)


def test_a_padded_batch_would_leak_into_codes_and_conditioning(family_backend, clips_dir):
    """Why the backends run the codec and the GPT's conformers on each clip alone: on these models, the shortest
    clip's row of a padded batch differs from the clip alone where its quantizer's input is made (the codes are
    chosen from it) and in its emotion vector."""
    family, backend = family_backend
    clips = [backend.audio(p, p.stem) for p in clips_dir]
    feats = backend.semantic([c.waveform for c in clips])
    short, longest = feats[0], feats[-1].shape[0]
    padded = torch.zeros(len(feats), longest, short.shape[1])
    for i, f in enumerate(feats):
        padded[i, :f.shape[0]] = f
    lengths = torch.tensor([f.shape[0] for f in feats])
    seen = []
    hook = backend.codec.quantizer.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0]))
    with torch.no_grad():
        alone_codes, _ = backend.codec.quantize(short.unsqueeze(0))
        backend.codec.quantize(padded)
        hook.remove()
        n = alone_codes.shape[-1]
        assert (seen[1][0, :, :n] - seen[0][0]).abs().max() > 1e-5  # [B, D, T]; alone vs padded, same features
        emo_alone = backend.gpt.get_emovec(short.unsqueeze(0), lengths[:1])
        emo_batch = backend.gpt.get_emovec(padded, lengths)
        assert (emo_batch[0] - emo_alone[0]).abs().max() > 1e-3


def test_the_conditioning_clip_is_the_first_15_seconds(tmp_path):
    """A 15.5 s clip: its codes come from all of it, its conditioning from its first 15 s as inference cuts them (at
    the loaded 22,050 Hz, then resampled). No model runs here."""
    backend = uf.open_backend("indextts2")
    wave = uf.voice(15.5, seed=7)
    clip = backend.audio(uf.write_wav(tmp_path / "long.wav", wave), "long")
    with uf.stand_ins():
        ta = __import__("torchaudio")
        __import__("torchaudio.transforms")
        resample = __import__("sys").modules["torchaudio.transforms"].Resample(uf.TEST_RATE, 16000)
        pcm = torch.from_numpy(uf.read_wav(str(tmp_path / "long.wav"))[0]).unsqueeze(0)
        whole, first = resample(pcm)[0].numpy(), resample(pcm[:, :15 * uf.TEST_RATE])[0].numpy()
        assert ta is not None
    assert np.array_equal(clip.waveform, whole) and np.array_equal(clip.extras[PROMPT_KEY], first)
    assert (clip.rate, clip.source_rate, clip.source_channels) == (16000, uf.TEST_RATE, 1)
    short = backend.audio(uf.write_wav(tmp_path / "short.wav", wave[:uf.TEST_RATE]), "short")
    assert PROMPT_KEY not in short.extras


def link_copy(folder: Path, into: Path) -> Path:
    """A copy of a model folder whose files are symlinks (one of them then replaced)."""
    for path in folder.rglob("*"):
        target = into / path.relative_to(folder)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path.resolve())
    return into


def backend_on(family: str, folder: Path, **request):
    with uf.stand_ins():
        return make_backend(BackendRequest(family, folder / "config.yaml", folder, uf.checkout(family), **request))


def test_weights_that_do_not_fit_are_refused(tmp_path):
    """A codec.pth with a tensor of another shape (upstream's 2.5 loader keeps that tensor random with a warning),
    a gpt.pth lacking a tensor, a CAMPPlus file of another size: refused, naming the file, before any feature."""
    folder = link_copy(uf.model_dir("indextts25"), tmp_path / "m25")
    codec = torch.load(folder / "codec.pth")
    key = next(k for k in codec["model"] if k.endswith("weight") and "down" in k)
    codec["model"][key] = codec["model"][key][:, :, :2].clone()
    (folder / "codec.pth").unlink()
    torch.save(codec, folder / "codec.pth")
    with pytest.raises(UserError, match=rf"codec\.pth does not fit .*1 of another shape \({key}"):
        backend_on("indextts25", folder)

    folder = link_copy(uf.model_dir("indextts2"), tmp_path / "m20")
    gpt = torch.load(folder / "gpt.pth")
    del gpt["emo_layer.bias"]
    (folder / "gpt.pth").unlink()
    torch.save(gpt, folder / "gpt.pth")
    with pytest.raises(UserError, match=r"gpt\.pth does not fit .*1 tensors missing \(emo_layer\.bias\)"):
        backend_on("indextts2", folder)


def test_missing_pieces_are_named_with_what_to_do(tmp_path):
    folder = link_copy(uf.model_dir("indextts2"), tmp_path / "m20")
    shutil.rmtree(folder / "hf_cache" / "models--amphion--MaskGCT")
    with pytest.raises(UserError, match=r"amphion/MaskGCT semantic_codec/model\.safetensors is not in .*hf_cache; "
                                        r"run IndexTTS2 inference once"):
        backend_on("indextts2", folder)
    with pytest.raises(UserError, match=r"IndexTTS-2\.5 cannot be imported under --indextts-dir .*holds no "
                                        r"indextts/infer_v2_5\.py"):
        with uf.stand_ins():
            make_backend(BackendRequest("indextts25", folder / "config.yaml", folder, uf.checkout("indextts2")))
    with pytest.raises(UserError, match="--backend upstream needs --model-dir"):
        make_backend(BackendRequest("indextts2", folder / "config.yaml"))


def test_the_fingerprint_names_every_file_and_the_code(family_backend):
    family, backend = family_backend
    fp = backend.fingerprint()
    roles = {"config", "tokenizer", "gpt", "codec", "w2v stats", "w2v model.safetensors", "sha256 upstream module"}
    assert {f"sha256 {r}" if not r.startswith("sha256") else r for r in roles} <= set(fp)
    assert fp["family"] == family and "version torch" in fp and "version transformers" in fp
    if family == "indextts25":
        assert "sha256 campplus" in fp
        with pytest.raises(UserError, match="language"):
            backend.text(TEXT, None)


# ------------------------------------------------------------------------------------------------ end to end

def utterance_list(folder: Path, words: list[str] | None = None, language: str = "en") -> Path:
    """Six short clips of two speakers with texts of `words` (default: the demo's, which the tiny tokenizers know),
    in `language`."""
    import json

    from trainers.data.demo_corpus import WORDS

    words = words or list(WORDS[:40])
    rng = np.random.default_rng(5)
    lines = []
    for i in range(6):
        path = uf.write_wav(folder / f"utt{i}.wav", uf.voice(0.55 + 0.05 * i, seed=10 + i))
        text = " ".join(words[int(k)] for k in rng.integers(0, len(words), size=3)) + " ."
        lines.append({"id": f"utt{i}", "audio": path.name, "text": text, "speaker": f"spk{i % 2}", "language": language})
    listing = folder / "list.jsonl"
    listing.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return listing


@pytest.mark.parametrize("family", FAMILIES)
def test_audio_to_a_trained_export_that_upstream_loads_strictly_and_generates_from(family, tmp_path):
    """indextts-prepare with the upstream backend on six clips, the trainer for two steps on its manifests from the
    model folder's gpt.pth, indextts-export, then upstream's UnifiedVoice loads the export strictly (every key, no
    other) and generates codes from a prepared sample's text and conditioning."""
    import yaml

    from tests.demo_runs import train_here
    from tests.prepare_data import prepare_here
    from tests.upstream_gpt import campplus_generate, campplus_upstream, v2
    from trainers.tools import export_checkpoint

    folder = uf.model_dir(family)
    tokenizer = folder / ("multilingual_zh_ja_yue_char_del.tiktoken" if family == "indextts25" else "bpe.model")
    out = tmp_path / "prepared"
    with uf.stand_ins():
        done = prepare_here("--input", str(utterance_list(tmp_path)), "--out", str(out), "--model-dir", str(folder),
                            "--indextts-dir", str(uf.checkout(family)), "--device", "cpu", "--val-fraction", "0.34")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    trained = train_here(run, "--train-manifest", str(out / "train_pairs.jsonl"), "--val-manifest",
                         str(out / "val_pairs.jsonl"), "--tokenizer", str(tokenizer), "--config",
                         str(folder / "config.yaml"), "--base-checkpoint", str(folder / "gpt.pth"), "--batch-size", "2",
                         "--max-steps", "2", "--save-interval", "2", "--val-interval", "0")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert export_checkpoint.main([str(run), "--out", str(tmp_path / "export"), "--config",
                                   str(folder / "config.yaml")]) == 0
    state = torch.load(tmp_path / "export" / "gpt.pth", weights_only=True)["model"]
    gpt = yaml.safe_load((tmp_path / "export" / "config.yaml").read_text(encoding="utf-8"))["gpt"]
    line = __import__("json").loads((out / "val_pairs.jsonl").read_text().splitlines()[0])
    if family == "indextts25":
        arrays = np.load(out / line["target_features"])
        prompt = np.load(out / line["prompt_features"])
        model = campplus_upstream(state, gpt)  # strict=True inside
        codes = campplus_generate(model, torch.from_numpy(prompt["spk_emb"])[None], torch.from_numpy(
            arrays["emo_vec"])[None], torch.from_numpy(arrays["text_ids"].astype(np.int64))[None], 0, 8)
    else:
        from tests.upstream_gpt import quiet

        with quiet():
            model = v2().UnifiedVoice(**gpt)
        model.load_state_dict(state, strict=True)
        model.eval().post_init_gpt2_config(kv_cache=True)
        text = np.load(out / line["target_text_ids_path"]).astype(np.int64)
        backend = uf.open_backend(family)
        feats = backend.semantic([backend.audio(tmp_path / "utt0.wav", "utt0").waveform])[0].unsqueeze(0)
        with torch.no_grad():  # upstream's own conditioning encoders (carried into the export) on real features
            out_codes, _ = model.inference_speech(feats, torch.from_numpy(text)[None], feats, do_sample=False,
                                                  num_beams=1, max_generate_length=8,
                                                  cond_lengths=torch.tensor([feats.shape[1]]),
                                                  emo_cond_lengths=torch.tensor([feats.shape[1]]))
        codes = out_codes.tolist()
    assert codes and 1 <= len(codes[0]) <= 9 and all(0 <= c <= gpt["stop_mel_token"] for c in codes[0])
