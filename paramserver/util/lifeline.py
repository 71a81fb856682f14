"""A run's lifeline: how the processes a launcher started learn that it is gone.

The launcher makes a pipe and keeps its write end to itself (close-on-exec, never
passed on); each process it starts gets the read end by descriptor, and the
descriptor's number in ``PARAMSERVER_LIFELINE``. Nothing is ever written, so a
read returns only at end-of-file: when the launcher's end closes, which the
kernel does however the launcher ends, SIGKILL included. Unlike a parent-death
signal, it does not matter which thread or process started the child.

:func:`watch` (a shard's and a worker's main, and a script's
DistributedOptimizer) waits for that in a daemon thread, then stops its own
process as the launcher's stop would have: SIGTERM to itself (a shard saves and
exits; a script without a handler ends), and ``os._exit`` if it is still there
:data:`GRACE` seconds later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import threading
from collections.abc import Callable

__all__ = ["ENV", "GRACE", "Lifeline", "watch"]

log = logging.getLogger(__name__)

#: names the read end's descriptor in a child's environment
ENV = "PARAMSERVER_LIFELINE"
#: seconds a process has, once its launcher is gone, to stop by SIGTERM
GRACE = 10.0
#: the exit status of a process stopped by its watch: as if SIGTERM had ended it
LOST_EXIT = 128 + signal.SIGTERM

_watching = False
_lock = threading.Lock()


class Lifeline:
    """The launcher's side: a pipe whose write end only this process holds."""

    def __init__(self) -> None:
        # os.pipe's ends are close-on-exec: no child inherits the write end
        self.read_fd, self._write_fd = os.pipe()

    @property
    def pass_fds(self) -> tuple[int]:
        """What a child is given (subprocess.Popen's ``pass_fds``)."""
        return (self.read_fd,)

    def env(self) -> dict[str, str]:
        """What a child finds in its environment."""
        return {ENV: str(self.read_fd)}

    def close(self) -> None:
        """Cut it: every child watching it stops."""
        for fd in (self._write_fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._write_fd = self.read_fd = -1


def _inherited() -> int | None:
    """The lifeline's descriptor this process was given, or None (not started by a
    launcher, or the number names something else: a grandchild that did not inherit
    it)."""
    value = os.environ.get(ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
    except OSError:
        return None
    return fd


def watch(on_lost: Callable[[], None] | None = None, grace: float = GRACE) -> bool:
    """Stop this process when its launcher is gone (once per process; False when it
    was started by none). ``on_lost`` replaces the SIGTERM to itself."""
    global _watching
    with _lock:
        if _watching:
            return True
        fd = _inherited()
        if fd is None:
            return False
        _watching = True

    def wait() -> None:
        while True:
            try:
                if not os.read(fd, 1):  # end-of-file: the launcher's end is closed
                    break
            except InterruptedError:
                continue
            except OSError:
                return  # (our end closed under us: not the launcher's doing)
        log.warning("the launcher is gone (its lifeline closed): stopping this process")
        if on_lost is not None:
            on_lost()
        else:
            os.kill(os.getpid(), signal.SIGTERM)
        # a deadline, not a synchronisation: whatever the process is doing, it ends
        threading.Event().wait(grace)
        os._exit(LOST_EXIT)

    threading.Thread(target=wait, name="lifeline", daemon=True).start()
    return True
