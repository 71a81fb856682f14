"""``python -m paramserver.benchmarks.hotpath``: a shard's CPU per small push, warm and cold.

A real :class:`~paramserver.server.loop.ShardServer` in this process gets a worker
(a :class:`~paramserver.benchmarks.ps.PSSession` on loopback: HELLO, INIT, a
few rounds), then its loop stops and its message handler alone is timed on
push + pull requests made beforehand, the bytes a worker sends: decode,
validation, the core's rules, the step, the reply, the watchdog's measuring.

Each case runs *warm* (requests back to back, as a microbenchmark would) and
*cold*: before each request a buffer larger than the last-level cache is
written, as happens on a busy host, where the other processes run between two
messages of a shard. On a 2-core machine with 4 workers the cold figure is the
one the async benchmark sees (docs/performance.md), and the gap between the
two is what the Python and torch code touched per message costs in cache
misses, beside the work itself.

Cases: ``async-8`` (the async benchmark's 4 KiB model in 8 tensors, a push
asking for the weights back) and ``sync-1`` (one worker's 1 KiB model in one
tensor, the 1 KiB round trip's shard side).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass

import torch

from paramserver.server.loop import ServerConfig, ShardServer
from paramserver.wire.protocol import Message, Op, encode

from .common import Timing
from .ps import PSSession

__all__ = ["CASES", "main", "measure"]

#: case -> (mode, elements, tensors)
CASES: dict[str, tuple[str, int, int]] = {"async-8": ("async", 1024, 8),
                                          "sync-1": ("sync", 256, 1)}
_IDENTITY = b"\x00bench"  # a routing id no peer has: the replies go nowhere


def _server(mode: str, numel: int, pieces: int) -> tuple[ShardServer, PSSession]:
    server = ShardServer(ServerConfig(mode=mode, expected_workers=1, optimizer="sgd",
                                      optimizer_args={"lr": 1e-3}, heartbeat_timeout=600.0,
                                      bind="tcp://127.0.0.1:0"))
    server.start()
    loop = threading.Thread(target=server.serve_forever, name="shard")
    loop.start()
    session = PSSession({"addresses": [server.address], "numel": numel, "rank": 0,
                         "pieces": pieces})
    for _ in range(20):
        session.one_round()
    # stop the loop but keep its socket: the handler is then driven from here
    close, server.socket.close = server.socket.close, lambda *a, **k: None  # type: ignore
    server.stop()
    loop.join()
    server.socket.close = close  # type: ignore[method-assign]
    return server, session


def _requests(server: ShardServer, session: PSSession, count: int) -> list[list[bytes]]:
    assert server.core is not None
    grads = session.client.plan.split_tensors(session.grads)[0]
    clock, first, out = session.clock, session.client._push_id + 1, []
    for i in range(count):
        # each push follows the one before: tagged with the version it will have read
        msg = Message(Op.PUSH, first + i, {
            "worker": session.client.worker, "push_id": first + i, "clock": clock + i,
            "num_samples": 1, "read_version": server.core.version + i, "pull": True}, grads)
        out.append([bytes(f) for f in encode(msg)])
    return out


@dataclass(frozen=True)
class HotPath:
    """One case's shard CPU per push + pull, warm and cold."""

    case: str
    pushes: int
    repeats: int
    thrash_mib: int
    warm: Timing
    cold: Timing


def measure(case: str, pushes: int = 2000, repeats: int = 5, thrash_mib: int = 32
            ) -> HotPath:
    """Median us per push + pull for ``case``, warm and cold (``thrash_mib`` written
    before each request), each over ``repeats`` batches of ``pushes``."""
    mode, numel, pieces = CASES[case]
    server, session = _server(mode, numel, pieces)
    junk = torch.zeros(thrash_mib << 18)  # float32: MiB * 2^20 / 4
    timings: dict[str, Timing] = {}
    try:
        errors = sum(n for k, n in server.counters.items() if k.startswith("error"))
        assert server.core is not None
        version = server.core.version
        requests = iter(_requests(server, session, 2 * repeats * pushes))
        for label, thrash in (("warm", False), ("cold", True)):
            times = []
            for _ in range(repeats):
                spent = 0.0
                for _ in range(pushes):
                    frames = next(requests)
                    if thrash:
                        junk.add_(1.0)
                    t0 = time.perf_counter()
                    server._handle(_IDENTITY, frames)  # type: ignore[arg-type]
                    spent += time.perf_counter() - t0
                times.append(spent / pushes * 1e6)
            timings[label] = Timing.of_us(times)
        refused = sum(n for k, n in server.counters.items() if k.startswith("error")) - errors
        applied = server.core.version - version
        if refused or applied != 2 * repeats * pushes:  # refusals would measure nothing
            raise RuntimeError(f"{refused} of the pushes were refused and {applied} of "
                               f"{2 * repeats * pushes} applied: {dict(server.counters)}")
    finally:
        session.client.close()
        server.socket.close(linger=0)
    return HotPath(case, pushes, repeats, thrash_mib, timings["warm"], timings["cold"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m paramserver.benchmarks.hotpath",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="repeatable; default: every case")
    ap.add_argument("--pushes", type=int, default=2000, help="per batch (default 2000)")
    ap.add_argument("--repeats", type=int, default=5, help="batches (default 5)")
    args = ap.parse_args(argv)
    os.environ.setdefault("PARAMSERVER_SHM", "0")  # the TCP path: no segment to set up
    print("us of the shard's CPU per push + pull, median [min-max] over batches")
    print("| case | warm | cold (cache written over before each) | cold / warm |")
    print("|---|---|---|---|")
    for case in args.case or list(CASES):
        r = measure(case, args.pushes, args.repeats)
        print(f"| {case} | {r.warm.cell(1)} | {r.cold.cell(1)} | "
              f"{r.cold.median_us / r.warm.median_us:.2f} |")


if __name__ == "__main__":
    main()
