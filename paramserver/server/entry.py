"""Starting one shard in this process: :func:`run_server` (``paramserver server`` and
the rendezvous' server ranks) and :func:`main`, ``python -m paramserver.server.loop
CONFIG.json``, the launcher's way; loop.py holds the server they run."""

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
from paramserver.server.process import announce_ready, own_process
from paramserver.util import lifeline

__all__ = ["main", "run_server"]


def run_server(config: ServerConfig, on_ready: Callable[..., None] | None = None,
               job_done: threading.Event | None = None, console: Console | None = None) -> int:
    """Run one shard until SHUTDOWN, SIGTERM or SIGINT, or until the watchdog stops it.

    ``on_ready`` is called once the shard listens, with its address, and with its
    metrics port (None without one) as well if it takes a second argument.
    ``job_done``: set by another thread when the job says every worker is done.
    ``console``: prints the run's story (joins, deaths, checkpoints) as it happens.

    Returns the process exit code: 0, or :data:`DIVERGED_EXIT_CODE`.
    """
    server = ShardServer(config, console)
    if job_done is not None:
        server.job_done = job_done
    own_process(server)
    server.serve_forever(on_ready)
    return server.exit_code


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
    try:
        # the story in the shard's log file, among its other records
        server = ShardServer(config, Console.to_log())
    except CheckpointDirInUse as exc:  # an earlier run there: resume it or --fresh
        sys.exit(f"shard {config.shard}: {exc}")
    except CheckpointError as exc:  # one line naming the file, no traceback
        sys.exit(f"shard {config.shard}: cannot resume: {exc}")
    except (TransportError, ConfigError) as exc:  # a port in use, a bad key file or
        sys.exit(f"shard {config.shard}: {exc}")  # allow-list line, replicas that disagree
    own_process(server)
    lifeline.watch()  # started by a launcher: stop (SIGTERM) when it is gone, however
    server.serve_forever(announce_ready)
    sys.exit(server.exit_code)
