"""What makes a process a shard's: SIGTERM and SIGINT stop it, its thread count and
title, and :class:`Ready`, the one signal that it listens (entry.py runs it)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from paramserver.server.config import ServerConfig
from paramserver.util.proctitle import set_title

__all__ = ["READY_PREFIX", "Ready", "announce_ready", "own_process"]

log = logging.getLogger(__name__)

#: the first word of the line a shard started as a process prints once it listens
READY_PREFIX = "PARAMSERVER_READY"


@dataclasses.dataclass(frozen=True)
class Ready:
    """A shard listens: its address, its metrics port (None without one) and its pid.
    Given to an ``on_ready`` callback in the process, printed as one line
    (:meth:`line`) to a parent process, which reads it back with :meth:`parse`."""

    address: str
    metrics_port: int | None = None
    pid: int = dataclasses.field(default_factory=os.getpid)

    def line(self) -> str:
        """``PARAMSERVER_READY <address> pid=N [metrics=PORT]``."""
        metrics = f" metrics={self.metrics_port}" if self.metrics_port is not None else ""
        return f"{READY_PREFIX} {self.address} pid={self.pid}{metrics}"

    @classmethod
    def parse(cls, line: str) -> Ready:
        """The record a :meth:`line` says; ValueError for another line."""
        words = line.split()
        if len(words) < 2 or words[0] != READY_PREFIX:
            raise ValueError(f"not a {READY_PREFIX} line: {line!r}")
        extra = dict(w.split("=", 1) for w in words[2:] if "=" in w)
        metrics = extra.get("metrics")
        return cls(words[1], int(metrics) if metrics is not None else None,
                   int(extra.get("pid", "0")))


def own_process(config: ServerConfig, address: str, stop: Callable[[], None]) -> None:
    """This process is the shard's: SIGTERM and SIGINT call ``stop``, ``ps`` shows what
    it is."""
    _stop_on_signals(config.shard, stop)
    if config.threads:
        # measured: a 100 MiB sync round beside one same-host worker took 426 ms with
        # torch's default threads on 2 cores, 71 ms with one (docs/performance.md)
        import torch  # loaded already by the shard this process runs

        torch.set_num_threads(config.threads)
    set_title(f"server {config.shard}/{config.num_shards} {address} "
              f"({config.mode_spec().describe()})")


def _stop_on_signals(shard: int, stop: Callable[[], None]) -> None:
    def _stop(signum: int, frame: Any) -> None:
        log.info("shard %d: signal %d, stopping", shard, signum)
        stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def announce_ready(ready: Ready) -> None:
    """Tell a parent process where we listen: :meth:`Ready.line` on stdout."""
    sys.stdout.write(ready.line() + "\n")
    sys.stdout.flush()
