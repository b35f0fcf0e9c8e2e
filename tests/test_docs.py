"""The user docs cannot rot unnoticed: every relative link and anchor resolves, every test, benchmark
and source file they name exists, the flag table lists each of the trainer's flags exactly once, and
the README stays short. Reads files only (no trainer runs), so it takes well under a second."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FLAGS_DOC = REPO / "docs" / "flags.md"
DOCS = [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
USER_DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250
# Named in docs/data_preparation.md as files of the community trainer, which this repository lacks.
ELSEWHERE = {"tools/preprocess_data.py", "tools/generate_gpt_pairs.py"}


def prose(path: Path) -> str:
    """The file without its fenced code blocks (a `# comment` there is no heading, a `](` no link)."""
    return re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: link markup dropped, lower case, punctuation but - and _
    removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for line in prose(path).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            slug = anchor(match.group(1))
            found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")  # GitHub numbers repeats
            seen[slug] += 1
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path))  # `[a](b)` in backticks is an example, not a link
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto: are not checked here


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        file, _, fragment = target.partition("#")
        resolved = (doc.parent / file).resolve() if file else doc
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and (resolved.suffix != ".md" or fragment not in anchors(resolved)):
            broken.append(f"{target}: no heading #{fragment} in {resolved.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_the_anchor_rule_is_githubs() -> None:
    assert anchor("Checkpoint safety") == "checkpoint-safety"
    assert anchor("`--resume auto` past damaged checkpoints") == "--resume-auto-past-damaged-checkpoints"
    assert anchor("A worker that ends with -6 (SIGABRT)") == "a-worker-that-ends-with--6-sigabrt"
    assert anchor("Saves, in the background too") == "saves-in-the-background-too"


def named_paths(text: str) -> set[str]:
    return set(re.findall(r"\b(?:tests|benchmarks|trainers|tools)/[\w/.-]*\w", text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_file_exists(doc: Path) -> None:
    missing = sorted(p for p in named_paths(doc.read_text(encoding="utf-8")) - ELSEWHERE if not (REPO / p).exists())
    assert not missing, f"{doc.relative_to(REPO)} names files that do not exist: {missing}"


def code_map_files() -> set[str]:
    """The files of the code map in docs/architecture.md: a cell names a file by its path, then
    others of the same folder by their names alone."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed, folder = set(), ""
    for line in text[text.index("## Code map"):].splitlines():
        for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]) if line.startswith("| `") else ():
            folder = str(Path(name).parent) if "/" in name else folder
            listed.add(name if "/" in name else f"{folder}/{name}")
    return listed


def test_the_code_map_names_every_module_and_only_existing_ones() -> None:
    modules = {str(p.relative_to(REPO)) for pattern in ("trainers/**/*.py", "tools/**/*.py", "tools/**/*.sh")
               for p in REPO.glob(pattern) if p.name != "__init__.py"}
    listed = code_map_files()
    assert not listed - modules, f"the code map names files that do not exist: {sorted(listed - modules)}"
    assert not modules - listed, f"add these to the code map in docs/architecture.md: {sorted(modules - listed)}"


def defined_names(path: Path) -> set[str]:
    return set(re.findall(r"^\s*(?:async )?def (\w+)", path.read_text(encoding="utf-8"), flags=re.M))


def test_every_named_test_exists() -> None:
    """A claim names the test that proves it: `tests/test_x.py::name`, `::name` after such a path,
    or a bare `test_name`. A renamed or deleted test must take its claim's text along."""
    everywhere = set().union(*(defined_names(p) for p in (REPO / "tests").glob("*.py")))
    missing = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for file, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", text):
            if name not in defined_names(REPO / file):
                missing.append(f"{doc.name}: {file}::{name}")
        for name in re.findall(r"`(?:::)?(test_\w+)`", text):
            if name not in everywhere:
                missing.append(f"{doc.name}: {name}")
    assert not missing, missing


def flag_rows(path: Path) -> dict[str, str]:
    """Each flag of the table under the path's "Flags" heading, mapped to its row."""
    text = path.read_text(encoding="utf-8")
    table = re.search(r"^#+ Flags\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert table, f"{path.name} has no Flags section"
    rows = {}
    for line in table.group(1).splitlines():
        if line.startswith("| `--"):
            for flag in re.findall(r"--[a-z0-9-]+", line.split(" | ")[0]):
                assert flag not in rows, f"{path.name}: {flag} is listed twice"
                rows[flag] = line
    return rows


def test_the_flag_table_lists_every_flag_of_the_trainer_once() -> None:
    from trainers.config.flags import build_parser

    known = {s for action in build_parser()._actions for s in action.option_strings} - {"-h", "--help"}
    listed = flag_rows(FLAGS_DOC)
    assert set(listed) == known, (sorted(known - set(listed)), sorted(set(listed) - known))


def _listed(settings: list) -> str:
    return ", ".join(f"`{s.flag}`" if s.flag else f"`{s.name}` (saved only)" for s in settings)


def test_the_ranges_and_resume_tables_are_the_declarations() -> None:
    """docs/flags.md's tables of ranges (a row per range, in declaration order) and of what a resume does with each
    saved setting are generated from the settings' declarations: paste the expected text between the markers."""
    from trainers.config.declare import Resume, declared
    from trainers.config.flags import CommandLine
    from trainers.config.settings import TrainConfig

    rows: dict[str, list] = {}
    for s in (s for cls in (TrainConfig, CommandLine) for s in declared(cls) if s.bound):
        rows.setdefault(("whole number " if s.bound.kind is int else "") + s.bound.range_text(), []).append(s)
    ranges = ["| settings | accepted |", "|---|---|", *(f"| {_listed(v)} | {k} |" for k, v in rows.items())]
    resume = ["| on resume | settings |", "|---|---|",
              *(f"| {r.value} | {_listed([s for s in declared(TrainConfig) if s.resume is r])} |" for r in Resume)]
    generated = re.findall(r"<!-- generated[^\n]*-->\n(.*?)\n<!-- end generated -->", FLAGS_DOC.read_text(), re.S)
    expected = ["\n".join(ranges), "\n".join(resume)]
    assert generated == expected, "docs/flags.md's generated tables are now:\n\n" + "\n\n".join(expected)


def test_the_readmes_common_flags_are_rows_of_the_full_table() -> None:
    """The README lists the common flags with the same words as docs/flags.md, so the two cannot
    drift apart (links aside: they are relative to each file)."""
    full = flag_rows(FLAGS_DOC)
    common = flag_rows(README)
    assert len(common) >= 10
    strip = lambda row: re.sub(r"\]\([^)]*\)", "]", row)  # noqa: E731
    assert {f: strip(r) for f, r in common.items()} == {f: strip(full[f]) for f in common}


def test_the_readme_stays_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to docs/"


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_user_docs_hold_no_issue_numbers(doc: Path) -> None:
    assert not re.findall(r"\bissues? #?\d+", doc.read_text(encoding="utf-8"), flags=re.I)
