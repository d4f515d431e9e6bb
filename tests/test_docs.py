"""The docs stay a reference a newcomer can read: every raw file in docs/bench/data/ backs a document and every file
a document names is there, and so is every section the docs and source cite; README, BENCHMARKS and CHANGELOG keep
their line budgets and bench/ its script budget; no issue or session numbers and no paths outside the repository in
the docs or the source."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "bench" / "data"
LINE_LIMITS = {"README.md": 250, "BENCHMARKS.md": 300, "CHANGELOG.md": 150}
MAX_DATA_FILES = 60
MAX_BENCH_SCRIPTS = 12

# a raw file as documents name it: by its path from the repository root, or from docs/bench/ as a relative link
DATA_NAME = re.compile(r"docs/bench/data/([\w.\-/]*[\w/])")
RELATIVE_LINK = re.compile(r"\]\(data/([^)\s]+)\)")
TRACKER_NUMBER = re.compile(r"\b(?:session|issue)s?\s*#?\d+(?![.\d])", re.IGNORECASE)
OUTSIDE_PATH = re.compile(r"/work/|/home/|(?<![\w/])(?:\.\./)+shared\b|(?<![\w/.])shared/(?:notes|tools|paper)/")
# a section as the docs and source cite it: `docs/bench/layer.md, "Host time"` (the quote may run on over lines)
SECTION_CITE = re.compile(r'((?:docs/[\w/.-]+|BENCHMARKS|README)\.md)`?,\s*(?:#\s*)?"([^"]+)"')
SOURCE_SUFFIXES = {".py", ".md", ".cu", ".cuh", ".cpp", ".toml", ".sh", ".cfg", ".in"}
RAW_TEXT_SUFFIXES = {".md", ".txt", ".log", ".json", ".jsonl"}


def documents() -> list[Path]:
    """The documents that may back a raw file: README, BENCHMARKS and docs/**/*.md (the raw files excluded)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if DATA not in p.parents)
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md"] + docs


def data_files() -> list[str]:
    return sorted(p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.is_file())


def named_data(path: Path) -> set[str]:
    text = path.read_text()
    names = set(DATA_NAME.findall(text))
    if path.parent == DATA.parent:
        names |= set(RELATIVE_LINK.findall(text))
    return {n.rstrip(".") for n in names}


def repository_text_files() -> list[Path]:
    """Docs and source: everything tracked-looking outside .git and the raw files, except this file (it spells the
    patterns it looks for)."""
    files = [ROOT / "CHANGELOG.md", *documents(), ROOT / ".ci" / "run"]
    for folder in ("llm_surgery", "bench", "recipes", "tests", "kernels"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()]
    files += [p for p in ROOT.glob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()]
    return sorted({p for p in files if p.exists() and p.resolve() != Path(__file__).resolve()})


def test_every_raw_file_is_named_by_a_document_and_every_named_file_exists():
    named = {}
    for doc in documents() + [ROOT / "CHANGELOG.md"]:
        for name in named_data(doc):
            named.setdefault(name, doc.relative_to(ROOT).as_posix())
    missing = sorted(f"{doc} names docs/bench/data/{n}" for n, doc in named.items() if not (DATA / n).is_file())
    assert not missing, "documents name raw files that are not there (or name a folder, not its files):\n" + \
        "\n".join(missing)
    backed = set().union(*(named_data(d) for d in documents()))
    orphans = [f for f in data_files() if f not in backed]
    assert not orphans, ("raw files no document names (name them where their table is, or `git rm` them):\n"
                         + "\n".join(orphans))


def flat(text: str) -> str:
    """Text with its line breaks, indents and comment marks folded into single spaces, lower case."""
    return " ".join(re.sub(r"\n\s*#", " ", text).split()).lower()


def test_every_cited_section_is_in_its_document():
    stale = [f"{p.relative_to(ROOT)} cites {target}, \"{flat(section)}\""
             for p in repository_text_files()
             for target, section in SECTION_CITE.findall(p.read_text(errors="replace"))
             if not (ROOT / target).is_file() or flat(section) not in flat((ROOT / target).read_text())]
    assert not stale, "sections cited that their document no longer has:\n" + "\n".join(stale)


def test_budgets():
    for name, limit in LINE_LIMITS.items():
        lines = len((ROOT / name).read_text().splitlines())
        assert lines <= limit, f"{name}: {lines} lines, budget {limit}"
    assert len(data_files()) <= MAX_DATA_FILES, f"docs/bench/data: {len(data_files())} files, budget {MAX_DATA_FILES}"
    scripts = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert len(scripts) <= MAX_BENCH_SCRIPTS, f"bench/: {len(scripts)} scripts, budget {MAX_BENCH_SCRIPTS}: {scripts}"


@pytest.mark.parametrize("pattern, what", [(TRACKER_NUMBER, "an issue or session number"),
                                           (OUTSIDE_PATH, "a path outside the repository")])
def test_docs_and_source_stand_alone(pattern, what):
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
            for p in repository_text_files()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not hits, f"{what} in the docs or the source:\n" + "\n".join(hits)


def test_raw_files_name_no_path_outside_the_repository():
    hits = [f"docs/bench/data/{f}" for f in data_files()
            if Path(f).suffix in RAW_TEXT_SUFFIXES and OUTSIDE_PATH.search((DATA / f).read_text(errors="replace"))]
    assert not hits, "raw files naming a path outside the repository:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_look_for():
    assert TRACKER_NUMBER.search("as Issue 41 asked") and TRACKER_NUMBER.search("in sess" "ion 12")
    assert not TRACKER_NUMBER.search("the CPU's time to issue 4.089 ms of kernels")
    for path in ("see /wo" "rk/shared/notes/x.md", "../" "shared/tools/bench_layers.py", "the team's sha" "red/tools/x"):
        assert OUTSIDE_PATH.search(path), path
    assert not OUTSIDE_PATH.search("shared memory; tests/shared_fixtures.py")
    assert DATA_NAME.findall("raw `docs/bench/data/a_b-1.md`, and docs/bench/data/c.json.") == ["a_b-1.md", "c.json"]
    assert RELATIVE_LINK.findall("![plot](data/x_2026.png)") == ["x_2026.png"]
    cite = "(on small shapes; `docs/bench/layer.md`, \"Where the\n    # GPU time goes\")"
    assert [(t, flat(s)) for t, s in SECTION_CITE.findall(cite)] == [("docs/bench/layer.md", "where the gpu time goes")]
