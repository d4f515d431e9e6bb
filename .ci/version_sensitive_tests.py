"""Print the test files that use transformers, Accelerate, PEFT or datasets, one a line: .ci/run runs them again
under the lowest releases pyproject.toml allows. A file is listed when, following imports (at any depth of the code,
lazy ones too) through this package, the tests' helper modules and the scripts the tests run (a "bench/x.py" or
"-m llm_surgery.x" in a string), it reaches one of those libraries or names one in a string (a module patched by
name). Read from the sources, so a new test file is picked up without editing .ci/run."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = {"transformers", "accelerate", "peft", "datasets"}
OURS = {"llm_surgery"} | {p.stem for p in (ROOT / "tests").glob("*.py")}   # the package and the tests' helpers
SCRIPT_DIRS = ("bench", "recipes", "tests")


def _source(name: str) -> tuple[Path, str] | None:
    """The file of a module of ours and its package, or None."""
    parts = name.split(".")
    for base in (ROOT, ROOT / "tests"):
        for path, pkg in ((base.joinpath(*parts).with_suffix(".py"), ".".join(parts[:-1])),
                          (base.joinpath(*parts, "__init__.py"), name)):
            if path.is_file():
                return path, pkg
    return None


def _script(word: str) -> Path | None:
    """A script a string names by path ("bench/box_repro.py") or by file name in a script folder."""
    if not word.endswith(".py"):
        return None
    if (ROOT / word).is_file():
        return ROOT / word
    return next((p for d in SCRIPT_DIRS if (p := ROOT / d / Path(word).name).is_file()), None)


@functools.lru_cache(maxsize=None)
def _uses(path: Path, pkg: str) -> frozenset:
    """Module names `path` imports anywhere in its code or a string of its names whole (our modules, the
    libraries'), and the scripts a string names."""
    found: set = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + [base] * bool(base))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split() == [node.value]:
            if node.value.split(".")[0] in LIBRARIES | OURS:   # a module named in a string (not in prose)
                found.add(node.value)
            elif script := _script(node.value):
                found.add(script)
    return frozenset(found)


def _loads(item) -> set:
    """What loading a module name or a script loads next: its package, its imports, the scripts it names."""
    if isinstance(item, Path):
        return set(_uses(item, ""))
    found = _source(item)
    return ({item.rpartition(".")[0]} - {""}) | (set(_uses(*found)) if found else set())


def uses_a_library(test: Path) -> bool:
    """Whether anything `test` loads, directly or through what that loads, is one of LIBRARIES."""
    todo, seen = [test], {test}
    while todo:
        item = todo.pop()
        if isinstance(item, str) and item.split(".")[0] in LIBRARIES:
            return True
        if isinstance(item, Path) or item.split(".")[0] in OURS:
            new = _loads(item) - seen
            seen |= new
            todo.extend(new)
    return False


if __name__ == "__main__":
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    sys.stdout.write("".join(f"{t.relative_to(ROOT)}\n" for t in tests if uses_a_library(t)))
