"""The limit: a hand-written raw pyzmq parameter-server loop, zero-copy, numpy only.

What a person would write by hand to move the same bytes with no framework:
a ROUTER per shard holding its contiguous range of the weights as one numpy
array. A worker sends its gradient range as zero-copy frames of at most
``chunk_bytes`` (the project's 2 MiB chunks: the same frames on the wire); the
server adds them into one aggregation buffer and, once every worker has sent
its gradient, applies ``p -= lr * g`` (through a preallocated scratch array, so
no temporary is allocated per step) and replies with the weights, zero-copy,
in the same frames; the worker copies them into its own weights. No header,
no validation, no versions, no bookkeeping: the floor under anything a
parameter server adds.

This module imports neither torch nor the project's server code.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import zmq

from paramserver.util.jsontypes import JSONObject

from .common import (
    Announce,
    FixedSizeSession,
    integer,
    number,
    rounds_until_stopped,
    split_range,
    strings,
    text,
)

__all__ = ["RawSession", "async_run", "serve", "stop", "stop_op"]

_TIMEOUT_MS = 300_000
_F32 = np.dtype(np.float32)


def _frames(a: int, b: int, chunk_elems: int) -> list[tuple[int, int]]:
    """[a, b) cut into pieces of at most ``chunk_elems``, as equal as possible."""
    n = max(1, -(-(b - a) // chunk_elems))
    return [(a + lo, a + hi) for lo, hi in split_range(b - a, n)]


def serve(args: JSONObject, announce: Announce) -> JSONObject:
    """One raw shard until an empty message arrives. ``args``: workers, lr, host (the
    address to bind, default loopback)."""
    workers = integer(args, "workers")
    lr = np.float32(number(args, "lr", 1e-3))
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{text(args, 'host', '127.0.0.1')}:*")
    announce({"address": sock.getsockopt_string(zmq.LAST_ENDPOINT)})
    p = scratch = agg = np.zeros(0, dtype=_F32)
    views: list[np.ndarray] = []
    waiting: list[zmq.Frame] = []
    steps = 0
    try:
        while True:
            msg = sock.recv_multipart(copy=False)
            ident, frames = msg[0], msg[1:]
            total = sum(len(f) for f in frames)
            if total == 0:
                sock.send_multipart([ident, b""])
                break
            if p.nbytes != total or len(views) != len(frames):  # a new payload: fresh arrays
                p = np.zeros(total // 4, dtype=_F32)
                scratch = np.empty_like(p)
                agg = np.zeros_like(p) if workers > 1 else scratch
                bounds = np.cumsum([0] + [len(f) // 4 for f in frames])
                views = [p[a:b] for a, b in itertools.pairwise(bounds)]
            offset = 0
            for f in frames:
                g = np.frombuffer(f.buffer, dtype=_F32)
                dst = agg[offset:offset + g.size]
                if workers == 1:
                    np.multiply(g, lr, out=dst)
                elif waiting:
                    np.add(dst, g, out=dst)
                else:
                    np.copyto(dst, g)
                offset += g.size
            waiting.append(ident)
            if len(waiting) < workers:
                continue
            if workers > 1:
                np.multiply(agg, lr / workers, out=agg)
            np.subtract(p, agg, out=p)
            # every worker waits for this reply before it sends again, so p is not
            # written while zmq may still read it
            for who in waiting:
                sock.send_multipart([who, *views], copy=False)
            waiting.clear()
            steps += 1
    finally:
        sock.close(0)
    return {"steps": steps}


class RawSession(FixedSizeSession):
    """One raw worker: push its gradient, receive the weights, copy them in.

    ``args``: addresses (one per shard), numel, chunk_bytes.
    """

    def __init__(self, args: JSONObject) -> None:
        self.numel = integer(args, "numel")
        chunk_elems = max(1, integer(args, "chunk_bytes", 2 << 20) // 4)
        ctx: zmq.Context[Any] = zmq.Context.instance()
        self.socks = []
        for addr in strings(args, "addresses"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, _TIMEOUT_MS)
            s.connect(addr)
            self.socks.append(s)
        self.weights = np.zeros(self.numel, dtype=_F32)
        self.grads = np.full(self.numel, 1e-3, dtype=_F32)
        self.frames = [_frames(a, b, chunk_elems)
                       for a, b in split_range(self.numel, len(self.socks))]

    def one_round(self) -> None:
        for s, pieces in zip(self.socks, self.frames, strict=True):
            s.send_multipart([self.grads[a:b] for a, b in pieces], copy=False)
        for s, pieces in zip(self.socks, self.frames, strict=True):
            reply = s.recv_multipart(copy=False)
            for f, (a, b) in zip(reply, pieces, strict=True):
                np.copyto(self.weights[a:b], np.frombuffer(f.buffer, dtype=_F32))

    def close(self) -> JSONObject:
        for s in self.socks:
            s.close(0)
        return {"checksum": float(self.weights[:16].sum())}


def async_run(args: JSONObject, announce: Announce) -> JSONObject:
    """The async limit: one raw worker's push + pull rounds, as fast as it can, against
    a raw shard serving one worker at a time (``workers`` 1: a step per push), until
    ``stop_file`` exists. Announces ``{"running": true}`` after the warm-up; returns
    its rounds and the seconds they took."""
    session = RawSession(args)
    try:
        rounds, seconds = rounds_until_stopped(session.one_round, args, announce)
        return {"pushes": rounds, "seconds": seconds}
    finally:
        session.close()


def stop(addresses: list[str], timeout_ms: int = 10_000) -> None:
    """Stop raw shards: an empty message to each."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    for addr in addresses:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, timeout_ms)
        s.connect(addr)
        try:
            s.send(b"")
            s.recv()
        except zmq.Again:
            pass
        finally:
            s.close(0)


def stop_op(args: JSONObject, announce: Announce) -> JSONObject:
    """:func:`stop` run by an agent (one that can reach the shards: another namespace's)."""
    addresses = strings(args, "addresses")
    stop(addresses, integer(args, "timeout_ms", 10_000))
    return {"stopped": len(addresses)}
