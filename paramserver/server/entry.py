"""Starting one shard: :func:`serve`, the one place a shard server is made and
started. ``paramserver server`` and the rendezvous' server ranks call it through
:func:`run_server`, the launcher through :func:`main` (``python -m
paramserver.server.loop CONFIG.json`` or ``python -m paramserver.server.entry
CONFIG.json``), the benchmark agent directly; loop.py holds the server it runs."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from paramserver.errors import ConfigError, TransportError
from paramserver.observe.console import Console
from paramserver.persist.checkpoint import CheckpointDirInUse, CheckpointError
from paramserver.server.config import ServerConfig
from paramserver.server.loop import ShardServer
from paramserver.server.process import Ready, announce_ready, own_process
from paramserver.util import lifeline

__all__ = ["main", "run_server", "serve"]


def serve(config: ServerConfig, on_ready: Callable[[Ready], None] | None = None, *,
          job_done: threading.Event | None = None, console: Console | None = None,
          own: bool = True) -> ShardServer:
    """Build one shard, start it (:meth:`ShardServer.start`: socket, metrics,
    checkpoints, replicas) and serve until SHUTDOWN, SIGTERM or SIGINT, the end of the
    job, or the watchdog. Returns the stopped server (its ``exit_code``, its figures).

    ``on_ready`` is told where the shard listens (:class:`Ready`), once it does.
    ``job_done``: set by another thread when the job says every worker is done.
    ``console``: prints the run's story (joins, deaths, checkpoints) as it happens.
    ``own``: this process is the shard's (signals stop it, --threads, its title).
    """
    server = ShardServer(config, console)
    if job_done is not None:
        server.job_done = job_done
    server.start()
    if own:
        own_process(config, server.address, server.stop)
    server.serve_forever(on_ready)
    return server


def run_server(config: ServerConfig, on_ready: Callable[[Ready], None] | None = None,
               job_done: threading.Event | None = None, console: Console | None = None) -> int:
    """:func:`serve` in this process; returns its exit code: 0, or
    :data:`~paramserver.server.stopping.DIVERGED_EXIT_CODE`."""
    return serve(config, on_ready, job_done=job_done, console=console).exit_code


def main(argv: list[str] | None = None) -> None:
    """``python -m paramserver.server.loop CONFIG.json``: the launcher's way to start a shard."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m paramserver.server.loop CONFIG.json")
    config = ServerConfig.from_dict(json.loads(Path(args[0]).read_text()))
    logging.basicConfig(
        level=os.environ.get("PARAMSERVER_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s shard{config.shard} %(levelname)s %(name)s: %(message)s",
    )
    lifeline.watch()  # started by a launcher: stop (SIGTERM) when it is gone, however
    try:
        # the story in the shard's log file, among its other records
        server = serve(config, announce_ready, console=Console.to_log())
    except CheckpointDirInUse as exc:  # an earlier run there: resume it or --fresh
        sys.exit(f"shard {config.shard}: {exc}")
    except CheckpointError as exc:  # one line naming the file, no traceback
        sys.exit(f"shard {config.shard}: cannot resume: {exc}")
    except (TransportError, ConfigError) as exc:  # a port in use, a bad key file or
        sys.exit(f"shard {config.shard}: {exc}")  # allow-list line, replicas that disagree
    sys.exit(server.exit_code)


if __name__ == "__main__":
    main()
