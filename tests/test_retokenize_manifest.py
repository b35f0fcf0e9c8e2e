"""tools/tokenizer/retokenize_manifest.py: manifest text -> text ids the way IndexTTS2 inference makes them."""
from __future__ import annotations

import io
import json
import os
import random
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import yaml

from tests.slowness import scaled
from trainers.data.demo_data import DemoCorpusSpec, ensure_demo_assets
from trainers.data.manifest import DataLimits, ManifestSpec, load_manifests
from trainers.tools.tokenizer import extend_bpe
from trainers.tools.tokenizer import retokenize_manifest as rt
from trainers.tools.tokenizer.retokenize_front_end import front_end

REPO = Path(__file__).resolve().parents[1]
TOOLS_DIR = REPO / "tools" / "tokenizer"  # the scripts users run

DEMO_GPT = yaml.safe_load((REPO / "checkpoints" / "demo.yaml").read_text())["gpt"]
DEMO_LIMITS = DataLimits(DEMO_GPT["max_text_tokens"], DEMO_GPT["max_mel_tokens"])
EXTENDED = 200  # the demo's 160 pieces + 40 Ethiopic ones
ETHIOPIC = [chr(c) for c in range(0x1200, 0x1218)]  # 24 syllables, as tests/test_extended_vocab.py uses


# ----------------------------------------------------------------------------- assets

def ethiopic_lines(seed: int, count: int) -> list[str]:
    """Lines of one fixed set of words, so any two calls use the same characters."""
    rng = random.Random(0)
    words = ["".join(rng.choice(ETHIOPIC) for _ in range(rng.randint(2, 4))) for _ in range(60)]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(count)]


def text_of(row: dict) -> str:
    return row["target_text"] if "target_text" in row else row["text"]  # paired / single-utterance form


def manifest_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def train_tokenizer(path: Path, sentences: list[str], **ids: int) -> Path:
    buffer = io.BytesIO()
    options = dict(bos_id=0, eos_id=1, unk_id=2, pad_id=-1) if not ids else ids
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buffer, model_type="bpe", vocab_size=160,
        hard_vocab_limit=False, character_coverage=1.0, num_threads=1, input_sentence_size=0,
        shuffle_input_sentence=False, minloglevel=2, **options)
    path.write_bytes(buffer.getvalue())
    return path


def extend(base: Path, out: Path) -> Path:
    corpus = write_rows(out.with_suffix(".jsonl"), [{"text": t} for t in ethiopic_lines(1, 400)])
    assert extend_bpe.main(["--base-model", str(base), "--manifests", str(corpus), "--output-model", str(out),
                            "--target-size", str(EXTENDED)]) == 0
    return out


@dataclass
class Assets:
    root: Path
    train: Path  # demo paired manifest
    val: Path  # demo single-utterance manifest
    demo_tokenizer: Path  # the demo's own (trained on its text upper-cased, as upstream's bpe.model is)
    upper_tokenizer: Path  # trained here on the same text upper-cased, independently of the demo
    extended: dict[str, Path]  # "demo" / "upper" -> that tokenizer extended with Ethiopic pieces
    ethiopic: Path  # single-utterance manifest in another folder, Ethiopic and mixed text


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    root = tmp_path_factory.mktemp("retokenize")
    demo = ensure_demo_assets(root / "demo", DemoCorpusSpec(model_dim=DEMO_GPT["model_dim"],
                                                           vocab_size=DEMO_GPT["number_text_tokens"],
                                                           num_codes=DEMO_GPT["start_mel_token"]))
    texts = [text_of(r) for m in (demo.train_manifest, demo.val_manifest) for r in manifest_rows(m)]
    upper = train_tokenizer(root / "upper.model", [t.upper() for t in texts])
    extended = {"demo": extend(demo.tokenizer, root / "demo_ext.model"),
                "upper": extend(upper, root / "upper_ext.model")}
    # The val lines with Ethiopic text, kept in another folder: their feature paths go "../demo/...".
    rows = []
    for i, (row, text) in enumerate(zip(manifest_rows(demo.val_manifest), ethiopic_lines(2, 48))):
        row = {k: (f"../demo/{v}" if k.endswith("_path") else v) for k, v in row.items()}
        row.pop("target_text", None)
        row["text"] = text + (" the cat ." if i % 4 == 0 else "")  # some lines mix in base-language words
        rows.append(row)
    ethiopic = write_rows(root / "am" / "am.jsonl", rows)
    assert {c for r in rows for c in r["text"] if c in ETHIOPIC} <= {c for t in ethiopic_lines(1, 400) for c in t}
    return Assets(root, demo.train_manifest, demo.val_manifest, demo.tokenizer, upper, extended, ethiopic)


def run(tokenizer: Path, manifests: list[Path], out: Path, *extra: object) -> int:
    return rt.main(["--tokenizer", str(tokenizer), "--manifests", *map(str, manifests), "--output-dir", str(out),
                    *map(str, extra)])


def ids_of(manifest: Path) -> list[list[int]]:
    """Each line's text ids, read through the manifest as the trainer resolves them."""
    result = []
    for row in manifest_rows(manifest):
        key, length = ("target_text_ids_path", "target_text_len") if "prompt_condition_path" in row \
            else ("text_ids_path", "text_len")
        array = np.load(manifest.parent / row[key], allow_pickle=False)
        assert array.dtype == np.int32 and array.ndim == 1 and len(array) == row[length]
        result.append(array.tolist())
    return result


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- front end

@pytest.mark.parametrize("text, expected", [
    ("", ""),
    ("a", "a"),  # one character: encoded as is, not upper-cased
    (" a\n", " a\n"),  # ... and not stripped
    ("ab", "AB"),
    ("  hello   world . ", "HELLO   WORLD ."),  # only the parts' ends are stripped
    ("你好world", "你 好 WORLD"),
    ("abc你def。x", "ABC 你 DEF 。 X"),
    ("한국어 ok", "한 국 어 OK"),  # Hangul syllables: U+A840-D7AF
    ("ｱｲ", "ｱ ｲ"),  # half-width katakana: U+FF65-FFDC
    ("a\u3000b", "A B"),  # U+3000 is in U+2E80-A4CF and is whitespace: its part is empty
    ("\U00020000x", "\U00020000 X"),
    ("ሰላም ለዓለም", "ሰላም ለዓለም"),  # Ethiopic: not CJK, no case
    ("straße", "STRASSE"),  # Python's full upper-casing, as upstream
    ("   ", ""),
])
def test_front_end_follows_indextts2(text: str, expected: str) -> None:
    assert front_end(text) == expected


# ----------------------------------------------------------------------------- the demo corpus

def test_the_demo_ids_are_reproduced(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo makes its ids as IndexTTS2 does (upper-cased text), so the tool gives the same ids."""
    assert run(assets.demo_tokenizer, [assets.train, assets.val], tmp_path) == 0
    for manifest in (assets.train, assets.val):
        assert ids_of(tmp_path / manifest.name) == ids_of(manifest)
    assert " unk=0 " in capsys.readouterr().out


def test_upstream_ids_for_every_demo_line_and_the_manifest_validates(assets: Assets, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """With a tokenizer trained on upper-cased text (as upstream's is), every line gets the ids of
    its upper-cased text, without <unk>; the rest of each line is unchanged and its paths name
    the same files; the new manifests pass the trainer's validation."""
    sp = spm.SentencePieceProcessor(model_file=str(assets.upper_tokenizer))
    out = tmp_path / "out"
    assert run(assets.upper_tokenizer, [assets.train, assets.val], out, "--config",
               REPO / "checkpoints" / "demo.yaml") == 0
    printed = capsys.readouterr().out
    assert "language normalisation SKIPPED" in printed and "WeTextProcessing" in printed
    for manifest in (assets.train, assets.val):
        rows, new_rows = manifest_rows(manifest), manifest_rows(out / manifest.name)
        texts = [text_of(r) for r in rows]
        # For this text (lower-case ASCII words, single spaces, no CJK) upstream's front end is str.upper().
        assert all(t == " ".join(t.split()) and t.isascii() and len(t) > 1 for t in texts)
        new_ids = ids_of(out / manifest.name)
        assert new_ids == [sp.encode(t.upper()) for t in texts]
        assert all(sp.unk_id() not in ids for ids in new_ids)
        assert f"lines={len(rows)} tokens={sum(map(len, new_ids))} unk=0 unk_rate=0.000000 lines_with_unk=0" in printed
        for row, new in zip(rows, new_rows):
            assert list(new) == list(row)  # same fields, same order
            for key, value in row.items():
                if key.endswith("_path"):
                    assert os.path.isabs(new[key]) is False
                    resolved = os.path.normpath(out / new[key])
                    if key in ("target_text_ids_path", "text_ids_path"):
                        assert Path(resolved).parent.parent == out / "text_ids"
                    else:
                        assert resolved == os.path.normpath(manifest.parent / value)
                elif key not in ("target_text_len", "text_len"):
                    assert new[key] == value
        original = load_manifests([ManifestSpec(manifest, None)], DEMO_LIMITS)
        samples = load_manifests([ManifestSpec(out / manifest.name, None)], DEMO_LIMITS)
        assert [(s.id, s.codes_path, s.condition_path, s.emo_vec_path, s.code_len) for s in samples] == \
            [(s.id, s.codes_path, s.condition_path, s.emo_vec_path, s.code_len) for s in original]
        assert [s.text_len for s in samples] == list(map(len, new_ids))


@pytest.mark.parametrize("base", ["demo", "upper"])
def test_extended_tokenizer_keeps_base_ids_and_gives_ethiopic_no_unk(assets: Assets, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     base: str) -> None:
    base_model = assets.demo_tokenizer if base == "demo" else assets.upper_tokenizer
    manifests = [assets.train, assets.val, assets.ethiopic]
    assert run(base_model, manifests, tmp_path / "base") == 0
    assert run(assets.extended[base], manifests, tmp_path / "ext") == 0
    printed = capsys.readouterr().out
    for manifest in (assets.train, assets.val):  # base-language lines: the same ids, byte for byte
        name = manifest.name
        assert ids_of(tmp_path / "ext" / name) == ids_of(tmp_path / "base" / name)
        assert snapshot(tmp_path / "ext" / "text_ids" / manifest.stem) == \
            snapshot(tmp_path / "base" / "text_ids" / manifest.stem)
    sp = spm.SentencePieceProcessor(model_file=str(assets.extended[base]))
    before, after = ids_of(tmp_path / "base" / "am.jsonl"), ids_of(tmp_path / "ext" / "am.jsonl")
    assert all(sp.unk_id() in ids for ids in before)
    ethiopic_only = [ids for ids, row in zip(after, manifest_rows(assets.ethiopic)) if "cat" not in row["text"]]
    assert ethiopic_only and all(sp.unk_id() not in ids for ids in ethiopic_only)
    assert all(i >= 160 or sp.id_to_piece(i) == "\u2581" for ids in ethiopic_only for i in ids)  # new pieces, spaces
    report = next(line for line in printed.splitlines() if line.startswith("report") and "ext/am.jsonl" in line)
    assert all(sp.unk_id() not in ids for ids in after)  # mixed lines too: both bases know the upper-cased words
    assert " unk=0 " in report
    # The Ethiopic manifest lives in another folder: its feature paths still name the demo's files.
    assert load_manifests([ManifestSpec(tmp_path / "ext" / "am.jsonl", None)], DEMO_LIMITS)


def test_running_twice_gives_the_same_bytes(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifests = [assets.train, assets.ethiopic]
    files = len(manifest_rows(assets.train)) + 1  # the ids of each line and the manifest
    assert run(assets.extended["upper"], manifests, tmp_path / "a") == 0
    assert f"(all {files} files new or changed)" in capsys.readouterr().out
    first = snapshot(tmp_path / "a")
    assert run(assets.extended["upper"], manifests, tmp_path / "a") == 0
    assert snapshot(tmp_path / "a") == first
    assert f"(none changed: all {files} files already held these bytes)" in capsys.readouterr().out
    damaged = tmp_path / "a" / "text_ids" / assets.train.stem / "0000001.npy"
    damaged.write_bytes(b"")
    assert run(assets.extended["upper"], manifests, tmp_path / "a") == 0
    assert f"(1 of {files} files new or changed; the other {files - 1} already held these bytes)" in \
        capsys.readouterr().out
    assert snapshot(tmp_path / "a") == first
    # Another output folder at the same depth: the same bytes, manifests included.
    assert run(assets.extended["upper"], manifests, tmp_path / "b") == 0
    assert snapshot(tmp_path / "b") == first
    # No temporary files are left behind.
    assert not [name for name in first if Path(name).name.startswith(".")]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_written_files_honour_the_umask(assets: Assets, tmp_path: Path, umask: int, mode: int) -> None:
    before = os.umask(umask)
    try:
        assert run(assets.extended["upper"], [assets.val], tmp_path / "out") == 0
    finally:
        os.umask(before)
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(written) == len(manifest_rows(assets.val)) + 1
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == {oct(mode)}


def test_single_character_and_text_field_rules(assets: Assets, tmp_path: Path) -> None:
    row = {k: v for k, v in manifest_rows(assets.val)[0].items() if k != "target_text"}
    row = {k: (str(assets.val.parent / v) if k.endswith("_path") else v) for k, v in row.items()}  # absolute
    rows = [dict(row, text="a"), dict(row, text=" the cat ."), dict(row, text="cat", target_text="cat"),
            {**{k: v for k, v in row.items() if k not in ("text_ids_path", "text_len")}, "text": "a dog ."}]
    manifest = write_rows(tmp_path / "in" / "m.jsonl", rows)
    assert run(assets.upper_tokenizer, [manifest], tmp_path / "out") == 0
    sp = spm.SentencePieceProcessor(model_file=str(assets.upper_tokenizer))
    ids = ids_of(tmp_path / "out" / "m.jsonl")
    assert ids[0] == sp.encode("a") and sp.unk_id() in ids[0]  # as is: lower-case, so <unk> here
    assert ids[1] == sp.encode("THE CAT .") and ids[2] == sp.encode("CAT")
    new = manifest_rows(tmp_path / "out" / "m.jsonl")
    assert new[3]["text_ids_path"] == "text_ids/m/0000004.npy" and new[3]["text_len"] == len(ids[3])  # added
    assert new[0]["codes_path"] == row["codes_path"]  # absolute paths stay as they are


# ----------------------------------------------------------------------------- refusals

def assert_refused(args: list[object], capsys: pytest.CaptureFixture[str], watched: Path, *needles: str) -> str:
    before = snapshot(watched)
    assert rt.main(list(map(str, args))) == rt.EXIT_REFUSED
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.startswith("error: ")
    assert "nothing written" in captured.err
    for needle in needles:
        assert needle in captured.err, captured.err
    assert snapshot(watched) == before, "nothing may be written or changed"
    return captured.err


def one_line_manifest(assets: Assets, folder: Path, **changes: object) -> Path:
    row = dict(manifest_rows(assets.train)[0])
    row = {k: (f"../demo/{v}" if k.endswith("_path") else v) for k, v in row.items()}
    good = dict(row)
    row.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del row[key]
    return write_rows(folder / "bad.jsonl", [good, row])


@pytest.mark.parametrize("changes, needle", [
    ({"target_text": None}, 'no text field ("target_text")'),
    ({"target_text": 5}, '"target_text" is 5 (int), not a string'),
    ({"target_text": ""}, "gives no ids"),
    ({"target_text": "  \t "}, "gives no ids"),
    ({"target_text": "the cat . " * 20}, "more than max_text_tokens 48"),
    ({"prompt_condition_path": None, "target_codes_path": None, "target_text_ids_path": None,
      "target_text_len": None, "target_code_len": None, "prompt_emo_vec_path": None}, "neither manifest form"),
])
def test_bad_line_is_refused_naming_file_and_line(assets: Assets, capsys: pytest.CaptureFixture[str],
                                                  changes: dict, needle: str) -> None:
    folder = assets.root / "bad_line"
    manifest = one_line_manifest(assets, folder, **changes)
    assert_refused(["--tokenizer", assets.upper_tokenizer, "--manifests", manifest, "--output-dir", folder / "out",
                    "--config", REPO / "checkpoints" / "demo.yaml"], capsys, folder, f"error: {manifest}:2: ", needle)


def test_length_limits(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = one_line_manifest(assets, tmp_path)
    args = ["--tokenizer", assets.upper_tokenizer, "--manifests", manifest, "--output-dir", tmp_path / "out"]
    longest = max(map(len, [spm.SentencePieceProcessor(model_file=str(assets.upper_tokenizer)).encode(
        r["target_text"].upper()) for r in manifest_rows(manifest)]))
    assert_refused([*args, "--max-text-tokens", longest - 1], capsys, tmp_path,
                   f"more than max_text_tokens {longest - 1} (--max-text-tokens)")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"gpt": {**DEMO_GPT, "max_text_tokens": longest - 1}}))
    assert_refused([*args, "--config", config], capsys, tmp_path, f"({config} gpt.max_text_tokens)")
    # The flag wins over the config.
    assert rt.main(list(map(str, [*args, "--config", config, "--max-text-tokens", longest]))) == 0
    # Text and codes together must fit the position tables, as the trainer checks.
    config.write_text(yaml.safe_dump({"gpt": {**DEMO_GPT, "max_mel_tokens": 20}}))
    assert_refused([*args, "--config", config], capsys, tmp_path, "positions", "drop or split this sample")


def test_output_that_would_replace_an_input_is_refused(assets: Assets, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    manifest = one_line_manifest(assets, tmp_path / "data")
    args = ["--tokenizer", assets.upper_tokenizer, "--manifests", manifest]
    assert_refused([*args, "--output-dir", tmp_path / "data" / "." ], capsys, tmp_path,
                   f"would replace the input {manifest}")
    # A feature file named by a line, where an id file would go.
    feature = tmp_path / "data" / "out" / "text_ids" / "bad" / "0000002.npy"
    feature.parent.mkdir(parents=True)
    np.save(feature, np.arange(3, dtype=np.int32))
    write_rows(manifest, [*manifest_rows(manifest)[:1], dict(manifest_rows(manifest)[1],
                                                             target_emo_vec_path="out/text_ids/bad/0000002.npy")])
    assert_refused([*args, "--output-dir", tmp_path / "data" / "out"], capsys, tmp_path, "would replace the input")
    # An id file that would land on a hard link to an input is that input.
    condition = tmp_path / "condition.npy"
    np.save(condition, np.zeros((32, DEMO_GPT["model_dim"]), dtype=np.float32))
    write_rows(manifest, [dict(row, prompt_condition_path=str(condition)) for row in manifest_rows(manifest)])
    linked = tmp_path / "linked" / "text_ids" / "bad" / "0000001.npy"
    linked.parent.mkdir(parents=True)
    os.link(condition, linked)
    assert_refused([*args, "--output-dir", tmp_path / "linked"], capsys, tmp_path,
                   f"would replace the input {condition}")
    # Two manifests of the same name would overwrite each other's output.
    other = one_line_manifest(assets, tmp_path / "other")
    assert_refused([*args, other, "--output-dir", tmp_path / "new"], capsys, tmp_path, "would both be written")
    assert_refused([*args, tmp_path / "data" / ".." / "data" / "bad.jsonl", "--output-dir", tmp_path / "new"],
                   capsys, tmp_path, "is given twice")


def test_tokenizer_and_flag_problems(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = one_line_manifest(assets, tmp_path / "data")
    out = ["--output-dir", tmp_path / "out"]
    assert_refused(["--tokenizer", tmp_path / "none.model", "--manifests", manifest, *out], capsys, tmp_path,
                   "none.model: no such file")
    vocab = tmp_path / "bpe.vocab"
    vocab.write_text("<unk>\t0\n")
    assert_refused(["--tokenizer", vocab, "--manifests", manifest, *out], capsys, tmp_path,
                   "is not a SentencePiece model")
    # SentencePiece's default ids put <unk> at 0, which IndexTTS2 reads as the start text token.
    texts = [r["target_text"].upper() for r in manifest_rows(assets.train)]
    default_ids = train_tokenizer(tmp_path / "default.model", texts, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    assert_refused(["--tokenizer", default_ids, "--manifests", manifest, *out], capsys, tmp_path,
                   "has '<unk>' as id 0", "start text token", "--bos_id=0 --eos_id=1 --unk_id=2")
    assert_refused(["--tokenizer", assets.upper_tokenizer, "--manifests", manifest, *out, "--max-text-tokens", 0],
                   capsys, tmp_path, "--max-text-tokens 0 must be at least 1")
    assert_refused(["--tokenizer", assets.upper_tokenizer, "--manifests", manifest, *out, "--config",
                    tmp_path / "none.yaml"], capsys, tmp_path, "none.yaml: no such file")
    (tmp_path / "nogpt.yaml").write_text("dataset: {}\n")
    assert_refused(["--tokenizer", assets.upper_tokenizer, "--manifests", manifest, *out, "--config",
                    tmp_path / "nogpt.yaml"], capsys, tmp_path, "no 'gpt' section")
    assert_refused(["--tokenizer", assets.upper_tokenizer, "--manifests", tmp_path / "none.jsonl", *out],
                   capsys, tmp_path, "none.jsonl: no such file")
    assert_refused(["--tokenizer", assets.upper_tokenizer, *out], capsys, tmp_path, "--manifests", "see --help")


def test_every_problem_is_listed_at_once(assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = manifest_rows(one_line_manifest(assets, tmp_path))
    manifest = tmp_path / "bad.jsonl"
    lines = [json.dumps(rows[0]), "{not json", "[1]", json.dumps(dict(rows[0], target_text="")),
             json.dumps(dict(rows[0], target_text="cut \ud83d")), json.dumps(dict(rows[0], target_text="ok \U0001F600"))]
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert_refused(["--tokenizer", assets.upper_tokenizer, "--manifests", manifest, "--output-dir", tmp_path / "o"],
                   capsys, tmp_path, f"{manifest}:2: invalid JSON", f"{manifest}:3: the line is a JSON list",
                   f"{manifest}:4: the text '' gives no ids", f"{manifest}:5: the line holds an unpaired surrogate",
                   "nothing written (4 problem(s))")


def test_a_failed_write_is_reported_without_a_traceback(assets: Assets, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "text_ids").write_text("a file where the ids folder goes")
    assert run(assets.upper_tokenizer, [assets.val], tmp_path / "out") == rt.EXIT_WRITE_FAILED
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and "manifests completed: none" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["text_ids"]  # no manifest, no temporary file


def test_script_runs_from_another_directory_and_help_names_the_skipped_normalisation(assets: Assets,
                                                                                     tmp_path: Path) -> None:
    script = TOOLS_DIR / "retokenize_manifest.py"
    done = subprocess.run([sys.executable, str(script), "--tokenizer", str(assets.upper_tokenizer), "--manifests",
                           str(assets.val), "--output-dir", "out"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=scaled(120))
    assert done.returncode == 0, done.stderr
    assert load_manifests([ManifestSpec(tmp_path / "out" / "val.jsonl", None)], DEMO_LIMITS)
    helped = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=scaled(120))
    assert helped.returncode == 0
    assert "normalisation SKIPPED" in helped.stdout and "WeTextProcessing" in helped.stdout
    bad = subprocess.run([sys.executable, str(script), "--tokenizer", "missing.model"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=scaled(120))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
