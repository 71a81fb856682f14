"""``python -m paramserver.benchmarks.breakdown``: where a small push + pull's CPU goes,
part by part, on the shard and on a worker, warm and cold.

The shard side is :mod:`hotpath`'s set-up (a real ShardServer's handler driven with
a worker's requests made beforehand, async, 4 KiB in 8 tensors, each push asking
for the weights back). The worker side is a :class:`~paramserver.benchmarks.ps.PSSession`
doing ``push_pull`` rounds against a real shard in another process (a benchmark
agent, as in the async benchmark), so that the worker's main thread is measured
alone. Each part is a method or function of the path, wrapped to add up the
calling thread's CPU time (``time.thread_time``: another thread's or process's
work is not counted, and a wait in ``poll`` costs only the CPU it burns, the
``wait`` row); a row is that part less the parts inside it, and the last row of
each side is the rest of the whole (on the worker: the bookkeeping of the round).
The wrappers cost about 0.5 us each per call, counted in the part that made the call;
the worker's rounds are timed whole first, nothing wrapped (``unwrapped``), which is
the figure to compare two trees by.

*Warm*: requests or rounds back to back. *Cold*: a buffer larger than the
last-level cache is written before each, as on a busy host (docs/performance.md).
Figures are medians over batches, in microseconds per push + pull.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paramserver.server import loop as server_loop
from paramserver.util.jsontypes import JSON
from paramserver.wire import transport

from . import hotpath
from .ps import PSSession

__all__ = ["SHARD_PARTS", "WORKER_PARTS", "Breakdown", "Part", "main", "measure_shard",
           "measure_worker"]


@dataclass(frozen=True)
class Part:
    """One row: ``name`` wraps what, inside which other part, and what it buys."""

    name: str
    parent: str | None
    buys: str


#: the shard's parts, parents before children ("handler": the whole of _handle)
SHARD_PARTS = (
    Part("handler", None, "dispatch, counters, access check, the sends' bookkeeping"),
    Part("decode", "handler", "decode: header checks, the typed record, the tensor views"),
    Part("on_push", "handler", "the push's handler: the outcome, parking the pull"),
    Part("rules", "on_push", "consistency rules: push-id window, clocks, staleness "
                             "decision, policy, tensor checks"),
    Part("finite", "rules", "the finite check (one norm over the push's span)"),
    Part("step", "rules", "the step and its finite guard"),
    Part("reply", "handler", "the parked pull's reply: its gate, header and send"),
    Part("observe", "handler", "observation after the reply: queue and events"),
    Part("probe", "observe", "measurements within the budget: cosine, running mean, "
                             "step norms"),
    Part("watch", "observe", "metrics and watchdog rules of every push and pull"),
)

#: the worker's parts ("round": the whole of push_pull, its rest the bookkeeping)
WORKER_PARTS = (
    Part("round", None, "bookkeeping: the request's slots, matching the reply by seq, "
                        "the round's results"),
    Part("build", "round", "the push: gradients checked and packed into one frame, its "
                           "fields"),
    Part("send", "round", "encode (the header around the frame) and zmq's send"),
    Part("wait", "round", "zmq's poll until the reply is in (the CPU it burns)"),
    Part("receive", "round", "zmq's receive of the reply's frames"),
    Part("decode", "receive", "the reply: header checks, outcome and pull records, the "
                              "weights' views"),
    Part("land", "round", "the weights checked and copied into the model"),
)


class _Clock:
    """Adds up the calling thread's CPU time per part, through wrappers."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.owner = threading.get_ident()  # calls from other threads are not counted

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        spent = self.spent
        spent.setdefault(name, 0.0)
        clock = time.thread_time
        owner, ident = self.owner, threading.get_ident

        def timed(*args: Any, **kwargs: Any) -> Any:
            if ident() != owner:  # (a heartbeat thread's poll, say)
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += clock() - t0

        return timed

    def patch(self, owner: Any, attr: str, name: str) -> None:
        setattr(owner, attr, self.wrap(getattr(owner, attr), name))

    def take(self) -> dict[str, float]:
        out = dict(self.spent)
        for k in self.spent:
            self.spent[k] = 0.0
        return out


@dataclass(frozen=True)
class Breakdown:
    """One side's figures: us per push + pull, warm and cold, per part (exclusive)."""

    side: str
    parts: tuple[Part, ...]
    warm: dict[str, float]
    cold: dict[str, float]
    #: the worker: its main thread's us per round over whole rounds, no part wrapped
    #: (median over batches), warm: the figure to compare trees by
    unwrapped: float | None = None

    def total(self, label: str) -> float:
        return sum((self.warm if label == "warm" else self.cold).values())


def _exclusive(parts: tuple[Part, ...], inclusive: dict[str, float]) -> dict[str, float]:
    out = dict(inclusive)
    for p in parts:
        if p.parent is not None:
            out[p.parent] -= inclusive[p.name]
    return out


def _batches(run: Callable[[bool], None], clock: _Clock, parts: tuple[Part, ...],
             count: int, repeats: int, thrash: torch.Tensor) -> tuple[dict[str, float],
                                                                      dict[str, float]]:
    """Median us per call of each part, warm and cold; ``run(cold)`` does one call."""
    out = []
    for cold in (False, True):
        per: dict[str, list[float]] = {p.name: [] for p in parts}
        for _ in range(repeats):
            clock.take()
            for _ in range(count):
                if cold:
                    thrash.add_(1.0)
                run(cold)
            spent = _exclusive(parts, clock.take())
            for name in per:
                per[name].append(spent[name] / count * 1e6)
        out.append({k: statistics.median(v) for k, v in per.items()})
    return out[0], out[1]


def measure_shard(pushes: int = 2000, repeats: int = 5, thrash_mib: int = 32) -> Breakdown:
    """The shard handler's parts, on hotpath's async-8 case."""
    server, session = hotpath._server(*hotpath.CASES["async-8"])
    assert server.core is not None
    requests = iter(hotpath._requests(server, session, 2 * repeats * pushes))
    clock = _Clock()
    handle = clock.wrap(server._handle, "handler")
    saved = server_loop.decode_request
    server_loop.decode_request = clock.wrap(saved, "decode")
    from paramserver.core import shard as core_shard
    saved_norm = core_shard.norm_and_span
    core_shard.norm_and_span = clock.wrap(saved_norm, "finite")
    try:
        from paramserver.wire.protocol import Op
        server._handlers[Op.PUSH] = clock.wrap(server._handlers[Op.PUSH], "on_push")
        clock.patch(server.core, "push", "rules")
        clock.patch(server.core.stepper, "step", "step")
        clock.patch(server.outbox, "answer_pulls", "reply")
        clock.patch(server, "_run_after_reply", "observe")
        clock.patch(server.measure_budget, "flush", "probe")
        clock.patch(server.observer, "push", "watch")
        clock.patch(server.observer, "pull", "watch")
        junk = torch.zeros(thrash_mib << 18)
        warm, cold = _batches(lambda _: handle(hotpath._IDENTITY, next(requests)), clock,
                              SHARD_PARTS, pushes, repeats, junk)
    finally:
        server_loop.decode_request = saved
        core_shard.norm_and_span = saved_norm
        session.client.close()
        server.socket.close(linger=0)
    return Breakdown("shard", SHARD_PARTS, warm, cold)


def measure_worker(rounds: int = 2000, repeats: int = 5, thrash_mib: int = 32) -> Breakdown:
    """A worker's push_pull parts, against a shard in a benchmark agent process."""
    from paramserver.workers.admin import shutdown_servers

    from .common import close_all
    from .extras import _start_servers

    servers, addrs = _start_servers("breakdown", 1, {
        "mode": "async", "expected_workers": 1, "optimizer": "sgd",
        "optimizer_args": {"lr": 1e-3}, "heartbeat_timeout": 600.0}, None)
    clock = _Clock()
    saved_decode, saved_poll = transport.decode, transport.poll
    session: PSSession | None = None
    try:
        addresses: list[JSON] = list(addrs)
        session = PSSession({"addresses": addresses, "numel": 1024, "rank": 0, "pieces": 8,
                             "shm": False})
        for _ in range(min(50, rounds)):  # warm-up
            session.one_round()
        whole = []
        for _ in range(repeats):
            t0 = time.thread_time()
            for _ in range(rounds):
                session.one_round()
            whole.append((time.thread_time() - t0) / rounds * 1e6)
        client = session.client
        transport.decode = clock.wrap(saved_decode, "decode")
        transport.poll = clock.wrap(saved_poll, "wait")
        push_pull = clock.wrap(client.push_pull, "round")
        clock.patch(client, "_small_push_msgs", "build")
        clock.patch(client, "_land", "land")
        for ch in client.channels:
            reader = getattr(ch, "reader", None)  # (absent from trees before readers)
            if reader is not None:  # a small model's replies: read without decode
                ch.reader = clock.wrap(reader, "decode")
            clock.patch(ch, "send", "send")
            clock.patch(ch, "recv_nowait", "receive")
        live = session

        def one(_: bool) -> None:
            live.versions = push_pull(live.grads, live.versions, 1, live.clock,
                                      live.params)[1].versions
            live.clock += 1

        junk = torch.zeros(thrash_mib << 18)
        warm, cold = _batches(one, clock, WORKER_PARTS, rounds, repeats, junk)
    finally:
        transport.decode, transport.poll = saved_decode, saved_poll
        if session is not None:
            session.client.close()
        shutdown_servers(addrs, timeout=5.0)
        close_all(servers)
    return Breakdown("worker", WORKER_PARTS, warm, cold, statistics.median(whole))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m paramserver.benchmarks.breakdown",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--pushes", type=int, default=2000, help="per batch (default 2000)")
    ap.add_argument("--repeats", type=int, default=5, help="batches (default 5)")
    ap.add_argument("--side", choices=("shard", "worker", "both"), default="both",
                    help="which side to measure (default both)")
    args = ap.parse_args(argv)
    os.environ.setdefault("PARAMSERVER_SHM", "0")  # the TCP path: no segment to set up
    print("us of CPU per push + pull (async, 4 KiB in 8 tensors), median over batches")
    print("| side | part | what it buys | warm | cold |")
    print("|---|---|---|---|---|")
    sides = {"shard": measure_shard, "worker": measure_worker}
    for side in ("shard", "worker") if args.side == "both" else (args.side,):
        b = sides[side](args.pushes, args.repeats)
        for p in b.parts[1:] + b.parts[:1]:
            print(f"| {b.side} | {p.name} | {p.buys} | {b.warm[p.name]:.1f} | "
                  f"{b.cold[p.name]:.1f} |")
        print(f"| {b.side} | **total** | | **{b.total('warm'):.1f}** | "
              f"**{b.total('cold'):.1f}** |")
        if b.unwrapped is not None:
            print(f"| {b.side} | whole rounds, nothing wrapped | the main thread per round "
                  f"| {b.unwrapped:.1f} | |")


if __name__ == "__main__":
    main()
