"""Across hosts: push + pull between two network namespaces, against raw pyzmq on the same link.

The shard agents (the raw pyzmq shard and this project's ShardServer) run in
namespace A and bind A's veth address; the worker agents run in namespace B
(:mod:`paramserver.benchmarks.netns`). The measurement is the sweep's
(:func:`~paramserver.benchmarks.suite.run_sweep`): raw and this project alive
together, repeats interleaved, ratios paired per repeat. Every byte crosses
the TCP stack and the veth pair, as between machines; a shard grants shared
memory only to a worker connected from its own host, so this project's path
here must be TCP, and each row records what the shards and clients say
(``shm_peers``, ``shm_used``): :func:`run_hosts` reports a row that used
shared memory as a problem rather than as a figure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from .netns import NetnsUnavailable, exec_prefix, netns_problem, two_namespaces
from .records import HostsResult, Link, SweepRow
from .suite import Cell, Placement, PSVariant, SweepConfig, run_sweep

__all__ = ["DEFAULT_SIZES", "run_hosts"]

log = logging.getLogger(__name__)

DEFAULT_SIZES: tuple[int, ...] = (1 << 20, 16 << 20, 100 << 20)


def run_hosts(sizes: Sequence[int] = DEFAULT_SIZES, workers: Sequence[int] = (1,),
              shards: Sequence[int] = (1,), repeats: int = 5, repeat_seconds: float = 0.25,
              log_dir: Path | None = None,
              on_row: Callable[[SweepRow], None] | None = None) -> HostsResult:
    """Raw pyzmq and this project across two namespaces for every (workers, shards, size).

    Returns a result ``skipped`` (and why) where namespaces cannot be made (no root, no
    iproute2), else its link, rows and problems; a problem is a row of this project
    that moved tensors through shared memory.
    """
    problem = netns_problem()
    if problem:
        return HostsResult(skipped=problem)
    try:
        with two_namespaces() as link:
            placement = Placement(server_prefix=tuple(exec_prefix(link.ns_a)),
                                  worker_prefix=tuple(exec_prefix(link.ns_b)),
                                  server_host=link.ip_a)
            cfg = SweepConfig(cells=[Cell(n, s, b) for n in workers for s in shards
                                     for b in sizes],
                              systems=("raw", "ps"), variants=[PSVariant("ps")],
                              repeats=repeats, repeat_seconds=repeat_seconds,
                              log_dir=log_dir, placement=placement)
            rows = run_sweep(cfg, on_row)
    except NetnsUnavailable as exc:
        return HostsResult(skipped=str(exc))
    problems = [f"{r.workers}w {r.shards}s {r.bytes} B: {r.system} used shared "
                f"memory across namespaces (shard peers {r.shm.shm_peers}, client links "
                f"{r.shm.shm_used})" for r in rows
                if r.system != "raw" and r.shm is not None and r.used_shm]
    for p in problems:
        log.error("%s", p)
    return HostsResult(None, Link(link.ns_a, link.ip_a, link.ns_b, link.ip_b,
                                  "shared memory" if problems else "tcp"),
                       tuple(rows), tuple(problems))
