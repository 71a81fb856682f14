"""What makes a process a shard's: SIGTERM and SIGINT stop it, its thread count and
title, and the line that tells the parent where it listens (loop.py runs it)."""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from paramserver.util.proctitle import set_title

if TYPE_CHECKING:
    from paramserver.server.loop import ShardServer

__all__ = ["READY_PREFIX", "announce_ready", "call_ready", "own_process"]

log = logging.getLogger(__name__)

#: the first word of the line a shard started as a process prints once it listens
READY_PREFIX = "PARAMSERVER_READY"


def own_process(server: ShardServer) -> None:
    """This process is the shard's: SIGTERM and SIGINT stop it, ``ps`` shows what it is."""
    _stop_on_signals(server)
    config = server.config
    if config.threads:
        # measured: a 100 MiB sync round beside one same-host worker took 426 ms with
        # torch's default threads on 2 cores, 71 ms with one (docs/performance.md)
        import torch  # loaded already by the shard this process runs

        torch.set_num_threads(config.threads)
    set_title(f"server {config.shard}/{config.num_shards} {server.address} "
              f"({config.mode_spec().describe()})")


def _stop_on_signals(server: ShardServer) -> None:
    def _stop(signum: int, frame: Any) -> None:
        log.info("shard %d: signal %d, stopping", server.config.shard, signum)
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def call_ready(on_ready: Callable[..., None], address: str, metrics_port: int | None) -> None:
    """Call ``on_ready(address)``, or ``on_ready(address, metrics_port)`` if it takes two."""
    try:
        params = list(inspect.signature(on_ready).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params):
        on_ready(address, metrics_port)
    else:
        on_ready(address)


def announce_ready(address: str, metrics_port: int | None = None) -> None:
    """Tell a parent process where we listen: one line on stdout
    (``PARAMSERVER_READY <address> pid=N [metrics=PORT]``)."""
    metrics = f" metrics={metrics_port}" if metrics_port is not None else ""
    sys.stdout.write(f"{READY_PREFIX} {address} pid={os.getpid()}{metrics}\n")
    sys.stdout.flush()
