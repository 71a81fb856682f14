"""PSClient: a worker's (or an observer's) view of all shards at once.

Requests go to every shard before any reply is awaited, so shards work
concurrently. Pulled slices are copied straight from the received frames into
the model's parameters; pushed gradient slices are zero-copy views of the
gradients (on CUDA, of pinned host copies). A heartbeat thread with its own
sockets keeps the worker in the live set while it computes or waits.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from paramserver.errors import ErrorCode, RemoteError, TransportError
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
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
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
        attempt_timeout: float = 5.0,
        heartbeat_interval: float = 1.0,
        curve: CurveKeys | None = None,
        drop_rate: float = 0.0,
    ) -> None:
        if len(addresses) != plan.num_shards:
            raise TransportError(
                f"{len(addresses)} server addresses given but the plan has {plan.num_shards} shards"
            )
        self.addresses = list(addresses)
        self.plan = plan
        self.worker = worker
        self.role = role
        # a request is re-sent every attempt_timeout (a restarted server lost it;
        # duplicates are harmless: pushes carry ids, pulls replace each other)
        # until `timeout` has passed in all
        self.timeout = timeout
        self.attempt_timeout = min(attempt_timeout, timeout)
        self.retries = max(0, math.ceil(timeout / self.attempt_timeout) - 1)
        self._params: Mapping[str, torch.Tensor] | None = None
        self.incarnation = uuid.uuid4().hex
        self.channels = [Channel(a, peer=f"shard {i}", curve=curve, drop_rate=drop_rate,
                                 seed=worker * 1000 + i)
                         for i, a in enumerate(addresses)]
        self._push_id = 0
        self._heartbeat = (
            _Heartbeat(addresses, worker, heartbeat_interval, curve)
            if role == "worker" and heartbeat_interval > 0 else None
        )
        self._shard_slices = [plan.shard_slices(s) for s in range(plan.num_shards)]
        self._pinned: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ session

    def _hello(self) -> Message:
        return Message(Op.HELLO, 0, {
            "worker": self.worker, "role": self.role, "protocol": PROTOCOL_VERSION,
            "plan_hash": self.plan.hash, "plan": self.plan.describe(),
            "incarnation": self.incarnation,
        })

    def _init(self, shard: int) -> Message:
        assert self._params is not None
        host = {k: v.detach().cpu() for k, v in self._params.items()}
        part = self.plan.split_tensors(host).get(shard, {})
        return Message(Op.INIT, 0, {"worker": self.worker}, part)

    def _call(self, msgs: list[Message], what: str, shards: list[int] | None = None,
              recover: bool = True, soft: tuple[str, ...] = ()) -> list[Message]:
        """Send one message per shard and collect the replies.

        A shard that answers "not registered" (it restarted without our state,
        or timed us out) gets a fresh HELLO, and INIT from our current weights
        if it lost its own; then the request is repeated. Errors with a code in
        ``soft`` are returned for the caller; others raise RemoteError.
        """
        shards = list(range(len(self.channels))) if shards is None else shards
        chans = [self.channels[s] for s in shards]
        replies = request_all(chans, msgs, self.attempt_timeout, what, retries=self.retries,
                              raise_errors=False)
        for i, rep in enumerate(replies):
            if rep.op is not Op.ERROR or rep["code"] in soft:
                continue
            peer = f"{chans[i].peer} at {chans[i].address}"
            if recover and rep["code"] in (ErrorCode.NOT_REGISTERED, ErrorCode.NOT_INITIALIZED):
                log.warning("%s: %s; registering again", peer, rep["reason"])
                self._rejoin(shards[i])
                retry = Message(msgs[i].op, 0, dict(msgs[i].fields), msgs[i].tensors)
                replies[i] = self._call([retry], what, [shards[i]], recover=False,
                                        soft=soft)[0]
            else:
                raise RemoteError(peer, rep["code"], rep["reason"])
        return replies

    def _rejoin(self, shard: int) -> None:
        hello = self._call([self._hello()], "HELLO", [shard], recover=False)[0]
        if not hello["initialized"] and self._params is not None and self.role == "worker":
            log.warning("shard %d lost its weights; seeding it from this worker's copy", shard)
            self._call([self._init(shard)], "INIT", [shard], recover=False)

    def connect(self) -> int:
        """HELLO to every shard. Returns the clock to resume at (0 for a new worker).

        A restarted worker may find its previous incarnation still registered;
        the shards take it over once that one misses its heartbeats, so the
        HELLO is repeated with backoff until then (within ``timeout``).
        """
        deadline = time.monotonic() + self.timeout
        backoff = 0.1
        while True:
            replies = self._call([self._hello() for _ in self.channels], "HELLO",
                                 recover=False, soft=(ErrorCode.DUPLICATE_WORKER,))
            refused = [r for r in replies if r.op is Op.ERROR]
            if not refused:
                break
            if time.monotonic() + backoff > deadline:
                raise RemoteError("shards", refused[0]["code"], refused[0]["reason"])
            log.info("worker %d still registered by its previous process; retrying in %.1fs",
                     self.worker, backoff)
            time.sleep(backoff)  # backoff before a retry, not synchronisation
            backoff = min(2.0, backoff * 2)
        if self._heartbeat is not None and not self._heartbeat.is_alive():
            self._heartbeat.start()
        return max(r["clock"] for r in replies)

    def initialize(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Offer our weights to every shard; the first INIT per shard wins.

        Returns True if this worker seeded at least one shard.
        """
        self._params = params
        replies = self._call([self._init(s) for s in range(len(self.channels))], "INIT")
        return any(r["seeded"] for r in replies)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            if self._heartbeat.is_alive():
                self._heartbeat.join(timeout=2)
        for ch in self.channels:
            ch.close()

    def bye(self) -> None:
        self._call([Message(Op.BYE, 0, {"worker": self.worker}) for _ in self.channels], "BYE",
                   recover=False)

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ data

    def pull(self, params: Mapping[str, torch.Tensor], clock: int = 0) -> PullResult:
        """Fetch every shard's slices into ``params`` (in place, any device)."""
        t0 = time.perf_counter()
        observer = self.role != "worker"
        msgs = [Message(Op.PULL, 0, {"worker": self.worker, "clock": clock, "observer": observer})
                for _ in self.channels]
        if not observer:
            self._params = params
        replies = self._call(msgs, "PULL", recover=not observer)
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
             num_samples: int, clock: int, loss: float | None = None) -> PushResult:
        """Send gradient slices to every shard, tagged with the version each was read at
        (and the training loss of those samples, if given)."""
        t0 = time.perf_counter()
        parts = self.plan.split_tensors(self._host_grads(grads))
        self._push_id += 1
        fields: dict[str, Any] = {"worker": self.worker, "push_id": self._push_id,
                                  "clock": clock, "num_samples": num_samples}
        if loss is not None:  # the servers' divergence watchdog follows the training loss
            fields["loss"] = float(loss)
        msgs = [Message(Op.PUSH, 0, {**fields, "read_version": read_versions[s]},
                        parts.get(s, {})) for s in range(len(self.channels))]
        # a shard that restarted from an older checkpoint no longer has the
        # version our gradient was read at: that push is lost, not fatal
        replies = self._call(msgs, "PUSH", soft=(ErrorCode.FUTURE_VERSION,))
        outcomes = tuple(
            {"accepted": False, "weight": 0.0, "reason": "server rewound", "staleness": 0,
             "version": -1, "applied": False, "duplicate": False}
            if r.op is Op.ERROR else r.fields
            for r in replies
        )
        return PushResult(
            outcomes=outcomes,
            seconds=time.perf_counter() - t0,
            nbytes=sum(m.nbytes for m in msgs),
        )

    def stats(self) -> list[dict[str, Any]]:
        replies = self._call([Message(Op.STATS) for _ in self.channels], "STATS", recover=False)
        return [r.fields for r in replies]


def shutdown_servers(addresses: Sequence[str], timeout: float = 10.0,
                     curve: CurveKeys | None = None) -> list[str]:
    """Ask each server to stop; returns the addresses that did not answer."""
    failed = []
    for i, addr in enumerate(addresses):
        ch = Channel(addr, peer=f"shard {i}", curve=curve)
        try:
            ch.request(Message(Op.SHUTDOWN), timeout)
        except (TransportError, RemoteError) as exc:
            log.warning("shard %d at %s: %s", i, addr, exc)
            failed.append(addr)
        finally:
            ch.close()
    return failed


def server_stats(addresses: Sequence[str], timeout: float = 10.0,
                 curve: CurveKeys | None = None) -> list[dict[str, Any]]:
    """STATS from each server, without registering (for status tools)."""
    chans = [Channel(a, peer=f"shard {i}", curve=curve) for i, a in enumerate(addresses)]
    try:
        replies = request_all(chans, [Message(Op.STATS) for _ in chans], timeout, "STATS")
        return [r.fields for r in replies]
    finally:
        for ch in chans:
            ch.close()
