"""docs/design.md's package map names every package and module on disk, and nothing
that is not there; the rest of the page names no file that is gone."""

from __future__ import annotations

import ast
import re

from tests.test_layout import ROOT, source_files

DESIGN = ROOT / "docs" / "design.md"
SECTION = "## The package map"
CELL = re.compile(r"(?<!\\)\|")  # a cell's border; "\|" is a "|" inside a cell
TICKED = re.compile(r"`([^`]+)`")


def _tables() -> dict[str, list[list[str]]]:
    """The map's tables by their first header (``package``, ``module``): each row's
    cells, the header and its rule left out."""
    text = DESIGN.read_text()
    assert SECTION in text, f"docs/design.md has no {SECTION!r} section"
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    tables: dict[str, list[list[str]]] = {}
    rows: list[list[str]] | None = None
    for line in text[start:end if end != -1 else None].splitlines():
        if not line.startswith("|"):
            rows = None
            continue
        cells = [c.strip() for c in CELL.split(line.strip()[1:-1])]
        if rows is None:
            rows = tables.setdefault(cells[0], [])
        elif not set(line) <= set("|-: "):
            rows.append(cells)
    return tables


def _first_sentence(path: str) -> str:
    """The start of a module's docstring, as Markdown that fits in a table's cell."""
    doc = ast.get_docstring(ast.parse((ROOT / "paramserver" / path).read_text())) or ""
    sentence = " ".join(doc.split()).split(". ")[0].rstrip(".")
    sentence = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", sentence).replace("``", "`")
    sentence = sentence if len(sentence) <= 90 else sentence[:87] + "..."
    return sentence.replace("|", "\\|") or "what it holds"


def test_the_map_names_every_package_and_module_and_only_those():
    """The package table has a row for each package, the module table one for each
    module (paths under paramserver/, through the links) saying what it holds; a
    package's __init__.py is its row in the package table. Neither names what is gone."""
    tables = _tables()
    for header in ("package", "module"):
        assert tables.get(header), (f"docs/design.md's {SECTION!r} has no table headed "
                                    f"'| {header} | ...'")
    files = source_files()
    packages = {f.removesuffix("__init__.py") for f in files if f.endswith("/__init__.py")}
    modules = {f for f in files if f == "__init__.py" or not f.endswith("/__init__.py")}
    listed: list[str] = []
    for cells in tables["module"]:
        names = TICKED.findall(cells[0])
        assert len(names) == 1 and len(cells) == 2 and cells[1], (
            f"docs/design.md's module table: {' | '.join(cells)!r} should be "
            "'| `path/module.py` | what it holds |'")
        listed.append(names[0])
    in_packages = {n for cells in tables["package"] for n in TICKED.findall(cells[0])}
    problems = []
    twice = sorted({m for m in listed if listed.count(m) > 1})
    if twice:
        problems.append("the module table lists these twice; keep one row of each: "
                        + ", ".join(f"`{m}`" for m in twice))
    if missing := sorted(modules - set(listed)):
        problems.append(
            f"the module table lacks {len(missing)} module(s); add these rows beside the "
            "other modules of their folder, each with a short phrase of what it holds "
            "(shown: how its docstring begins):\n"
            + "\n".join(f"| `{m}` | {_first_sentence(m)} |" for m in missing))
    if gone := sorted(set(listed) - modules):
        problems.append("the module table lists modules that do not exist; remove these "
                        "rows (or give them the module's new path): "
                        + ", ".join(f"`{m}`" for m in gone))
    if missing := sorted(packages - in_packages):
        problems.append(
            "the package table lacks these packages; add a row for each, in its layer's "
            "place (setup.cfg's layers contract orders them):\n" + "\n".join(
                f"| `{p}` | what it holds | what it may import | a change to ... |"
                for p in missing))
    if gone := sorted(in_packages - packages - modules):
        problems.append("the package table names what does not exist; remove or rename: "
                        + ", ".join(f"`{n}`" for n in gone))
    assert not problems, f"docs/design.md, {SECTION!r}: " + "\n".join(problems)


def test_the_design_page_names_no_file_that_is_gone():
    """A path in the prose (``core/shard.py``, ``tests/test_layout.py``, ``rounds.py``)
    is a file of the repository, of the package, or a module's own name."""
    text = DESIGN.read_text()
    modules = source_files()
    basenames = {m.rsplit("/", 1)[-1] for m in modules}
    gone = []
    for path in sorted(set(re.findall(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b", text))):
        if "/" in path:
            known = (ROOT / path).is_file() or path in modules
        else:
            known = path in basenames or (ROOT / path).is_file()
        if not known:
            gone.append(path)
    assert not gone, ("docs/design.md names files that do not exist; correct these "
                      "paths (`git log --follow` finds where a file went): " + ", ".join(gone))
