"""A shard's side of ``--trace``: its arrivals, decisions, answered pulls and sync rounds,
in the order it saw them (the format: paramserver/observe/trace.py).

The server calls it at three places: a push decided (ops.py), a pull answered
(outbox.py) and a BYE (peers.py). Recording is a few dozen bytes per push and never
raises into the loop: a full disk stops the trace, not the shard.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from paramserver.observe import trace as tr

if TYPE_CHECKING:
    from paramserver.core.records import PullReply, PushOutcome
    from paramserver.server.config import ServerConfig

__all__ = ["ShardTracer"]

log = logging.getLogger(__name__)


class ShardTracer:
    """Writes one shard's trace file (``ServerConfig.trace``)."""

    def __init__(self, config: ServerConfig, cap: int = tr.DEFAULT_CAP) -> None:
        assert config.trace is not None
        self.sync = config.mode == "sync"
        self._version = 0
        self._members: list[int] = []
        self.writer: tr.TraceWriter | None = tr.TraceWriter(config.trace, tr.Header(
            tr.FORMAT, "shard", config.shard, config.to_dict(), torch.get_num_threads(), cap))

    def _write(self, record: tr.Arrival | tr.Served | tr.Round | tr.Left) -> None:
        if self.writer is None:
            return
        try:
            self.writer.write(record)
        except OSError as exc:
            log.warning("trace %s: %s; recording stopped", self.writer.path, exc)
            self.writer = None

    def arrival(self, worker: int, push_id: int, clock: int, read_version: int,
                num_samples: int, out: PushOutcome, nbytes: int, parts: int,
                now: float) -> None:
        self._write(tr.Arrival(now, worker, push_id, clock, read_version, num_samples,
                               out.version, out.staleness, out.accepted, out.weight,
                               out.reason, nbytes, parts))
        if not self.sync:
            return
        if out.accepted:
            self._members.append(worker)
        self._closed(out.version)  # this push closed the round

    def _closed(self, version: int) -> None:
        """Sync: the round that made ``version`` closed (a push, or a leave, closed it)."""
        if self.sync and version > self._version:
            self._write(tr.Round(version, sorted(self._members)))
            self._version, self._members = version, []

    def served(self, ready: PullReply, now: float) -> None:
        self._closed(ready.version)  # (a round a BYE or a death closed: seen here first)
        self._write(tr.Served(now, ready.worker, ready.clock, ready.version))

    def left(self, worker: int, now: float) -> None:
        self._write(tr.Left(now, worker))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
