"""A shard's replicas started by hand, as the launcher starts them
(``python -m paramserver.server.loop CONFIG.json``, the address read from the
``PARAMSERVER_READY`` line), optionally inside a network namespace or through a
script that wraps the server (tests/busy_primary_script.py); and a replica's event log
read one process at a time."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from paramserver.observe.events import read_events
from paramserver.server.config import ServerConfig
from paramserver.server.loop import READY_PREFIX
from paramserver.wire.replauth import shared_key_file

#: seconds a replica may take to announce its address
STARTUP = 120.0
#: the environment the launcher gives its children: one compute thread each, so that a
#: worker's gradients come out the same, bit for bit, in every run
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class Replica:
    name: str
    popen: subprocess.Popen[bytes]
    address: str
    log: Path

    def stop(self) -> None:
        """Kill it if it still runs, and reap it."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(30)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def replication_key(out: Path) -> str:
    """The run's replication key, ``out/replication.key`` (made once, as by hand)."""
    return str(shared_key_file(out / "replication.key"))


def replica_config(out: Path, name: str, failover_timeout: float,
                   **kw: object) -> ServerConfig:
    """One async replica of a one-worker shard, its event log ``out/NAME.jsonl``, with
    the run's replication key (``out/replication.key``) unless ``kw`` names one."""
    kw.setdefault("replication_key", replication_key(out))
    return ServerConfig(mode="async", expected_workers=1, replicas=1,
                        failover_timeout=failover_timeout, heartbeat_timeout=60.0,
                        event_log=str(out / f"{name}.jsonl"), **kw)  # type: ignore[arg-type]


def start(name: str, config: ServerConfig, out: Path, prefix: Sequence[str] = (),
          script: Sequence[str] = ()) -> Replica:
    """Start one replica serving ``config``; its log and config go under ``out``.
    ``prefix``: run it through this command (``ip netns exec NS``); ``script``: a
    Python script and its first arguments run instead of the server's module (it ends
    by calling paramserver.server.entry.main with the config's path)."""
    cfg = out / f"{name}.json"
    cfg.write_text(json.dumps(config.to_dict()))
    log = out / f"{name}.log"
    target = list(script) if script else ["-m", "paramserver.server.loop"]
    with log.open("wb") as fh:
        popen = subprocess.Popen([*prefix, sys.executable, *target, str(cfg)],
                                 stdout=subprocess.PIPE, stderr=fh, env=ENV)
    line: list[bytes] = []
    reader = threading.Thread(target=lambda: line.append(popen.stdout.readline()  # type: ignore[union-attr]
                                                         ), daemon=True)
    reader.start()
    reader.join(STARTUP)
    text = line[0].decode() if line else ""
    if not text.startswith(READY_PREFIX):
        with contextlib.suppress(OSError):
            popen.kill()
        popen.wait(30)
        raise RuntimeError(f"{name} did not start: {text!r}; its log: "
                           f"{log.read_text()[-2000:]}")
    return Replica(name, popen, text.split()[1], log)


def lives(path: Path, event: str | None = None) -> list[list[dict]]:
    """A replica's event log split by process (optionally only one kind of record): the
    launcher's replacement keeps its replica's name and appends to the same file, each
    process's records from its ``server_start`` on."""
    out: list[list[dict]] = []
    for rec in read_events(path):
        if rec["event"] == "server_start" or not out:
            out.append([])
        if event is None or rec["event"] == event:
            out[-1].append(rec)
    return out
