"""Process titles: ``ps`` and ``top`` show each role instead of ``python -m MODULE``.

Every process of a run names itself ``paramserver: <what it is>``, e.g.
``paramserver: server 0/2 tcp://127.0.0.1:5555 (sync)``.

Only a paramserver program renames itself: the ``paramserver`` console script, or
``python -m paramserver...`` (which is also how the zygote's forked children run
their module, see :mod:`paramserver.workers.launch.zygote`). A command invoked
in-process by another program (a test through click's CliRunner, a notebook)
leaves that program's title alone, so ``ps`` and ``pkill -f`` still find it.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from pathlib import Path

import setproctitle

__all__ = ["PREFIX", "get_title", "is_paramserver_program", "set_title"]

log = logging.getLogger(__name__)

PREFIX = "paramserver: "
#: the console script (setup.cfg's entry point)
_SCRIPT = "paramserver"


@functools.cache
def _package_roots() -> tuple[Path, ...]:
    """The package folder and, resolved, the folders linked into it (workers/, cli/,
    benchmarks/): ``python -m paramserver.workers.worker`` runs a file whose real
    path is outside ``paramserver/``."""
    package = Path(__file__).resolve().parents[1]  # paramserver/, above util/
    roots = [package]
    for entry in package.iterdir():
        if entry.is_symlink() and entry.is_dir():
            roots.append(entry.resolve())
    return tuple(roots)


def is_paramserver_program(argv0: str | None = None) -> bool:
    """True if ``argv0`` (default ``sys.argv[0]``) starts a paramserver program: the
    console script, or a module of the package run as ``__main__`` (``python -m`` and
    runpy, the zygote's way, put the module's file there)."""
    if argv0 is None:
        argv0 = sys.argv[0] if sys.argv else ""
    if argv0 in ("", "-c", "-m", "-"):  # python -c, an interactive or piped interpreter
        return False
    path = Path(argv0)
    if path.name in (_SCRIPT, _SCRIPT + ".exe"):
        return True
    try:
        real = path.resolve()
    except OSError:
        return False
    return any(real.is_relative_to(root) for root in _package_roots())


def set_title(what: str) -> bool:
    """Set this process's title to ``paramserver: <what>``; True if it was set.

    Only in a paramserver program (see :func:`is_paramserver_program`) and only from
    its main thread: a shard, worker or launcher run in-process by another program
    (a test, a notebook) must not rename that program.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if not is_paramserver_program():
        log.debug("process title left alone: %r is not a paramserver program", sys.argv[:1])
        return False
    setproctitle.setproctitle(PREFIX + what)
    log.debug("process title: %s%s", PREFIX, what)
    return True


def get_title() -> str:
    return str(setproctitle.getproctitle())
