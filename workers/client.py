"""PSClient: a worker's (or an observer's) view of all shards at once.

Requests go to every shard before any reply is awaited, so shards work
concurrently. Pulled slices are copied straight from the received frames into
the model's parameters; pushed gradient slices are zero-copy views of the
gradients (on CUDA, of pinned host copies). A heartbeat thread with its own
sockets keeps the worker in the live set while it computes or waits.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from paramserver.errors import RemoteError, TransportError
from paramserver.protocol import PROTOCOL_VERSION, Message, Op
from paramserver.sharding import ShardPlan
from paramserver.transport import Channel, CurveKeys, request_all

__all__ = ["PSClient", "PullResult", "PushResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullResult:
    versions: tuple[int, ...]  # per shard, the version the weights were read at
    clock: int  # the worker's clock as the shards see it (max over shards)
    waited: float  # longest time a shard held the pull back (sync barrier / SSP gate)
    seconds: float  # wall time of the whole pull
    nbytes: int


@dataclass(frozen=True)
class PushResult:
    outcomes: tuple[dict[str, Any], ...]  # per shard: accepted, weight, reason, staleness, ...
    seconds: float
    nbytes: int

    @property
    def accepted(self) -> bool:
        return all(o["accepted"] for o in self.outcomes)

    @property
    def staleness(self) -> int:
        return max((o["staleness"] for o in self.outcomes), default=0)

    @property
    def reasons(self) -> list[str]:
        return sorted({o["reason"] for o in self.outcomes if not o["accepted"]})


class _Heartbeat(threading.Thread):
    """Sends HEARTBEAT to every shard every ``interval`` s from its own sockets."""

    def __init__(self, addresses: Sequence[str], worker: int, interval: float,
                 curve: CurveKeys | None) -> None:
        super().__init__(name=f"heartbeat-w{worker}", daemon=True)
        self.addresses, self.worker, self.interval, self.curve = addresses, worker, interval, curve
        self._stop_event = threading.Event()
        self.last_reply: dict[int, float] = {}

    def run(self) -> None:
        ctx = zmq.Context.instance()
        chans = [Channel(a, peer=f"shard {i}", curve=self.curve, context=ctx)
                 for i, a in enumerate(self.addresses)]
        try:
            while not self._stop_event.wait(self.interval):
                for i, ch in enumerate(chans):
                    try:
                        while ch.recv_nowait() is not None:
                            self.last_reply[i] = time.monotonic()
                        ch.send(Message(Op.HEARTBEAT, ch.next_seq(), {"worker": self.worker}))
                    except Exception as exc:  # a heartbeat must never kill the worker
                        log.debug("heartbeat to shard %d failed: %s", i, exc)
        finally:
            for ch in chans:
                ch.close()

    def stop(self) -> None:
        self._stop_event.set()


class PSClient:
    """Talks to S shard servers on behalf of one worker (or one observer)."""

    def __init__(
        self,
        addresses: Sequence[str],
        plan: ShardPlan,
        worker: int,
        *,
        role: str = "worker",
        timeout: float = 60.0,
        retries: int = 2,
        heartbeat_interval: float = 1.0,
        curve: CurveKeys | None = None,
    ) -> None:
        if len(addresses) != plan.num_shards:
            raise TransportError(
                f"{len(addresses)} server addresses given but the plan has {plan.num_shards} shards"
            )
        self.addresses = list(addresses)
        self.plan = plan
        self.worker = worker
        self.role = role
        self.timeout = timeout
        self.retries = retries
        self.incarnation = uuid.uuid4().hex
        self.channels = [Channel(a, peer=f"shard {i}", curve=curve)
                         for i, a in enumerate(addresses)]
        self._push_id = 0
        self._heartbeat = (
            _Heartbeat(addresses, worker, heartbeat_interval, curve)
            if role == "worker" and heartbeat_interval > 0 else None
        )
        self._shard_slices = [plan.shard_slices(s) for s in range(plan.num_shards)]
        self._pinned: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ session

    def connect(self, timeout: float | None = None) -> int:
        """HELLO to every shard. Returns the clock to resume at (0 for a new worker)."""
        msgs = [Message(Op.HELLO, 0, {
            "worker": self.worker, "role": self.role, "protocol": PROTOCOL_VERSION,
            "plan_hash": self.plan.hash, "plan": self.plan.describe(),
            "incarnation": self.incarnation,
        }) for _ in self.channels]
        replies = request_all(self.channels, msgs, timeout or self.timeout, "HELLO",
                              retries=self.retries)
        if self._heartbeat is not None and not self._heartbeat.is_alive():
            self._heartbeat.start()
        return max(r["clock"] for r in replies)

    def initialize(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Offer our weights to every shard; the first INIT per shard wins.

        Returns True if this worker seeded at least one shard.
        """
        parts = self.plan.split_tensors({k: v.detach().cpu() for k, v in params.items()})
        msgs = [Message(Op.INIT, 0, {"worker": self.worker}, parts.get(s, {}))
                for s in range(len(self.channels))]
        replies = request_all(self.channels, msgs, self.timeout, "INIT", retries=self.retries)
        return any(r["seeded"] for r in replies)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            if self._heartbeat.is_alive():
                self._heartbeat.join(timeout=2)
        for ch in self.channels:
            ch.close()

    def bye(self) -> None:
        msgs = [Message(Op.BYE, 0, {"worker": self.worker}) for _ in self.channels]
        request_all(self.channels, msgs, self.timeout, "BYE")

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ data

    def pull(self, params: Mapping[str, torch.Tensor], clock: int = 0,
             timeout: float | None = None) -> PullResult:
        """Fetch every shard's slices into ``params`` (in place, any device)."""
        t0 = time.perf_counter()
        observer = self.role != "worker"
        msgs = [Message(Op.PULL, 0, {"worker": self.worker, "clock": clock, "observer": observer})
                for _ in self.channels]
        replies = request_all(self.channels, msgs, timeout or self.timeout, "PULL",
                              retries=self.retries)
        nbytes = 0
        with torch.no_grad():
            for rep in replies:
                self.plan.assemble_into(params, rep.tensors)
                nbytes += rep.nbytes
        return PullResult(
            versions=tuple(r["version"] for r in replies),
            clock=max(r["clock"] for r in replies),
            waited=max(float(r.get("waited", 0.0)) for r in replies),
            seconds=time.perf_counter() - t0,
            nbytes=nbytes,
        )

    def _host_grads(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, g in grads.items():
            if g.device.type == "cpu":
                out[name] = g.detach()
                continue
            buf = self._pinned.get(name)
            if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
                buf = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                self._pinned[name] = buf
            buf.copy_(g.detach(), non_blocking=True)
            out[name] = buf
        if any(g.device.type == "cuda" for g in grads.values()):
            torch.cuda.synchronize()
        return out

    def push(self, grads: Mapping[str, torch.Tensor], read_versions: Sequence[int],
             num_samples: int, clock: int) -> PushResult:
        """Send gradient slices to every shard, tagged with the version each was read at."""
        t0 = time.perf_counter()
        parts = self.plan.split_tensors(self._host_grads(grads))
        self._push_id += 1
        msgs = [Message(Op.PUSH, 0, {
            "worker": self.worker, "push_id": self._push_id, "clock": clock,
            "read_version": read_versions[s], "num_samples": num_samples,
        }, parts.get(s, {})) for s in range(len(self.channels))]
        replies = request_all(self.channels, msgs, self.timeout, "PUSH", retries=self.retries)
        return PushResult(
            outcomes=tuple(r.fields for r in replies),
            seconds=time.perf_counter() - t0,
            nbytes=sum(m.nbytes for m in msgs),
        )

    def stats(self) -> list[dict[str, Any]]:
        replies = request_all(self.channels, [Message(Op.STATS) for _ in self.channels],
                              self.timeout, "STATS")
        return [r.fields for r in replies]


def shutdown_servers(addresses: Sequence[str], timeout: float = 10.0) -> list[str]:
    """Ask each server to stop; returns the addresses that did not answer."""
    failed = []
    for i, addr in enumerate(addresses):
        ch = Channel(addr, peer=f"shard {i}")
        try:
            ch.request(Message(Op.SHUTDOWN), timeout)
        except (TransportError, RemoteError) as exc:
            log.warning("shard %d at %s: %s", i, addr, exc)
            failed.append(addr)
        finally:
            ch.close()
    return failed


def server_stats(addresses: Sequence[str], timeout: float = 10.0) -> list[dict[str, Any]]:
    """STATS from each server, without registering (for status tools)."""
    chans = [Channel(a, peer=f"shard {i}") for i, a in enumerate(addresses)]
    try:
        replies = request_all(chans, [Message(Op.STATS) for _ in chans], timeout, "STATS")
        return [r.fields for r in replies]
    finally:
        for ch in chans:
            ch.close()
