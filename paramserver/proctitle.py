"""Process titles: ``ps`` and ``top`` show each role instead of ``python -m MODULE``.

Every process of a run names itself ``paramserver: <what it is>``, e.g.
``paramserver: server 0/2 tcp://127.0.0.1:5555 (sync)``.
"""

from __future__ import annotations

import logging
import threading

import setproctitle

__all__ = ["PREFIX", "get_title", "set_title"]

log = logging.getLogger(__name__)

PREFIX = "paramserver: "


def set_title(what: str) -> bool:
    """Set this process's title to ``paramserver: <what>``; True if it was set.

    Only from the main thread: a shard or worker run in a thread of another
    program (a test, a notebook) must not rename that program.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    setproctitle.setproctitle(PREFIX + what)
    log.debug("process title: %s%s", PREFIX, what)
    return True


def get_title() -> str:
    return str(setproctitle.getproctitle())
