"""docs/architecture.md's module map ("Where the code lives") matches src/kvcomm.

The map is one fenced block: an entry line names a module (`name.py`), a package
(`name/`) or either (`name`), indented two spaces per level under its package; the
lines indented further continue the entry's description. Every entry must exist, and
every module and package under src/kvcomm must be an entry of its own or be named (by
its stem, as a word) in its package's description.

Every test file the documentation names (`tests/....py`, optionally `::test_name`, in
README.md and docs/) exists and holds that test, and no blank "(`tests/`)" is left.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import ROOT

SRC = ROOT / "src" / "kvcomm"
ENTRY_INDENT = 12  # an entry's name starts left of this column; descriptions right of it


def _map_lines() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Where the code lives", 1)[1]
    block = section.split("```", 2)[1]
    lines = block.splitlines()[1:]  # drop the fence's info string line
    assert lines and lines[0].strip() == "src/kvcomm/", lines[:1]
    return lines[1:]


def _entries() -> dict[Path, str]:
    """Each entry's path (relative to src/kvcomm, as written) -> its description."""
    entries: dict[Path, str] = {}
    stack: list[tuple[int, Path]] = []
    current: Path | None = None
    for line in _map_lines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent < ENTRY_INDENT:
            name, _, desc = line.strip().partition(" ")
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else Path()
            current = parent / name.rstrip("/")
            entries[current] = desc.strip()
            stack.append((indent, current))
        else:
            assert current is not None, line
            entries[current] += " " + line.strip()
    return entries


def _resolve(rel: Path) -> Path | None:
    for p in (SRC / rel, SRC / rel.with_suffix(".py") if not rel.suffix else None):
        if p is not None and p.exists():
            return p
    return None


def test_every_listed_module_exists():
    missing = [str(rel) for rel in _entries() if _resolve(rel) is None]
    assert not missing, f"the module map lists what src/kvcomm lacks: {missing}"


def _modules(package: Path) -> list[Path]:
    """The package's modules (stem.py, __init__ aside) and subpackages."""
    found = []
    for p in sorted(package.iterdir()):
        if p.is_dir() and (p / "__init__.py").exists():
            found.append(p)
        elif p.suffix == ".py" and p.name != "__init__.py":
            found.append(p)
    return found


def test_every_module_is_in_the_map():
    entries = _entries()
    listed = {_resolve(rel) for rel in entries}
    unlisted = []

    def visit(package: Path, desc: str | None) -> None:
        for mod in _modules(package):
            if mod in listed or mod.with_suffix("") in listed:
                if mod.is_dir():
                    rel = mod.relative_to(SRC)
                    visit(mod, entries.get(rel, entries.get(Path(str(rel) + "/"))))
                continue
            named = desc is not None and re.search(
                rf"(?<![\w.]){re.escape(mod.stem)}(?![\w])", desc
            )
            if not named:
                unlisted.append(str(mod.relative_to(SRC)))
            elif mod.is_dir():
                visit(mod, desc)

    top = [m for m in _modules(SRC)]
    for mod in top:
        if mod not in listed:
            unlisted.append(str(mod.relative_to(SRC)))
        elif mod.is_dir():
            visit(mod, entries[mod.relative_to(SRC)])
    assert not unlisted, f"src/kvcomm modules the module map does not name: {unlisted}"


TEST_REF = re.compile(r"tests/[\w./-]+?\.py(?:::(\w+))?")


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_test_the_docs_name_exists():
    missing = []
    for doc in _doc_files():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{n}"
            if "(`tests/`)" in line:
                missing.append(f"{where}: a blank (`tests/`) reference")
            for m in TEST_REF.finditer(line):
                path = ROOT / m.group(0).split("::")[0]
                if not path.is_file():
                    missing.append(f"{where}: {m.group(0)} (no such file)")
                elif m.group(1) and not re.search(
                    rf"^(?:async )?def {m.group(1)}\(", path.read_text(), re.M
                ):
                    missing.append(f"{where}: {m.group(0)} (no such test)")
    assert not missing, "the docs name tests that do not exist:\n" + "\n".join(missing)
