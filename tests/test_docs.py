"""Every code block of README.md and docs/*.md that is meant to run, runs (issue 15).

A block is one of:

* a ```python block: run with this Python in the document's temp dir; one whose
  first line is a comment naming a file (``# mypkg/tasks.py``) is written there
  as that file instead, so that later blocks can use it (``--task mypkg.tasks:...``);
* a ```toml block whose first line names a file (``# run.toml``): written there;
* a shell block: fenced ```sh / ```bash / ```console, or indented by four spaces
  with a command first (``paramserver``, ``python``, ``make``, ``torchrun``, ...);
  lines starting ``$ `` are the commands of a block that shows output too. It runs
  with bash -e in the temp dir, at small sizes (``--steps``, ``--seeds``, ``--epochs``
  shrunk; for commands that give none, PARAMSERVER_STEPS and PARAMSERVER_SEEDS set,
  which ``launch`` reads, and ``--steps 3 --seeds 1`` added to ``experiment`` and
  ``simulate``, which read no defaults from the environment).

A block not meant to run (a fragment, several hosts, a GPU, a server that runs
until stopped, minutes of benchmarks) says so with ``<!-- no-run: reason -->`` on
the line before it (blank lines between are allowed): skipping is deliberate and
visible. Other indented blocks (outputs, file trees, formulas) are text.

The blocks of one document run in order in one temp dir, one test per document; the
documents run side by side (see ``document_runs``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_LIMIT = 240.0  # seconds one block may take
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>\S.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
SHELL_LANGS = {"sh", "bash", "shell", "console"}
COMMANDS = re.compile(r"^(\$ |paramserver |python |\.venv/bin/|make |torchrun |srun |curl |"
                      r"pip |#SBATCH |[A-Z_]+=\S* )")
FILE_HEADER = re.compile(r"^#\s*(?P<path>[\w./-]+\.(py|toml))\s*$")
SHRINK = [
    (re.compile(r"--steps[ =]\d+"), "--steps 3"),
    (re.compile(r"--epochs[ =]\d+"), "--epochs 1"),
    (re.compile(r"--seeds[ =]\d+"), "--seeds 1"),
    (re.compile(r"\bsteps=\d+"), "steps=3"),
    (re.compile(r"\bseeds=\d+"), "seeds=1"),
]


@dataclass
class Block:
    doc: Path
    line: int  # 1-based line of its first line of code
    kind: str  # python, shell, toml, text
    code: str
    skip: str | None  # the no-run reason

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _kind_of_indented(lines: list[str]) -> str:
    first = next((ln for ln in lines if ln.strip() and not ln.lstrip().startswith("# ")),
                 "").lstrip()
    return "shell" if COMMANDS.match(first) else "text"


def blocks(doc: Path) -> list[Block]:
    """The code blocks of ``doc`` with their kind and no-run reason."""
    lines = doc.read_text(encoding="utf-8").split("\n")
    found: list[Block] = []
    skip: str | None = None
    i = 0
    in_list = False
    while i < len(lines):
        line = lines[i]
        marker = NO_RUN.match(line)
        fence = FENCE.match(line)
        if marker:
            skip = marker.group("reason")
        elif fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            lang = fence.group("lang")
            kind = ("python" if lang == "python" else "shell" if lang in SHELL_LANGS
                    else "toml" if lang == "toml" else "text")
            found.append(Block(doc, i + 2, kind, "\n".join(lines[i + 1:end]), skip))
            skip, i = None, end
        elif ((i == 0 or not lines[i - 1].strip()) and line.startswith("    ")
              and (not in_list or COMMANDS.match(line.lstrip()))):
            # an indented block; inside a list item only one of commands (deeper indent)
            indent = len(line) - len(line.lstrip())
            end = i
            while end < len(lines) and (lines[end].startswith(" " * indent)
                                        or not lines[end].strip()):
                end += 1
            code = [ln[indent:] for ln in lines[i:end]]
            found.append(Block(doc, i + 1, _kind_of_indented(code), "\n".join(code).strip(),
                               skip))
            skip, i = None, end - 1
        elif line.strip():
            in_list = bool(re.match(r"^\s*([*-]|\d+\.)\s", line)) or (
                in_list and line.startswith("  "))
            skip = None
        i += 1
    return found


# a grid command and the rest of its line (continued by trailing backslashes)
GRID_COMMAND = re.compile(r"(?P<head>paramserver\s+(?:experiment|simulate))"
                          r"(?P<rest>(?:[^\n\\]|\\.|\\\n)*)")
# a grid's length comes from these when given: no --steps added beside them
GRID_LENGTH = ("--steps", "--budget-seconds", "--budget-gradients", "--spec", "--preset")


def _small_grid(match: re.Match[str]) -> str:
    """A grid command with ``--steps 3 --seeds 1`` where it gives none: unlike launch,
    experiment and simulate take no defaults from PARAMSERVER_STEPS/SEEDS, and their own
    (hundreds of steps, 3 seeds) would cost minutes for a block checked only to run."""
    head, rest = match.group("head"), match.group("rest")
    flags = rest.split(" -- ", 1)[0]  # not the arguments of a script it runs
    if "--replay" in flags:  # a recorded run's length: it takes neither
        return head + rest
    if not any(f in flags for f in GRID_LENGTH):
        head += " --steps 3"
    if not any(f in flags for f in ("--seeds", "--spec", "--preset")):
        head += " --seeds 1"
    return head + rest


def _shrink(code: str) -> str:
    for pattern, small in SHRINK:
        code = pattern.sub(small, code)
    return code


def _shrink_shell(code: str) -> str:
    return GRID_COMMAND.sub(_small_grid, _shrink(code))


def _shell_script(code: str) -> str:
    lines = code.split("\n")
    if any(ln.startswith("$ ") for ln in lines):  # a session: commands and their output
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    commands = [ln for ln in lines if ln.strip() and not ln.startswith("#")]
    if len(commands) > 1 and all(c.startswith("paramserver launch ") and "\\" not in c
                                 for c in commands):
        # independent one-line runs (each its own --out): side by side, each one checked
        started = "\n".join(f"{c} &\npids+=($!)" for c in commands)
        return _shrink_shell(f'pids=()\n{started}\nfor p in "${{pids[@]}}"; do wait "$p"; done')
    return _shrink_shell("\n".join(lines))


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSERVER_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), str(ROOT)])
    env.update(OMP_NUM_THREADS="1", PARAMSERVER_STEPS="3", PARAMSERVER_SEEDS="1",
               MPLBACKEND="Agg")
    return env


def _link_repo(tmp: Path) -> None:
    """The repository's examples and docs, where the blocks' relative paths expect them."""
    for name in ("examples", "docs"):
        if not (tmp / name).exists():
            (tmp / name).symlink_to(ROOT / name)


def _run(block: Block, tmp: Path) -> None:
    if block.kind == "python":
        args = [sys.executable, "-c", _shrink(block.code)]
    else:
        args = ["bash", "-e", "-o", "pipefail", "-c", _shell_script(block.code)]
    try:
        done = subprocess.run(args, cwd=tmp, env=_env(tmp), capture_output=True, text=True,
                              timeout=BLOCK_LIMIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after {BLOCK_LIMIT:g}s")
    assert done.returncode == 0, (f"{block.where} exited {done.returncode}:\n{block.code}\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n"
                                  f"--- stderr\n{done.stderr[-3000:]}")


def _file_of(block: Block) -> str | None:
    first = block.code.split("\n", 1)[0]
    match = FILE_HEADER.match(first)
    return match.group("path") if match and block.kind in ("python", "toml") else None


def test_the_parser_sees_fences_indented_commands_and_markers(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n    paramserver tasks\n\n<!-- no-run: a fragment -->\n\n"
                   "```python\nmodel(x)\n```\n\n    runs/a/   a folder\n\n"
                   "* a list item\n\n    continued, not code\n\n```toml\n# a.toml\nx = 1\n```\n",
                   encoding="utf-8")
    got = [(b.kind, b.code, b.skip) for b in blocks(doc)]
    assert got == [("shell", "paramserver tasks", None), ("python", "model(x)", "a fragment"),
                   ("text", "runs/a/   a folder", None), ("toml", "# a.toml\nx = 1", None)]
    assert _shell_script("$ paramserver launch --steps 300\noutput") == \
        "paramserver launch --steps 3"
    # grid commands read no environment defaults: flags, before a script's own arguments
    assert _shell_script("paramserver experiment --mode sync \\\n    --out o -- python t.py "
                         "--seeds 5") == ("paramserver experiment --steps 3 --seeds 1 --mode "
                                          "sync \\\n    --out o -- python t.py --seeds 1")
    assert _shell_script("paramserver simulate --steps 30 --workers 8\n"
                         "paramserver experiment --spec g.toml") == (
        "paramserver simulate --seeds 1 --steps 3 --workers 8\n"
        "paramserver experiment --spec g.toml")


def test_every_document_has_blocks_that_run() -> None:
    """The extraction finds the README's commands (a parser that finds nothing passes
    every document vacuously)."""
    readme = [b for b in blocks(ROOT / "README.md") if b.kind in ("python", "shell")]
    assert len([b for b in readme if b.skip is None]) >= 6
    assert any("paramserver launch" in b.code and b.skip is None for b in readme)


def test_a_block_skipped_as_a_repeat_is_one_that_runs() -> None:
    """docs/cli.md's three modes are the README's quick start word for word, which
    tests/test_cli_e2e.py runs (reading it from the README) and checks the accuracy of."""
    def commands(block: Block) -> list[str]:
        return [ln for ln in block.code.split("\n") if ln.strip() and not ln.startswith("#")]

    def skipped(doc: Path, why: str) -> list[list[str]]:
        return [commands(b) for b in blocks(doc) if b.skip is not None and why in b.skip]

    (quick,) = skipped(ROOT / "README.md", "tests/test_cli_e2e.py runs these three commands")
    (again,) = skipped(ROOT / "docs" / "cli.md", "the README's quick start")
    assert again == quick and len(quick) == 3
    assert all(c.startswith("paramserver launch ") for c in quick)


def _run_document(doc: Path, tmp: Path) -> int:
    """Run the blocks of ``doc`` in order in ``tmp``; how many ran."""
    runnable = [b for b in blocks(doc) if b.kind in ("python", "shell", "toml")]
    # files first (a command may use a module defined below it); the README's too, which
    # other pages refer to (mypkg.policies:Linear), unless a page brings its own modules
    # (a file block, or PYTHONPATH set to an example's folder)
    own = any(str(_file_of(b)).endswith(".py") or "PYTHONPATH=" in b.code for b in runnable)
    readme = [] if doc.name == "README.md" or own else blocks(ROOT / "README.md")
    for block in [*readme, *runnable]:
        path = _file_of(block)
        if path is not None and block.skip is None:
            target = tmp / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code + "\n", encoding="utf-8")
            if target.suffix == ".py":
                for parent in target.relative_to(tmp).parents:
                    if parent != Path("."):
                        (tmp / parent / "__init__.py").touch()
    _link_repo(tmp)
    ran = 0
    for block in runnable:
        if block.skip is not None or block.kind == "toml" or _file_of(block) is not None:
            continue
        _run(block, tmp)
        ran += 1
    return ran


@pytest.fixture(scope="module")
def document_runs(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Future[int]]:
    """Every selected document's blocks, run before the first document's test: the
    documents side by side (each in its own temp dir, one lane per core), the blocks of
    one in order. A block's commands spend most of their time starting interpreters
    one after another (about half a core each), so two documents share 2 cores with
    little slowdown. Every run has ended when this returns, so no process of one
    document outlives a test (tests/conftest.py)."""
    docs = [item.callspec.params["doc"] for item in request.session.items
            if getattr(item, "originalname", None) == "test_the_blocks_of_a_document_run"]
    dirs = {doc: tmp_path_factory.mktemp(doc.stem) for doc in docs}
    # the documents with the most blocks to run first (the README), so that the lanes end
    # together: in file order, the longest but one (experiments.md) came last, alone
    docs.sort(key=lambda doc: -sum(1 for b in blocks(doc) if b.kind in ("python", "shell")
                                   and b.skip is None and _file_of(b) is None))
    with ThreadPoolExecutor(max(1, min(len(docs), os.cpu_count() or 1))) as pool:
        return {doc: pool.submit(_run_document, doc, dirs[doc]) for doc in docs}


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_the_blocks_of_a_document_run(doc: Path,
                                      document_runs: dict[Path, Future[int]]) -> None:
    if document_runs[doc].result() == 0:  # a failed block raises its failure here
        pytest.skip(f"{doc.name}: no block meant to run")
