"""A shard's STATS reply fitted to one header: the wire's bound on what a summary
of a worker table may take."""

from __future__ import annotations

from typing import Any

import msgpack

from paramserver.wire.protocol import MAX_HEADER_BYTES

__all__ = ["STATS_BYTES", "fit"]

#: what a STATS reply's fields may take of a header (the decoder refuses one over
#: MAX_HEADER_BYTES); the rest is the envelope's
STATS_BYTES = MAX_HEADER_BYTES * 3 // 4


def fit(reply: dict[str, Any], limit: int = STATS_BYTES) -> dict[str, Any]:
    """``reply`` (a shard's full STATS) with fewer workers listed, the last ones first,
    until it encodes in ``limit`` bytes: every map in it is bounded (STATS_WORKERS
    workers, bucketed staleness, MAX_REASONS reasons), but not so far that 512 full
    summaries always fit a header; the figures that count every worker stay."""
    workers: dict[str, Any] = reply.get("workers") or {}
    observed = reply.get("observed")
    while True:
        # the watchdog's figures for the listed workers only (its table is the core's,
        # up to --max-workers entries)
        if isinstance(observed, dict) and isinstance(observed.get("workers"), dict):
            observed["workers"] = {k: v for k, v in observed["workers"].items() if k in workers}
        if not workers or len(msgpack.packb(reply, use_bin_type=True)) <= limit:
            return reply
        workers = dict(list(workers.items())[:len(workers) // 2])
        reply["workers"] = workers
        reply["workers_listed"] = len(workers)
