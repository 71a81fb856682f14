"""What a shard answers about its peers: HELLO (the plan, the worker's
registration), HEARTBEAT (liveness, and why a parked pull waits) and BYE
(leaving, or reported dead). :class:`Peers` holds what these learn (each worker's
host and pid, the identities that said HELLO as observers) and is given the rest:
the server's constant parts at construction, and what changes with the plan
(the core, the sparse tables) through the small :class:`PeerHost` Protocol.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Container
from typing import TYPE_CHECKING, Protocol, TypedDict

from paramserver.core.membership import check_run
from paramserver.core.records import HoldNote
from paramserver.core.shard import DTYPES as CORE_DTYPES
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.observe import records as ev
from paramserver.shm.link import sweep
from paramserver.util.jsontypes import JSONObject
from paramserver.wire.messages import Bye, Hello
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, reply

if TYPE_CHECKING:
    from paramserver.core.shard import ShardCore
    from paramserver.observe.events import EventLog
    from paramserver.observe.recorder import ShardObserver
    from paramserver.policies.base import StalenessPolicy
    from paramserver.server.config import ServerConfig
    from paramserver.server.parts import JoinedParts
    from paramserver.server.scriptopt import ScriptOptimizer
    from paramserver.server.tracer import ShardTracer
    from paramserver.sparse.shard import SparseShard

__all__ = ["Observers", "PeerHost", "PeerInfo", "Peers", "require_core"]


class PeerInfo(TypedDict):
    """Where a worker runs, as its HELLO says: shown by `status` (STATS), logged."""

    host: str | None
    pid: int | None


class PeerHost(Protocol):
    """What the peer handlers read of the server that owns them: what a plan builds
    (None before one is adopted), and the two things they ask of it."""

    @property
    def plan(self) -> ShardPlan | None: ...

    @property
    def core(self) -> ShardCore | None: ...

    @property
    def sparse(self) -> SparseShard | None: ...

    @property
    def script(self) -> ScriptOptimizer: ...

    def adopt_plan(self, plan: ShardPlan) -> None:
        """Build the core (and sparse tables) of ``plan``."""

    def forget_gone(self) -> None:
        """Drop the server's per-worker state of workers the core evicted."""


def require_core(core: ShardCore | None) -> ShardCore:
    """``core``, or the NOT_REGISTERED every op but HELLO gets before a plan."""
    if core is None:
        raise ProtocolError(ErrorCode.NOT_REGISTERED, "no worker has said HELLO yet")
    return core


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


class Peers:
    """The HELLO, HEARTBEAT and BYE handlers of a shard server, and what they learn."""

    def __init__(self, host: PeerHost, config: ServerConfig, policy: StalenessPolicy,
                 events: EventLog, observer: ShardObserver, joined: JoinedParts,
                 shm: bool) -> None:
        self.host = host
        self.config = config
        self.policy = policy
        self.tracer: ShardTracer | None = None  # --trace: each BYE (tracer.py)
        self.events = events
        self.observer = observer
        self.joined = joined  # a leaving worker's pushes in parts are dropped
        self.shm = shm  # same-host workers' segments are swept when one dies
        self.known: dict[int, PeerInfo] = {}  # worker -> host and pid from its HELLO
        self.observers = Observers()  # the identities that said HELLO as observers
        self.training_since: float | None = None  # when the start barrier passed
        self._all_done = False  # all_done was written, and no worker came since

    def forget(self, known: Container[int]) -> None:
        """Keep only the workers in ``known`` (the core's, after an eviction)."""
        for worker in [w for w in self.known if w not in known]:
            del self.known[worker]

    def on_hello(self, msg: Message, identity: bytes) -> Message:
        b: Hello = msg.body
        if b.protocol != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.PROTOCOL_VERSION,
                f"peer speaks protocol {b.protocol}, server {PROTOCOL_VERSION}",
            )
        # before anything is learnt from it (a plan to adopt, a worker to register)
        self._check_run(b.run, f"worker {b.worker}")
        role = b.role
        if role not in ("worker", "observer"):
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"role must be worker or observer, not {role!r}")
        if self.host.plan is None:
            if role == "observer" or b.plan is None:
                raise ProtocolError(ErrorCode.NOT_REGISTERED,
                                    "no plan yet: a worker must say HELLO with its plan first")
            # the script's optimizer first: the plan's limits count its state
            self.host.script.adopt(b.optimizer if role == "worker" else None)
            self.host.adopt_plan(self._peer_plan(b.plan, b.plan_hash))
        plan, core = self.host.plan, self.host.core
        assert plan is not None and core is not None
        if b.plan_hash != plan.hash:
            what = plan.diff(b.plan) if b.plan is not None else "plan hash differs"
            raise ProtocolError(
                ErrorCode.PLAN_MISMATCH,
                f"worker {b.worker}'s model or shard layout differs from the server's: {what}",
            )
        if b.optimizer is not None:  # refused before it is registered
            self.host.script.check(b.optimizer)
        clock = 0
        if role == "observer":
            self.observers.add(identity)
        if role == "worker":
            evicted = core.workers_evicted
            # as the worker says: shown by `status`; a host name is at most 253 characters
            host = (b.host or "")[:253] or None
            origin = f"pid {b.pid} on {host}" if host else ""
            peer = PeerInfo(host=host, pid=b.pid)
            # how it joins, read before register changes the worker's entry
            before = core.workers.get(b.worker)
            from_clock = before.clock if before is not None else None
            joined = ("resumed" if b.worker in core.members.awaited else "new"
                      if before is None else "restart"
                      if before.incarnation != b.incarnation else "again"
                      if before.live and not before.finished else "back")
            started = core.started
            state = core.register(b.worker, b.incarnation, time.monotonic(),
                                  origin=origin[:300])
            clock = state.clock
            if core.workers_evicted != evicted:
                self.host.forget_gone()
            sparse = self.host.sparse
            if sparse is not None:
                sparse.forget(b.worker, restart=True)
            self.known[b.worker] = peer
            self.events.write(ev.WorkerHello(shard=self.config.shard, worker=b.worker, clock=clock,
                                             host=host, pid=b.pid, joined=joined,
                                             from_clock=from_clock))
            if joined != "again":
                self._all_done = False
            if core.started and not started:
                self.training_since = time.monotonic()
                self.events.write(ev.TrainingStart(shard=self.config.shard,
                                                   mode=core.mode.describe(),
                                                   workers=sorted(core.members.live_ids()),
                                                   version=core.version))
        return reply(msg, shard=self.config.shard, num_shards=self.config.num_shards,
                     version=core.version, clock=clock, initialized=core.initialized,
                     mode=core.mode.describe(), policy=self.policy.describe(),
                     lr=core.stepper.lr, squeeze=core.squeeze is not None)

    def _peer_plan(self, description: JSONObject, plan_hash: str) -> ShardPlan:
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

    def _check_run(self, run: str | None, who: str) -> None:
        check_run(self.config.run_id, run, who, f"this shard ({self.config.shard})")

    def on_heartbeat(self, msg: Message, identity: bytes) -> Message:
        now = time.monotonic()
        worker = msg.body.worker  # (a Heartbeat)
        # a worker of another run, whose shard this one replaced at its address: told
        # so, never counted live here nor told of a pull held for our worker of its id
        self._check_run(msg.body.run, f"worker {worker}")
        core = self.host.core
        if core is not None and worker in core.workers:
            state = core.workers[worker]
            dead, was = not state.live and not state.finished, state.clock
            core.heartbeat(worker, now)
            if dead and state.live:  # declared dead, and alive after all: it is back
                self._all_done = False
                self.events.write(ev.WorkerBack(shard=self.config.shard, worker=worker,
                                                from_clock=was, clock=state.clock))
        version = core.version if core is not None else 0
        # the worker's pull parked at a gate: its client tells a shard that holds the
        # pull (waiting is legitimate) from one that does not answer
        held = core.pulls.held(worker) if core is not None else None
        note: HoldNote | None = None
        if core is not None and held is not None:
            note = HoldNote(clock=held.clock, waited=now - held.since,
                            why=self._final_reason(core) if held.final
                            else self._hold_reason(core))
        elif core is not None and self.host.sparse is not None:
            note = core.rows.holding(worker)  # a sync SPUSH parked in its round, if any
        if note:
            return reply(msg, version=version, held=note)
        return reply(msg, version=version)

    def _final_reason(self, core: ShardCore) -> str:
        """Who a final pull (``opt.final()``) still waits for here, by the rule it waits on
        (:meth:`~paramserver.core.membership.Membership.holding`)."""
        holding = core.holding(self.config.expected_workers)
        never = [w for w in holding if w not in core.workers]
        live = [w for w in holding if w in core.workers]
        parts = ([f"worker(s) {', '.join(map(str, live))} to finish (BYE) or be judged dead"]
                 if live else [])
        if never:
            parts.append(f"worker(s) {', '.join(map(str, never))} to say HELLO")
        return "final weights: waiting for " + " and ".join(parts or ["nobody"])

    @staticmethod
    def _hold_reason(core: ShardCore) -> str:
        """Why a worker's parked pull is not answered yet, in a few words."""
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

    def on_bye(self, msg: Message, identity: bytes) -> Message:
        core = require_core(self.host.core)
        b: Bye = msg.body
        core.members.known(b.worker)
        self.joined.drop(b.worker)
        if b.dead:  # from a supervisor that saw the process die
            dead = core.declare_dead(b.worker)
            sweep() if self.shm else None
            if dead:
                self.events.write(ev.WorkerDead(shard=self.config.shard, worker=b.worker,
                                                reported=True, clock=core.workers[b.worker].clock))
                self.observer.left(core, b.worker)
                self.maybe_all_done(core)
            return reply(msg, dead=dead)
        core.leave(b.worker, time.monotonic())
        if self.tracer is not None:
            self.tracer.left(b.worker, time.monotonic())
        sparse = self.host.sparse
        if sparse is not None:
            sparse.forget(b.worker)
        self.events.write(ev.WorkerBye(shard=self.config.shard, worker=b.worker,
                                       clock=core.workers[b.worker].clock))
        self.observer.left(core, b.worker)
        self.maybe_all_done(core)
        return reply(msg)

    def maybe_all_done(self, core: ShardCore) -> None:
        """After a worker left or died: once training started and no expected worker is
        still awaited or live, say so (once, until a worker comes again)."""
        if self._all_done or not core.started or core.holding(self.config.expected_workers):
            return
        self._all_done = True
        gone = sorted(core.workers.values(), key=lambda w: w.worker)
        since = self.training_since
        self.events.write(ev.AllDone(shard=self.config.shard, version=core.version,
                                     seconds=time.monotonic() - since if since is not None else 0.0,
                                     finished=[w.worker for w in gone if w.finished],
                                     dead=[w.worker for w in gone if not w.finished]))
