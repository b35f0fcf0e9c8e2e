"""Make the text ids of training manifests with a (new or extended) SentencePiece model, or with IndexTTS-2.5's
.tiktoken file (below, "IndexTTS-2.5").

    python tools/tokenizer/retokenize_manifest.py --tokenizer checkpoints/bpe_am.model \\
        --manifests data/am_train.jsonl data/am_val.jsonl --output-dir data/am_ids \\
        --config checkpoints/config.yaml

For each manifest line the text is turned into ids the way IndexTTS2 inference does it (below)
and saved as a 1-D int32 .npy without start/stop tokens, as the usual preprocessing saves
them. A NEW manifest of the same file name is written into --output-dir, pointing at them:

    OUT/<manifest file name>                     the new manifest
    OUT/text_ids/<manifest name without suffix>/<line number>.npy

Manifest lines: the paired form (prompt_condition_path + target_codes_path) takes its text from
"target_text" and gets "target_text_ids_path" / "target_text_len"; the single-utterance form
(text_ids_path, codes_path, condition_path, ...) takes "text" (or "target_text" where a line
has no "text") and gets "text_ids_path" / "text_len". The form is recognised as the trainer
does (trainers/manifest.py); the ids fields are replaced where present, added where not.
Every other field keeps its value and place; the JSON is re-serialised (UTF-8, one object per
line, blank lines dropped). Paths: every other string field whose name ends in "_path" is
resolved from the input manifest's folder, as the trainer does, and rewritten relative to
--output-dir, so it still names the same file (absolute paths stay absolute). Other fields
are not touched, so a path kept in a field not named "*_path" must be absolute.

Text front end, as IndexTTS2's TextTokenizer.encode applies it before SentencePiece:
  1. empty text gives no ids; text that is a single character once stripped is encoded as is
     (no upper-casing);
  2. [SKIPPED] the language normaliser (TextNormalizer: WeTextProcessing for English and
     Chinese - numbers, dates, contractions, pinyin, punctuation maps - and the Japanese /
     Amharic rules of community forks). It is not available here and is not imitated: write the
     manifest text as the normaliser would leave it (numbers in words, ...), or the ids made
     here differ from what inference makes for the same text;
  3. the CJK pre-tokeniser: the line is stripped, split around every character of U+1100-11FF,
     U+2E80-A4CF, U+A840-D7AF, U+F900-FAFF, U+FE30-FE4F, U+FF65-FFDC, U+20000-2FFFF (each
     becomes its own word), each part stripped and UPPER-CASED, parts joined by single spaces;
  4. SentencePiece encoding of the result.

Refused (status 2, nothing written), every problem listed as "file:line: what; what to do":
a line that is not a JSON object in a known form, a missing or non-string text field, a single
line whose "text" and "target_text" differ, text that gives no ids, more ids than --max-text-tokens (default: gpt.max_text_tokens of --config),
a sample longer than the model's position tables (with --config), a tokenizer that can emit the
start/stop text ids (0 and 1, or gpt.start/stop_text_token of --config: they must be control
pieces such as <s> and </s>), an unreadable tokenizer or config, an output that would replace
an input. <unk> is reported (count, rate, lines, the characters without a piece), not refused;
a tokenizer with lower-case letters and no upper-case ones (trained on text that was not
upper-cased, so every Latin letter becomes <unk> after IndexTTS2's upper-casing) is warned about.

Writing: each file goes to a temporary file in its folder and is renamed into place; the ids
of a manifest are written before the manifest, so a manifest never names a missing file; an
.npy that already holds the same bytes is left alone. Running the tool twice gives the same
bytes. Files of an earlier run that the new manifest no longer names are not removed.

IndexTTS-2.5: with --tokenizer upstream's .tiktoken file, each line is encoded in its language (its "language"
field, else --language, which is then written into the line) as infer_v2_5 does it
(trainers/families/indextts25/front_end.py: punctuation map, casing by language, pronunciation annotations,
the "<|xx|> " prefix), ids 0 and 1 dropped as the trainer drops them; its normalisers (WeTextProcessing, nemo) and
the Japanese morpheme split are SKIPPED and said so. The lines are the 2.5 .npy forms (paired:
target_text_ids_path, target_codes_path, prompt_spk_emb_path; single: text_ids_path, codes_path, spk_emb_path). A
--config of IndexTTS2 with a .tiktoken tokenizer, or the reverse, is refused.

Exit status: 0 written, 2 refused (nothing written), 1 writing failed part-way (disk full,
permissions: the message says which manifests were completed).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from trainers.console_streams import quiet_broken_pipes
from trainers.tools.tokenizer.retokenize_errors import Refusal, WriteFailure
from trainers.tools.tokenizer.retokenize_front_end import (
    APPLIED_FRONT_END, SKIPPED_NORMALISATION, TiktokenLines, Tokenizer, load_any_tokenizer,
)
from trainers.tools.tokenizer.retokenize_limits import Limits, resolve_limits
from trainers.tools.tokenizer.retokenize_lines import Plan, Report, encode_lines, read_manifest, summarise
from trainers.tools.tokenizer.retokenize_outputs import IDS_DIR, output_problems, write_plan

EXIT_OK, EXIT_WRITE_FAILED, EXIT_REFUSED = 0, 1, 2
MAX_LISTED_PROBLEMS = 30
MAX_LISTED_CHARS = 20


@dataclass(frozen=True)
class Config:  # the command line, one field per flag
    tokenizer: Path
    manifests: list[Path]
    output_dir: Path
    config: Path | None
    language: str | None  # IndexTTS-2.5: the language of lines without a "language" field
    max_text_tokens: int | None


def plan_all(cfg: Config) -> tuple[Tokenizer | TiktokenLines, Limits, list[Plan]]:
    """Read, encode and check everything; raise Refusal listing every problem."""
    limits = resolve_limits(cfg.config, cfg.max_text_tokens)
    tok = load_any_tokenizer(cfg.tokenizer, limits.start, limits.stop)
    limits = model_of(tok, limits, cfg)
    plans, problems = [], []
    for manifest in cfg.manifests:
        lines, found = read_manifest(manifest)
        problems += found
        problems += encode_lines(tok, limits, manifest, lines, cfg.language)
        output = cfg.output_dir / manifest.name
        plans.append(Plan(manifest, output, lines, summarise(tok, manifest, output, lines)))
    if problems:
        raise Refusal(problems)
    extra = [cfg.tokenizer] + ([cfg.config] if cfg.config else [])
    problems = output_problems(plans, cfg.output_dir, extra)
    if problems:
        raise Refusal(problems)
    return tok, limits, plans


def model_of(tok: Tokenizer | TiktokenLines, limits: Limits, cfg: Config) -> Limits:
    """The limits of the tokenizer's model (IndexTTS-2.5: a 3-position prefix); a --config of the other model, or
    of another vocabulary size than a 2.5 tokenizer, is refused; --language is for 2.5 alone."""
    from trainers.families.indextts25.model import PREFIX_LEN

    is25 = tok.family == "indextts25"
    if cfg.language is not None and not is25:
        raise Refusal([f"--language {cfg.language}: IndexTTS2's text ids carry no language; it is for an "
                       "IndexTTS-2.5 --tokenizer (its .tiktoken file)"])
    if cfg.config is None:
        return replace(limits, prefix=PREFIX_LEN) if is25 else limits
    if is25 != (limits.version == "2.5"):
        model, other = ("IndexTTS-2.5", "IndexTTS2 (2.0)") if is25 else ("IndexTTS2 (2.0)", "IndexTTS-2.5")
        raise Refusal([f"--tokenizer {cfg.tokenizer} is {model}'s, but --config {cfg.config} is a config of {other}; "
                       "pass the tokenizer and config of the model you train"])
    if is25 and limits.number_text_tokens not in (None, tok.size()):
        raise Refusal([f"--tokenizer {cfg.tokenizer} has {tok.size()} ids, but --config {cfg.config} says "
                       f"gpt.number_text_tokens {limits.number_text_tokens}; IndexTTS-2.5's must be equal"])
    return replace(limits, prefix=PREFIX_LEN) if is25 else limits


def report_text(report: Report) -> list[str]:
    lines = [f"report {report.manifest} -> {report.output}: lines={report.lines} tokens={report.tokens} "
             f"unk={report.unk} unk_rate={report.unk_rate:.6f} lines_with_unk={report.lines_with_unk} "
             f"byte_tokens={report.byte_tokens} max_text_len={report.max_text_len}"]
    if report.lines_with_unk:
        chars = " ".join(repr(c) for c in report.unknown_chars[:MAX_LISTED_CHARS])
        more = len(report.unknown_chars) - MAX_LISTED_CHARS
        lines.append(f"  first line with <unk>: {report.first_line_with_unk}; characters the tokenizer has no piece "
                     f"for: {chars or '-'}" + (f" and {more} more" if more > 0 else ""))
    return lines


def retokenize(cfg: Config) -> list[Report]:
    """Check everything, then write; raise Refusal (nothing written) or WriteFailure."""
    tok, limits, plans = plan_all(cfg)
    print(tok.applied)
    print(tok.skipped)
    print(f"tokenizer {cfg.tokenizer}: {tok.size()} pieces; max_text_tokens "
          f"{limits.max_text_tokens if limits.max_text_tokens is not None else 'not checked'} ({limits.source})")
    if tok.looks_lower_case():
        print(f"warning: --tokenizer {cfg.tokenizer} has lower-case letters and no upper-case ones, but IndexTTS2 "
              "upper-cases text before tokenizing, so Latin letters become <unk> (here and at inference). Use a "
              "tokenizer trained on upper-cased text, as the official bpe.model is", file=sys.stderr)
    done: list[str] = []
    for plan in plans:
        try:
            written = write_plan(plan, cfg.output_dir)
        except OSError as exc:
            finished = ", ".join(done) or "none"
            raise WriteFailure(f"cannot write {exc.filename or plan.output}: {exc.strerror or exc}; manifests "
                               f"completed: {finished}; {plan.output} was not written (its ids may be partly "
                               "written); fix the cause and run the same command again") from None
        done.append(str(plan.output))
        for line in report_text(plan.report):
            print(line)
        ids_dir = cfg.output_dir / IDS_DIR / plan.manifest.stem
        print(f"  wrote {plan.output} and {len(plan.lines)} id files under {ids_dir} "
              f"({rewritten_text(written, len(plan.lines) + 1)})")
    if any(p.report.lines_with_unk for p in plans):
        print("warning: some lines hold <unk> ids (see the report lines); the model learns nothing useful from "
              "them: extend the tokenizer (tools/tokenizer/extend_bpe.py) or fix the text", file=sys.stderr)
    return [p.report for p in plans]


def rewritten_text(written: int, total: int) -> str:
    """How many of a manifest's files were written: a file that already held the same bytes is left alone."""
    if written == total:
        return f"all {total} files new or changed"
    if written == 0:
        return f"none changed: all {total} files already held these bytes"
    return f"{written} of {total} files new or changed; the other {total - written} already held these bytes"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise Refusal([f"{message} (see --help)"])


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = _Parser(prog="retokenize_manifest.py", description=doc.split("\n\n")[0],
                epilog="\n\n".join([
                    f"Writes OUT/<manifest file name> and OUT/{IDS_DIR}/<manifest name without suffix>/<line>.npy "
                    "(1-D int32, no start/stop tokens). The other *_path fields of each line are rewritten relative "
                    "to OUT (absolute ones are kept); all other fields keep their values.",
                    APPLIED_FRONT_END + ".", SKIPPED_NORMALISATION + ".",
                    "Exit status: 0 written; 2 refused, nothing written (every problem is listed as file:line); "
                    "1 a write failed part-way."]),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="SentencePiece .model to make the ids with (the one you will pass to the trainer)")
    p.add_argument("--manifests", type=Path, nargs="+", required=True,
                   help="JSONL manifests (paired or single-utterance form); never modified")
    p.add_argument("--output-dir", type=Path, required=True,
                   help=f"folder for the new manifests (same file names) and their ids ({IDS_DIR}/...); "
                        "it must not hold an input")
    p.add_argument("--config", type=Path,
                   help="IndexTTS2 config.yaml: its gpt.max_text_tokens is the default limit, gpt.max_mel_tokens "
                        "checks the sample fits, gpt.start/stop_text_token are the ids text must not produce")
    p.add_argument("--language", help="IndexTTS-2.5 (a .tiktoken --tokenizer): the language code of lines without a "
                                      "\"language\" field (written into them); it picks the <|xx|> prefix and casing")
    p.add_argument("--max-text-tokens", type=int,
                   help="refuse lines with more ids than this (default: gpt.max_text_tokens of --config; without "
                        "either, no limit is checked)")
    return p


def parse_config(argv: Sequence[str] | None) -> Config:
    return Config(**vars(build_parser().parse_args(argv)))


@quiet_broken_pipes()
def main(argv: Sequence[str] | None = None) -> int:
    try:
        retokenize(parse_config(argv))
    except Refusal as exc:
        for problem in exc.problems[:MAX_LISTED_PROBLEMS]:
            print(f"error: {problem}", file=sys.stderr)
        if len(exc.problems) > MAX_LISTED_PROBLEMS:
            print(f"error: ... and {len(exc.problems) - MAX_LISTED_PROBLEMS} more problems", file=sys.stderr)
        print(f"error: nothing written ({len(exc.problems)} problem(s))", file=sys.stderr)
        return EXIT_REFUSED
    except WriteFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    return EXIT_OK
