"""What a shard answers about its data: INIT (the weights), PULL, PUSH (whole or
in parts) and the sparse tables' SPULL, SPUSH and SINIT. :class:`DataOps` is
given the server's constant parts at construction, and reads what changes with
the plan (the core, the sparse tables) through the small :class:`OpsHost` Protocol;
the server's loop dispatches to it (paramserver/server/loop.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.observe import records as ev
from paramserver.server.peers import Observers, require_core
from paramserver.sparse.shard import SparseShard
from paramserver.wire.compressed import expand
from paramserver.wire.messages import Init, Pull, Push, SInit, SPull, SPush, replace
from paramserver.wire.protocol import Message, error_reply, reply

if TYPE_CHECKING:
    from paramserver.core.shard import ShardCore
    from paramserver.observe.events import EventLog
    from paramserver.observe.recorder import ShardObserver
    from paramserver.server.config import ServerConfig
    from paramserver.server.outbox import Outbox
    from paramserver.server.parts import JoinedParts, StreamedParts
    from paramserver.server.scriptopt import ScriptOptimizer
    from paramserver.server.tables import TableBuilder
    from paramserver.server.tracer import ShardTracer

__all__ = ["DataOps", "Handler", "OpsHost"]

log = logging.getLogger(__name__)

#: an op's handler: the message and its sender's identity in, the reply out (None:
#: answered later, from a parked pull or a held sparse request)
Handler = Callable[[Message, bytes], Message | None]


class OpsHost(Protocol):
    """What the data handlers read of the server that owns them: what a plan builds
    (None before one is adopted), and the three things they ask of it."""

    @property
    def core(self) -> ShardCore | None: ...

    @property
    def sparse(self) -> SparseShard | None: ...

    @property
    def tables(self) -> TableBuilder | None: ...

    @property
    def script(self) -> ScriptOptimizer: ...

    def before_mutation(self) -> None:
        """Copy-on-write: the weights still being sent are not written in place."""

    def maybe_checkpoint(self) -> None:
        """Save a checkpoint if one is due."""

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the reply is out (a push's metrics and event)."""


class DataOps:
    """The INIT, PULL, PUSH, SPULL, SPUSH and SINIT handlers of a shard server."""

    def __init__(self, host: OpsHost, config: ServerConfig, counters: Counter[str],
                 events: EventLog, observer: ShardObserver, outbox: Outbox,
                 joined: JoinedParts, streamed: StreamedParts, observers: Observers) -> None:
        self.host = host
        self.config = config
        self.counters = counters
        self.events = events
        self.observer = observer
        self.outbox = outbox
        self.joined = joined  # pushes in parts the core takes whole
        self.streamed = streamed  # pushes in parts the core adds part by part
        self.observers = observers  # only they may read as observers (SPULL)
        #: whether the message being handled comes from a key whose claimed figures (a
        #: push's loss) may stop the shard (Access.may_stop); set by the loop per message
        self.claims_may_stop = True
        self.tracer: ShardTracer | None = None  # --trace (tracer.py)

    def on_init(self, msg: Message, identity: bytes) -> Message:
        core = require_core(self.host.core)
        if not core.initialized:  # (steps protect the weights through core.before_step)
            self.host.before_mutation()
        b: Init = msg.body
        seeded = core.initialize_part(b.worker, msg.tensors, b.part, b.parts)
        tables = self.host.tables
        if core.initialized and tables is not None:
            tables.start()  # the plan's owner seeded: its sparse tables are due now
        if seeded:
            self.events.write(ev.Init(shard=self.config.shard, worker=b.worker))
        if seeded is None:
            return reply(msg, seeded=False, partial=True, version=core.version)
        return reply(msg, seeded=seeded, version=core.version)

    def on_pull(self, msg: Message, identity: bytes) -> None:
        core = require_core(self.host.core)
        b: Pull = msg.body
        core.request_pull(b.worker, b.clock, (identity, msg.seq), time.monotonic(),
                          observer=b.observer, wait_init=b.wait_init, final=b.final)
        if core.squeeze is not None and not b.observer:  # what it holds (pullsqueeze.py)
            core.squeeze.ask(b.worker, b.base)
        if b.observer:
            self.outbox.park_observer((identity, msg.seq))
        return None  # answered by ShardServer._answer_pulls, now or when the gate opens

    def on_push(self, msg: Message, identity: bytes) -> Message | None:
        core = require_core(self.host.core)
        b: Push = msg.body
        received = msg.nbytes  # (the bytes that came: compressed ones before they expand)
        if b.compressed:  # dense from here on: parts, policies and the step see no codec
            msg = Message(msg.op, msg.seq, msg.fields, expand(msg.tensors, core.specs), None, b)
        if b.lr is not None:  # every part carries it: set before the first is taken
            self._take_lr(core, b.worker, b.lr)
        streamed = b.parts != 1 and core.streams_parts
        if b.parts != 1:
            self.counters["push_parts_streamed" if streamed else "push_parts_joined"] += 1
        if b.parts != 1 and not streamed:
            whole = self.joined.join(core, msg)
            if whole is None:
                return reply(msg, partial=True)  # the outcome comes with the last part
            msg, b = whole, whole.body
        read_version, loss, trusted = b.read_version, b.loss, self.claims_may_stop
        t0 = time.perf_counter()
        core.ahead.eager = streamed and b.early
        try:
            now = time.monotonic()
            out = core.push(b.worker, b.push_id, b.clock, read_version, b.num_samples,
                            msg.tensors, now, b.part, b.parts)
        except ProtocolError as exc:
            self.streamed.drop(b.worker)
            if exc.code == ErrorCode.NONFINITE:
                self.observer.nonfinite(b.worker, loss, loss_may_stop=trusted)
            raise
        finally:
            core.ahead.eager = False
        if streamed:
            # sync: each part was added into the round's buffer and its frames are free;
            # what the answer needs of the earlier parts is kept here
            pull, nbytes = self.streamed.tally(msg, last=out is not None)
            if out is None:
                return self._partial(core, msg)
            early = self.streamed.early_of(msg)
            b = replace(b, pull=pull)
        else:
            nbytes, early = (msg.nbytes if b.parts != 1 else received), None
        assert out is not None  # only a streamed part that is not the last has none
        if out.duplicate:
            self.counters["duplicate_pushes"] += 1
        else:
            seconds = time.perf_counter() - t0
            worker, clock, samples = b.worker, b.clock, b.num_samples
            if self.tracer is not None:
                self.tracer.arrival(worker, b.push_id, clock, read_version, samples, out,
                                    nbytes, b.parts, now)

            def observe() -> None:
                grad = self.observer.push(core, worker, out, loss=loss, seconds=seconds,
                                          nbytes=nbytes, loss_may_stop=trusted)
                self.events.write(ev.Push(shard=self.config.shard, worker=worker, clock=clock,
                                          read_version=read_version, version=out.version,
                                          staleness=out.staleness, accepted=out.accepted,
                                          weight=out.weight, reason=out.reason, num_samples=samples,
                                          loss=loss, grad_norm=grad.norm if grad else None,
                                          cosine=grad.cosine if grad else None))

            self.host.defer(observe)
        if out.applied and (self.config.checkpoint_every or self.config.checkpoint_seconds):
            self.host.maybe_checkpoint()
        if b.pull:
            # push + pull in one round trip: the answer is the pull's, sent when its
            # gate opens (in sync mode, when the round closes), with this outcome in it
            token = (identity, msg.seq)
            core.request_pull(b.worker, b.clock + 1, token, time.monotonic())
            if core.squeeze is not None:
                core.squeeze.ask(b.worker, b.base)
            self.outbox.park_push_pull(b.worker, token, out, early)
            return None
        return reply(msg, **out.as_dict())

    def _take_lr(self, core: ShardCore, worker: int, lr: float) -> None:
        """A registered worker's learning-rate change (scriptopt.py)."""
        core.members.known(worker)  # NOT_REGISTERED for an id that said no HELLO
        self.host.script.set_lr(core, self.host.sparse, worker, lr)

    def _partial(self, core: ShardCore, msg: Message) -> Message:
        """The answer to a part that is not the last. With ``early`` (the worker takes
        its weights over TCP and asked for the push's next weights), it carries the
        next weights of every slice the round stepped ahead (issue 17, item 4: a lone
        worker's part; issue 45: a slice whose sum over every worker is final) and
        that did not go back to this worker yet: they travel while later parts do,
        and the round's answer leaves them out if it commits those very weights
        (Outbox.answer_pulls). What goes is only what the core released."""
        b: Push = msg.body
        if b.early:
            alone = all(w.worker == b.worker for w in core.live())
            version = core.version + 1
            ready = core.ahead.released(self.streamed.sent(msg, version), lend=alone)
            if ready is not None:
                self.streamed.sent_early(msg, version, ready.keys())
                self.counters["early_parts"] += 1
                return reply(msg, ready, partial=True, early=version)
        return reply(msg, partial=True)

    def _require_sparse(self, msg: Message, identity: bytes) -> SparseShard:
        # only a SPULL reads as an observer, and only from a peer that said HELLO as one
        b: SPull | SPush | SInit = msg.body
        observer = isinstance(b, SPull) and b.observer
        if observer and identity not in self.observers:
            raise ProtocolError(ErrorCode.NOT_REGISTERED,
                                "an observer's SPULL needs its HELLO (role observer) first")
        heard = require_core(self.host.core).members.heard
        return SparseShard.of_worker(self.host.sparse, heard, msg.body.worker, time.monotonic(),
                                     observer)

    def _hold_sparse(self, msg: Message, identity: bytes, handler: Handler) -> bool:
        """Whether ``msg`` waits for the sparse tables (held, answered once built). The
        build starts at the dense INIT or at a live worker's first sparse request (a
        HELLO alone costs nothing); an observer's read waits for it."""
        tables, sparse = self.host.tables, self.host.sparse
        assert tables is not None and sparse is not None
        tables.check()
        if sparse.built:
            return False
        b: SPull | SPush | SInit = msg.body
        if not (isinstance(b, SPull) and b.observer) and b.worker in sparse.live():
            tables.start()
        tables.hold(identity, handler, msg)
        return True

    def answer_held_sparse(self) -> None:
        """Answer the sparse requests that waited for the tables, once they are built."""
        tables = self.host.tables
        assert tables is not None
        for identity, (handler, msg) in tables.take():
            try:
                answer = handler(msg, identity)
            except ProtocolError as exc:
                answer = error_reply(msg.seq, exc.code, exc.reason)
            except Exception as exc:  # as in ShardServer._handle: one never stops the shard
                self.counters["error_internal"] += 1
                log.exception("internal error while answering a held sparse request")
                answer = error_reply(msg.seq, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            if answer is not None:
                self.outbox.send(identity, answer)

    def on_spull(self, msg: Message, identity: bytes) -> Message | None:
        sparse = self._require_sparse(msg, identity)
        if self._hold_sparse(msg, identity, self.on_spull):
            return None
        return reply(msg, sparse.pull(msg.tensors), version=sparse.version)

    def on_spush(self, msg: Message, identity: bytes) -> Message | None:
        sparse = self._require_sparse(msg, identity)
        if self._hold_sparse(msg, identity, self.on_spush):
            return None
        b: SPush = msg.body
        if b.lr is not None:
            self._take_lr(require_core(self.host.core), b.worker, b.lr)
        out = require_core(self.host.core).rows.push(
            sparse, b.worker, b.push_id, b.read_version, b.clock, b.num_samples,
            msg.tensors, (identity, msg.seq))
        return None if out is None else reply(msg, **out.row_fields())

    def on_sinit(self, msg: Message, identity: bytes) -> Message | None:
        sparse = self._require_sparse(msg, identity)
        if self._hold_sparse(msg, identity, self.on_sinit):
            return None
        b: SInit = msg.body
        done = sparse.seed(b.worker, msg.tensors, b.part, b.parts)
        return reply(msg, initialized=done)

