"""This project under test: real shard servers and PSClient workers.

``serve`` runs one :class:`~paramserver.server.loop.ShardServer` in the agent's
process until a SHUTDOWN arrives and reports its memory. A
:class:`PSSession` is one worker's push + pull loop on a flat float32
parameter of the payload size, split by the same
:class:`~paramserver.core.sharding.ShardPlan` training uses (2 MiB chunks). Both
sides go through the whole stack: msgpack headers, validation, versions,
clocks, the sync barrier, the torch optimizer and its finite check.
"""

from __future__ import annotations

import torch

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.server.config import ServerConfig
from paramserver.server.entry import serve as serve_shard
from paramserver.server.process import Ready
from paramserver.util.jsontypes import JSONObject
from paramserver.workers.admin import shutdown_servers
from paramserver.workers.client import PART_BYTES, PSClient

from .common import (
    Announce,
    FixedSizeSession,
    flag,
    integer,
    obj,
    peak_rss,
    reset_peak_rss,
    rounds_until_stopped,
    rss,
    split_range,
    strings,
)

__all__ = ["PSSession", "async_run", "flat_plan", "serve", "stop_op"]


def flat_plan(numel: int, shards: int, chunk_bytes: int = ShardPlan.DEFAULT_CHUNK_BYTES,
              pieces: int = 1) -> ShardPlan:
    """``numel`` float32 as one parameter "w", or as ``pieces`` parameters w0, w1, ...
    (so that a model too small to be chunked still spreads over the shards)."""
    if pieces == 1:
        return ShardPlan([ParamSpec("w", (numel,), "float32")], shards, chunk_bytes)
    sizes = [hi - lo for lo, hi in split_range(numel, pieces)]
    return ShardPlan([ParamSpec(f"w{i}", (n,), "float32") for i, n in enumerate(sizes)],
                     shards, chunk_bytes)


def serve(args: JSONObject, announce: Announce) -> JSONObject:
    """One shard server; ``args["config"]`` is a ServerConfig dict.

    Reports the process's RSS when it started listening (``rss_base``: the
    interpreter, torch with torch._dynamo, and zmq; no weights yet) and its peak
    RSS since then.
    """
    config = ServerConfig.from_dict(obj(args, "config"))
    # code, not data: torch.optim imports torch._dynamo on first use (~70 MB of modules);
    # a shard forked from the zygote has it loaded already, so it belongs to the base.
    # Imported before the server starts: a primary with replicas announces itself when
    # started, and a backup that then hears nothing for --failover-timeout takes over
    import torch._dynamo
    base = 0

    def ready(listening: Ready) -> None:
        nonlocal base
        base = rss()
        reset_peak_rss()
        announce({"address": listening.address})

    # the agent's process runs other payloads too: its signals and threads stay its own
    server = serve_shard(config, ready, own=False)
    core = server.core
    state = 0
    if core is not None:
        for per_param in core.stepper.optimizer.state.values():
            state += sum(v.numel() * v.element_size() for v in per_param.values()
                         if isinstance(v, torch.Tensor))
    return {
        "rss_base": base, "peak_rss": peak_rss(),
        "counters": {k: v for k, v in server.counters.items()},
        "version": core.version if core else 0,
        "weight_bytes": sum(p.numel() * p.element_size() for p in core.params.values())
        if core else 0,
        "optimizer_state_bytes": state,
    }


class PSSession(FixedSizeSession):
    """One worker: ``push_pull`` rounds on a flat parameter.

    ``args``: addresses, numel, rank, chunk_bytes, part_bytes, wire_dtype, compression
    (a ``--compression`` spec: the push compressed, with error feedback), pieces, shm
    (False: TCP even with a same-host shard), early_parts (PSClient's: a round in parts
    asks for each part's weights as soon as its sum is final).
    """

    def __init__(self, args: JSONObject) -> None:
        self.numel = integer(args, "numel")
        addresses = strings(args, "addresses")
        plan = flat_plan(self.numel, len(addresses),
                         integer(args, "chunk_bytes", ShardPlan.DEFAULT_CHUNK_BYTES),
                         integer(args, "pieces", 1))
        wire_dtype = args.get("wire_dtype")
        compression = args.get("compression")
        self.client = PSClient(addresses, plan, integer(args, "rank", 0),
                               timeout=300.0, request_timeout=120.0,
                               wire_dtype=wire_dtype if isinstance(wire_dtype, str) else None,
                               compression=compression if isinstance(compression, str)
                               else None,
                               part_bytes=integer(args, "part_bytes", PART_BYTES),
                               shm=flag(args, "shm", True),
                               early_parts=flag(args, "early_parts", False))
        self.params = {p.name: torch.zeros(p.shape) for p in plan.params}
        self.grads = {p.name: torch.full(p.shape, 1e-3) for p in plan.params}
        self.clock = self.client.connect()
        self.client.initialize(self.params)
        self.versions = self.client.pull(self.params, self.clock).versions
        self.applied = 0

    def one_round(self) -> None:
        pushed, pulled = self.client.push_pull(self.grads, self.versions, 1, self.clock,
                                               self.params)
        self.versions = pulled.versions
        self.clock += 1
        self.applied += sum(1 for o in pushed.outcomes if o.applied)

    def close(self) -> JSONObject:
        # which path the tensors took: a shard grants shared memory only to a worker
        # connected from its own host (offered: this client asked for it at HELLO)
        links = [ch.shm for ch in self.client.channels]
        shm: JSONObject = {"shm_offered": sum(link is not None for link in links),
               "shm_used": sum(link is not None and link.active for link in links)}
        try:
            self.client.bye()
        finally:
            self.client.close()
        first = next(iter(self.params.values()))
        return {"checksum": float(first[:16].sum()), "clock": self.clock, **shm}


def async_run(args: JSONObject, announce: Announce) -> JSONObject:
    """Async throughput: push + pull rounds, as fast as possible, until ``stop_file`` exists.

    Announces ``{"running": true}`` after the warm-up; returns this worker's
    pushes and the shard updates they caused.
    """
    session = PSSession(args)
    try:
        def start() -> None:
            session.applied = 0

        rounds, seconds = rounds_until_stopped(session.one_round, args, announce,
                                               batch=integer(args, "batch", 50),
                                               on_start=start)
        return {"pushes": rounds, "shard_updates": session.applied, "seconds": seconds}
    finally:
        session.close()


def stop_op(args: JSONObject, announce: Announce) -> JSONObject:
    """SHUTDOWN to shard servers, sent by an agent (one that can reach them: another
    namespace's); returns the addresses that did not answer."""
    return {"failed": list(shutdown_servers(strings(args, "addresses")))}
