"""What a shard answers about its peers: HELLO (the plan, the worker's
registration), HEARTBEAT (liveness, and why a parked pull waits) and BYE
(leaving, or reported dead). :class:`PeerOps` is a base of
:class:`~paramserver.server.loop.ShardServer`, which holds the state these handlers
read and defines what they call back into (adopting a plan, the core).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from paramserver.core.shard import DTYPES as CORE_DTYPES
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.shm.link import sweep
from paramserver.wire.messages import Bye, Hello
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, reply

if TYPE_CHECKING:
    from paramserver.core.shard import ShardCore
    from paramserver.observe.events import EventLog
    from paramserver.observe.recorder import ShardObserver
    from paramserver.policies.base import StalenessPolicy
    from paramserver.server.access import Access
    from paramserver.server.config import ServerConfig
    from paramserver.server.outbox import Outbox
    from paramserver.server.parts import JoinedParts, StreamedParts
    from paramserver.shm.link import ShmHub
    from paramserver.sparse.shard import SparseShard

__all__ = ["Observers", "PeerOps"]


class Observers:
    """The ZMQ identities that said HELLO as observers, the newest last: only they may
    read as observers (SPULL). Bounded: past ``limit`` the oldest is forgotten, and
    its next read is refused NOT_REGISTERED, which a client answers with a HELLO."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def add(self, identity: bytes) -> None:
        self._seen[identity] = None
        self._seen.move_to_end(identity)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)

    def __contains__(self, identity: object) -> bool:
        return identity in self._seen


class PeerOps:
    """The HELLO, HEARTBEAT and BYE handlers of a shard server."""

    config: ServerConfig
    plan: ShardPlan | None
    core: ShardCore | None
    sparse: SparseShard | None
    policy: StalenessPolicy
    peers: dict[int, dict[str, Any]]
    observers: Observers
    events: EventLog
    observer: ShardObserver
    joined: JoinedParts
    streamed: StreamedParts
    outbox: Outbox
    access: Access
    shm: ShmHub | None
    _told: set[int]

    _adopt_plan: Callable[[ShardPlan], None]  # the server builds its core from a plan

    def _require_core(self) -> ShardCore:
        if self.core is None:
            raise ProtocolError(ErrorCode.NOT_REGISTERED, "no worker has said HELLO yet")
        return self.core

    def _on_hello(self, msg: Message, identity: bytes) -> Message:
        b: Hello = msg.body
        if b.protocol != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.PROTOCOL_VERSION,
                f"peer speaks protocol {b.protocol}, server {PROTOCOL_VERSION}",
            )
        role = b.role
        if role not in ("worker", "observer"):
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"role must be worker or observer, not {role!r}")
        if self.plan is None:
            if role == "observer" or b.plan is None:
                raise ProtocolError(ErrorCode.NOT_REGISTERED,
                                    "no plan yet: a worker must say HELLO with its plan first")
            self._adopt_plan(self._peer_plan(b.plan, b.plan_hash))
        assert self.plan is not None and self.core is not None
        if b.plan_hash != self.plan.hash:
            what = self.plan.diff(b.plan) if b.plan is not None else "plan hash differs"
            raise ProtocolError(
                ErrorCode.PLAN_MISMATCH,
                f"worker {b.worker}'s model or shard layout differs from the server's: {what}",
            )
        clock = 0
        if role == "observer":
            self.observers.add(identity)
        if role == "worker":
            evicted = self.core.workers_evicted
            # as the worker says: shown by `status`; a host name is at most 253 characters
            host = (b.host or "")[:253] or None
            origin = f"pid {b.pid} on {host}" if host else ""
            peer = {"host": host, "pid": b.pid}
            state = self.core.register(b.worker, b.incarnation, time.monotonic(),
                                       origin=origin[:300])
            clock = state.clock
            if self.core.workers_evicted != evicted:
                self._forget_gone()
            if self.sparse is not None:
                self.sparse.forget(b.worker, restart=True)
            self.peers[b.worker] = peer
            self.events.write("worker_hello", shard=self.config.shard, worker=b.worker,
                              clock=clock, **peer)
        return reply(msg, shard=self.config.shard, num_shards=self.config.num_shards,
                     version=self.core.version, clock=clock, initialized=self.core.initialized,
                     mode=self.core.mode.describe(), policy=self.policy.describe())

    def _peer_plan(self, description: Any, plan_hash: str) -> ShardPlan:
        """A plan from a HELLO, validated and hash-checked before anything is built
        from it: the checks cost time in proportion to the message, and only a plan
        within --max-model-bytes (all it would cost) and the chunk limits whose hash
        matches, and is the one --plan-hash pins if set, is built."""
        pinned = self.config.plan_hash
        if pinned is not None and plan_hash != pinned:
            raise ProtocolError(ErrorCode.PLAN_MISMATCH, f"this shard accepts only the plan "
                                f"{pinned[:12]}... (--plan-hash), not {plan_hash[:12]}...")
        try:
            specs, shards, chunk, split, sparse = ShardPlan.checked_plan(
                description, self.config.plan_limits())
        except ConfigError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"invalid plan: {exc}") from exc
        if shards != self.config.num_shards:
            raise ProtocolError(
                ErrorCode.PLAN_MISMATCH,
                f"the worker's plan has {shards} shards; this server is shard "
                f"{self.config.shard} of {self.config.num_shards}")
        odd = sorted({p.dtype for p in specs if p.dtype not in CORE_DTYPES})
        if odd:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"invalid plan: a shard trains floating "
                                f"point parameters only, not {', '.join(odd)}")
        if ShardPlan.description_hash(specs, shards, chunk, split, sparse) != plan_hash:
            raise ProtocolError(ErrorCode.PLAN_MISMATCH,
                                "the plan's hash does not match the plan it came with")
        try:
            return ShardPlan(specs, shards, chunk, split, sparse)
        except ConfigError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"invalid plan: {exc}") from exc

    def _forget_gone(self) -> None:
        """Drop the server's own per-worker state of workers the core evicted."""
        assert self.core is not None
        known = self.core.workers
        self.joined.forget(known)
        self.streamed.forget(known)
        self.outbox.forget(known)
        self.access.forget(known)
        if self.shm is not None:
            self.shm.forget(known)
        for worker in [w for w in self.peers if w not in known]:
            del self.peers[worker]
        self._told &= set(known)
        self.observer.forget(set(known))

    def _on_heartbeat(self, msg: Message, identity: bytes) -> Message:
        now = time.monotonic()
        worker = msg.body.worker  # (a Heartbeat)
        if self.core is not None and worker in self.core.workers:
            self.core.heartbeat(worker, now)
        fields: dict[str, Any] = {"version": self.core.version if self.core else 0}
        # the worker's pull parked at a gate: its client tells a shard that holds the
        # pull (waiting is legitimate) from one that does not answer
        held = self.core.pulls.held(worker) if self.core is not None else None
        if held is not None:
            fields["held"] = {"clock": held.clock, "waited": now - held.since,
                              "why": self._hold_reason(held.worker)}
        elif self.sparse is not None:  # a sync SPUSH parked in its round, if any
            sparse_held = self.core.rows.holding(worker) if self.core else None
            if sparse_held:
                fields["held"] = sparse_held
        return reply(msg, **fields)

    def _hold_reason(self, worker: int) -> str:
        """Why ``worker``'s parked pull is not answered yet, in a few words."""
        core = self.core
        assert core is not None
        if not core.initialized:
            return "waiting for the weights (INIT)"
        if not core.started:
            return (f"waiting for {core.config.expected_workers} workers to register "
                    f"({len(core.workers)} have)")
        if core.mode.mode == "sync":
            missing = sorted(w.worker for w in core.live() if w.worker not in core.round.members)
            return f"sync barrier: waiting for the pushes of workers {missing}"
        if core.mode.mode == "ssp":
            return f"SSP gate: slowest worker at clock {core.min_clock()}, bound {core.bound}"
        return "gate closed"

    def _on_bye(self, msg: Message, identity: bytes) -> Message:
        core = self._require_core()
        b: Bye = msg.body
        core.members.known(b.worker)
        self.joined.drop(b.worker)
        if b.dead:  # from a supervisor that saw the process die
            dead = core.declare_dead(b.worker)
            sweep() if self.shm else None
            if dead:
                self.events.write("worker_dead", shard=self.config.shard, worker=b.worker,
                                  reported=True)
                self.observer.left(core, b.worker)
            return reply(msg, dead=dead)
        core.leave(b.worker, time.monotonic())
        if self.sparse is not None:
            self.sparse.forget(b.worker)
        self.events.write("worker_bye", shard=self.config.shard, worker=b.worker)
        self.observer.left(core, b.worker)
        return reply(msg)
