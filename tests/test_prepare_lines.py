"""indextts-prepare's input: the list layouts it reads, the audio it decodes, and every kind of bad line, each
reported as `list.jsonl:LINE: what; what to do`, skipped, counted, with nothing of it written."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.demo_runs import assert_output_fits
from tests.prepare_data import corpus, flags, prepare_here
from trainers.errors import UserError
from trainers.tools.prepare.audio import AudioLoader, audio_info, read_audio
from trainers.tools.prepare.backend import AudioProblem
from trainers.tools.prepare.inputs import read_input
from trainers.tools.prepare.resample import resample


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000, bits: int = 16, tag: int = 1,
              extensible: bool = False) -> Path:
    """A WAV file of `samples` [frames, channels] (or [frames]) floats, as PCM of `bits` or float (tag 3)."""
    samples = np.asarray(samples, dtype=np.float64)
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    if tag == 3:
        data = samples.astype("<f4" if bits == 32 else "<f8").tobytes()
    elif bits == 8:
        data = np.clip(np.rint(samples * 128 + 128), 0, 255).astype(np.uint8).tobytes()
    elif bits == 24:
        ints = np.clip(np.rint(samples * 2 ** 23), -2 ** 23, 2 ** 23 - 1).astype("<i4").reshape(-1)
        data = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints)
    else:
        scale = 2 ** (bits - 1)
        data = np.clip(np.rint(samples * scale), -scale, scale - 1).astype("<i2" if bits == 16 else "<i4").tobytes()
    fmt_tag = 0xFFFE if extensible else tag
    fmt = struct.pack("<HHIIHH", fmt_tag, channels, rate, rate * channels * bits // 8, channels * bits // 8, bits)
    if extensible:
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + bytes(14)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"LIST" + struct.pack("<I", 3) + b"abc\0"
    chunks += b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)
    return path


def tone(seconds: float, rate: int = 16000, pitch: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return 0.4 * np.sin(2 * np.pi * pitch * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))


@pytest.mark.parametrize("bits,tag,extensible", [(8, 1, False), (16, 1, False), (24, 1, False), (32, 1, False),
                                                 (32, 3, False), (64, 3, False), (16, 1, True), (32, 3, True)])
def test_wav_files_of_every_common_sample_format_are_read(tmp_path, bits, tag, extensible):
    wave_in = np.stack([tone(0.25), -tone(0.25, pitch=330)], axis=1)
    path = write_wav(tmp_path / "x.wav", wave_in, 22050, bits, tag, extensible)
    samples, rate = read_audio(path)
    assert rate == 22050 and samples.shape == (2, wave_in.shape[0]) and samples.dtype == np.float32
    np.testing.assert_allclose(samples.T, wave_in, atol=2.0 / 2 ** (bits - 1) if tag == 1 else 1e-7)
    assert audio_info(path).frames == wave_in.shape[0] and audio_info(path).channels == 2
    clip = AudioLoader(16000).load(path, "x")  # mono as librosa makes it (the channels' mean), at 16 kHz
    assert clip.rate == 16000 and clip.source_rate == 22050 and clip.source_channels == 2
    assert clip.waveform.shape == (-(-wave_in.shape[0] * 16000 // 22050),)
    expected = resample(samples.mean(axis=0), 22050, 16000)
    np.testing.assert_array_equal(clip.waveform, expected)


def test_the_resampler_keeps_what_the_new_rate_can_hold_and_removes_the_rest():
    rate = 44100
    low, high = tone(1.0, rate, 1000.0), 0.4 * np.sin(2 * np.pi * 11000.0 * np.arange(rate) / rate)
    out_low, out_high = resample(low, rate, 16000), resample(high, rate, 16000)
    np.testing.assert_allclose(out_low[200:-200], tone(1.0, 16000, 1000.0)[200:-200], atol=2e-3)
    assert np.abs(out_high[200:-200]).max() < 0.01  # above the new Nyquist frequency: filtered out, not aliased


def test_an_audio_format_without_a_decoder_says_what_to_install(tmp_path):
    path = tmp_path / "x.flac"
    path.write_bytes(b"fLaC" + bytes(100))
    try:
        import soundfile  # noqa: F401
    except ImportError:
        with pytest.raises(AudioProblem, match="pip install soundfile"):
            read_audio(path)
    else:
        with pytest.raises(AudioProblem, match="cannot be decoded"):
            read_audio(path)


def test_the_list_layouts_are_read(tmp_path):
    (tmp_path / "a.csv").write_text('id,audio,text,speaker,language\nu1,w/1.wav,"hello, world",ann,en\n'
                                    'u2,w/2.wav,second,bob,\n\nu3,w/3.wav\n', encoding="utf-8")
    listing = read_input(tmp_path / "a.csv", "auto", None, "de")
    assert [(e.id, e.text, e.speaker, e.language, e.source) for e in listing.entries] == [
        ("u1", "hello, world", "ann", "en", "a.csv:2"), ("u2", "second", "bob", "de", "a.csv:3")]
    assert [str(p) for p in listing.problems] == [
        "a.csv:5: 2 fields where the header has 5; write every field (separated by ','; quote fields holding it)"]
    assert listing.entries[0].audio == tmp_path / "w" / "1.wav"
    (tmp_path / "b.tsv").write_text("path\ttranscript\nx/y.wav\tsome text\n", encoding="utf-8")
    (entry,) = read_input(tmp_path / "b.tsv", "auto", "me", None).entries
    assert (entry.id, entry.text, entry.speaker) == ("x/y", "some text", "me")  # the id from the audio path
    lj = tmp_path / "LJSpeech-1.1"
    lj.mkdir()
    (lj / "metadata.csv").write_text("LJ001-0001|Printing, in 1823|Printing, in eighteen twenty-three\n"
                                     "LJ001-0002|In being comparatively modern.|\n", encoding="utf-8")
    listing = read_input(lj / "metadata.csv", "auto", None, None)
    assert listing.layout == "ljspeech"
    assert [(e.id, e.text, e.speaker, e.audio) for e in listing.entries] == [
        ("LJ001-0001", "Printing, in eighteen twenty-three", "LJSpeech-1.1", lj / "wavs" / "LJ001-0001.wav"),
        ("LJ001-0002", "In being comparatively modern.", "LJSpeech-1.1", lj / "wavs" / "LJ001-0002.wav")]
    folder = tmp_path / "clips"
    (folder / "ann").mkdir(parents=True)
    for name, text in (("ann/1", "one"), ("ann/2", None), ("top", "top level")):
        write_wav(folder / f"{name}.wav", tone(0.1))
        if text:
            (folder / f"{name}.{'lab' if name == 'top' else 'txt'}").write_text(f" {text}\n", encoding="utf-8")
    listing = read_input(folder, "auto", None, "en")
    assert [(e.id, e.text, e.speaker) for e in listing.entries] == [("ann/1", "one", "ann"), ("top", "top level",
                                                                                              "clips")]
    assert [p.reason for p in listing.problems] == ["bad_line"] and "ann/2.wav: has no transcript" in str(
        listing.problems[0])
    (tmp_path / "d.jsonl").write_text(json.dumps({"audio": "a.wav", "text": "one\u2028two"}, ensure_ascii=False)
                                      + "\n[]\n", encoding="utf-8")  # U+2028 unescaped in a string: still one line
    assert [str(p).split(":")[:2] for p in read_input(tmp_path / "d.jsonl", "auto", None, None).problems] == [
        ["d.jsonl", "2"]]
    with pytest.raises(UserError, match="not a header naming the audio and text columns"):
        (tmp_path / "c.csv").write_text("u1,w.wav,text\n", encoding="utf-8")
        read_input(tmp_path / "c.csv", "auto", None, None)


@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return corpus(tmp_path_factory.mktemp("lines") / "audio", "indextts2", per_speaker=2)


def test_every_bad_line_is_reported_skipped_and_counted_and_nothing_of_it_is_written(audio, tmp_path):
    listing, tokenizer, config = audio
    folder = tmp_path / "data"
    shutil.copytree(listing.parent, folder)
    good = [json.loads(line) for line in listing.read_text().splitlines()]
    write_wav(folder / "silent.wav", np.zeros(16000))
    write_wav(folder / "short.wav", tone(0.2))
    write_wav(folder / "long.wav", tone(4.0))
    write_wav(folder / "nan.wav", np.where(np.arange(16000) == 5000, np.nan, tone(1.0)), bits=32, tag=3)
    write_wav(folder / "stereo.wav", np.stack([tone(1.2), tone(1.2, pitch=300)], axis=1))
    write_wav(folder / "8k.wav", tone(1.1, 8000), rate=8000, bits=24)
    write_wav(folder / "nothing.wav", np.zeros(0))
    (folder / "empty.wav").write_bytes(b"")
    (folder / "garbage.wav").write_bytes(b"not audio at all" * 10)
    (folder / "x.flac").write_bytes(b"fLaC" + bytes(100))
    rows = [*(json.dumps(r) for r in good),
            json.dumps({"id": "missing", "audio": "nope.wav", "text": "the cat .", "speaker": "spk0"}),
            json.dumps({"id": "garbage", "audio": "garbage.wav", "text": "the cat .", "speaker": "spk0"}),
            json.dumps({"id": "empty", "audio": "empty.wav", "text": "the cat .", "speaker": "spk0"}),
            json.dumps({"id": "nothing", "audio": "nothing.wav", "text": "the cat .", "speaker": "spk0"}),
            json.dumps({"id": "silent", "audio": "silent.wav", "text": "the cat .", "speaker": "spk0"}),
            json.dumps({"id": "short", "audio": "short.wav", "text": "the cat .", "speaker": "spk0"}),
            json.dumps({"id": "long", "audio": "long.wav", "text": "the cat .", "speaker": "spk0"}),
            json.dumps({"id": "nan", "audio": "nan.wav", "text": "the cat .", "speaker": "spk0"}),
            json.dumps({"id": "stereo", "audio": "stereo.wav", "text": "the red cat .", "speaker": "spk1"}),
            json.dumps({"id": "8k", "audio": "8k.wav", "text": "a blue bird .", "speaker": "spk1"}),
            json.dumps({"id": "unknown", "audio": "stereo.wav", "text": "Привет мир", "speaker": "spk1"}),
            json.dumps({"id": "wordy", "audio": "stereo.wav", "text": " ".join(["the cat"] * 40), "speaker": "spk1"}),
            json.dumps({"id": "blank", "audio": "stereo.wav", "text": "   ", "speaker": "spk1"}),
            json.dumps({"id": "stereo", "audio": "8k.wav", "text": "the cat .", "speaker": "spk1"}),
            json.dumps({"id": "flac", "audio": "x.flac", "text": "the cat .", "speaker": "spk1"}),
            '{"id": "broken", "audio": ',
            json.dumps({"id": "textless", "audio": "stereo.wav"}),
            json.dumps(["a", "list"])]
    (folder / "list.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    result = prepare_here(*flags(folder / "list.jsonl", tokenizer, config, out))
    assert result.returncode == 3, result.stderr  # the manifests are written, some lines were skipped
    n = len(good)
    expected = {
        n + 1: "list.jsonl:{}: {}/nope.wav not found; fix the path",
        n + 2: "list.jsonl:{}: {}/garbage.wav is not a RIFF WAVE file; convert it to WAV",
        n + 3: "list.jsonl:{}: {}/empty.wav is an empty file (0 bytes); record or convert it again",
        n + 4: "list.jsonl:{}: {}/nothing.wav holds no audio samples; record or convert it again",
        n + 5: "list.jsonl:{}: silent.wav is silent (peak -inf dBFS, below --silence-db -60); check the recording, or "
               "lower --silence-db",
        n + 6: "list.jsonl:{}: lasts 0.20 s, shorter than --min-seconds 0.5; remove the line, or lower --min-seconds",
        n + 7: "list.jsonl:{}: lasts 4.0 s: 199 codes, more than gpt.max_mel_tokens 150; split it into clips of at "
               "most 3 s",
        n + 8: "list.jsonl:{}: nan.wav holds 1 NaN or infinite samples; convert it again from the original recording",
        n + 11: "list.jsonl:{}: 2 of 4 tokens unknown ('ПРИВЕТ МИР'); fix the text, or "
                "extend the tokenizer (indextts-extend-bpe)",
        n + 12: "list.jsonl:{}: its text is 120 tokens, more than gpt.max_text_tokens 48; split the utterance",
        n + 13: "list.jsonl:{}: the text is empty; write its transcript, or remove the line",
        n + 14: "list.jsonl:{}: id 'stereo' was already used by list.jsonl:{}; give each utterance its own id",
        n + 16: "list.jsonl:{}: not JSON (Expecting value at column 27); write one JSON object per line",
        n + 17: "list.jsonl:{}: no text field (it has id, audio); add text (accepted names: text, transcript",
        n + 18: "list.jsonl:{}: a JSON list, not an object; write one JSON object per line",
    }
    reported = [line for line in result.stderr.splitlines() if line.startswith("list.jsonl:")]
    skipped = (out / "skipped.txt").read_text().splitlines()
    for number, text in expected.items():
        want = text.format(number, n + 9) if "already used" in text else text.format(number, folder)
        assert any(line.startswith(want) for line in reported), f"not reported: {want}\n{result.stderr}"
        assert any(line.startswith(want) for line in skipped), f"not in skipped.txt: {want}"
    flac = [line for line in skipped if line.startswith(f"list.jsonl:{n + 15}: {folder}/x.flac ")]
    assert len(flac) == 1 and ("pip install soundfile" in flac[0] or "cannot be decoded" in flac[0])
    assert len(skipped) == len(expected) + 1 == len(reported)
    summary = json.loads((out / "prepare_summary.json").read_text())
    assert summary["kept"] == n + 2 and summary["skipped"] == len(expected) + 1
    assert summary["skipped_by_reason"] == {"bad_line": 3, "empty": 2, "unreadable": 2, "duplicate_id": 1,
                                            "missing_audio": 1, "nan": 1, "silence": 1, "text_empty": 1,
                                            "text_too_long": 1, "text_unknown": 1, "too_long": 1, "too_short": 1}
    assert summary["converted"]["mixed_to_mono"] == 1 + 2 and 8000 in summary["converted"]["from_rates"]
    assert "skipped 16 lines (each in skipped.txt): malformed line 3, audio empty 2, audio unreadable 2" in \
        result.stdout
    assert_output_fits(result.stdout + result.stderr + "\n".join(skipped), folder, out, listing.parent)
    kept = {r["id"] for name in ("train_utterances.jsonl", "val_utterances.jsonl") if (out / name).exists()
            for r in map(json.loads, (out / name).read_text().splitlines())}
    assert kept == {r["id"] for r in good} | {"stereo", "8k"}
    written = {p.name for p in (out / "features").iterdir()}
    assert written == {f"{i}_{role}.npy" for i in kept for role in ("text_ids", "codes", "condition", "emo_vec")}


def test_an_indextts25_line_needs_a_language_it_knows(tmp_path):
    listing, tokenizer, config = corpus(tmp_path / "audio", "indextts25", per_speaker=1)
    rows = [json.loads(line) for line in listing.read_text().splitlines()]
    rows[1].pop("language")
    rows[2]["language"] = "xx"
    listing.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    result = prepare_here(*flags(listing, tokenizer, config, tmp_path / "out"))
    assert result.returncode == 3, result.stderr
    assert ("list.jsonl:2: no language (an IndexTTS-2.5 text starts with its language's token); add a language field "
            "to the line, or pass --language") in result.stderr
    assert ("list.jsonl:3: language 'xx' is not one of IndexTTS-2.5's codes; borrow one it has (docs/indextts25.md, "
            "\"A new language\")") in result.stderr
