"""Sync shard servers (for one worker, or ``workers``), each in an agent process, for tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from paramserver.benchmarks.common import Agent, close_all, text
from paramserver.workers.admin import shutdown_servers


@contextmanager
def sync_shards(count: int, lr: float, label: str = "shard",
                workers: int = 1) -> Iterator[list[str]]:
    """``count`` sync shards (plain SGD at ``lr``, ``workers`` expected workers); their
    addresses. They are shut down, and their processes gone, on exit."""
    agents = [Agent(f"{label}{i}") for i in range(count)]
    addrs: list[str] = []
    try:
        for i, a in enumerate(agents):
            a.send("ps_serve", config={"shard": i, "num_shards": count, "mode": "sync",
                                       "expected_workers": workers, "optimizer": "sgd",
                                       "optimizer_args": {"lr": lr}, "heartbeat_timeout": 60})
        addrs = [text(a.read(60), "address") for a in agents]
        yield addrs
        shutdown_servers(addrs)
        for a in agents:
            a.read(60)
        addrs = []
    finally:
        if addrs:
            shutdown_servers(addrs, timeout=2)
        close_all(agents)
