"""A shard's side of a live move to another plan (issue 47, item 2): ``paramserver
reshard`` (workers/reshard.py) drives it step by step with RESHARD, an admin op.

* ``prepare`` (a shard that joins, before anything froze): its first core built and
  dropped, so that torch's lazy imports are not paid during the pause.
* ``freeze``: stop at a cut. Sync: once ``at`` rounds closed and nothing is in the
  open round (a round boundary every shard reaches, as a round needs every worker's
  push on every shard); async and SSP: now. From then on every data request (INIT,
  PULL, PUSH, the sparse ops, BYE) is held, unanswered: nothing reaches the core.
  The answer waits (up to ``wait``) until the shard stands frozen.
* ``align`` (async, SSP): a worker's push may have reached one shard before the cut
  and another after it; the admin tells each shard the push ids every other one
  took, and the shard takes those of its held pushes (handled as they came, and
  answered): every shard then holds every acknowledged push, once.
* ``capture``: the shard's checkpoint, as a resume reads it (tensors and manifest),
  in the answer. The admin computes the new plan's shards (core/reshard.py).
* ``adopt``: a shard of the new plan is sent its state; it keeps it aside.
* ``commit``: the shard puts what it was sent in place of what it held (or, not in
  the new plan, holds nothing); its plan epoch goes up, and every held request, and
  every request after from a peer that did not say HELLO at the new epoch, is
  answered ``plan_moved`` with the new plan's servers (the client moves there:
  workers/client.py). A removed shard stops once each live worker was told, or
  after :data:`LINGER` seconds.
* ``abort``: the old plan serves on: what was held is handled, as if it came now.

Until commit the old shards keep their state, so a move that fails half-way (a new
shard that never answers) is aborted and nothing was lost. The ShardState (the
checkpoint's tensors and manifest) is the unit that moves: whatever a shard holds
joins its checkpoint, and so moves (a pull-side compressor's residuals included).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from paramserver.core import features
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.observe import records as ev
from paramserver.server import shardstate
from paramserver.wire.messages import Hello, PlanMoved, Push, Reshard
from paramserver.wire.protocol import Message, Op, error_reply, reply

if TYPE_CHECKING:
    import zmq

    from paramserver.core.shard import ShardCore
    from paramserver.observe.events import EventLog
    from paramserver.observe.recorder import ShardObserver
    from paramserver.server.access import Access
    from paramserver.server.checkpointer import Capture, Checkpointer
    from paramserver.server.config import ServerConfig
    from paramserver.server.outbox import Outbox
    from paramserver.server.parts import JoinedParts, StreamedParts
    from paramserver.server.shardstate import ShardState

__all__ = ["DATA_OPS", "LINGER", "META_TENSOR", "Elastic", "ElasticHost", "decode_meta",
           "encode_meta"]

log = logging.getLogger(__name__)

#: requests held at a cut and answered plan_moved after it (BYE too: a worker's
#: finish must reach every shard of one plan)
DATA_OPS = frozenset({Op.INIT, Op.PULL, Op.PUSH, Op.SPULL, Op.SPUSH, Op.SINIT, Op.BYE})
#: a removed shard answers plan_moved this long at most, then stops
LINGER = 30.0
#: the tensor a state's manifest travels in (JSON bytes), beside the checkpoint's
META_TENSOR = "__manifest__"
#: the largest manifest a RESHARD may carry
MAX_META_BYTES = 64 << 20


def encode_meta(meta: dict[str, Any]) -> torch.Tensor:
    data = msgspec.json.encode(meta)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.zeros(0, dtype=torch.uint8)


def decode_meta(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A state's manifest out of its tensors (removed from them); ProtocolError if
    there is none, it is too large, or not a JSON map."""
    raw = tensors.pop(META_TENSOR, None)
    if raw is None or raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"reshard: no {META_TENSOR} (uint8) tensor")
    if raw.numel() > MAX_META_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"reshard: a manifest of {raw.numel()} "
                            f"bytes > {MAX_META_BYTES}")
    try:
        meta = msgspec.json.decode(raw.numpy().tobytes())
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"reshard: manifest: {exc}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(ErrorCode.BAD_FIELD, "reshard: the manifest is not a map")
    return meta


class ElasticHost(Protocol):
    """What a move reads and does of the shard server (loop.py's ShardServer)."""

    config: ServerConfig
    events: EventLog
    observer: ShardObserver
    checkpoints: Checkpointer
    access: Access
    outbox: Outbox
    joined: JoinedParts
    streamed: StreamedParts

    @property
    def core(self) -> ShardCore | None: ...

    @property
    def plan(self) -> ShardPlan | None: ...

    def _capture(self, copy: bool) -> Capture | None: ...

    def _handle(self, identity: bytes, frames: list[zmq.Frame], key: str | None = None
                ) -> None: ...

    def adopt_state(self, state: ShardState) -> None: ...

    def stop(self) -> None: ...

    def adopt_plan(self, plan: ShardPlan) -> None: ...


@dataclass
class _Held:
    identity: bytes
    frames: list[Any]
    key: str | None
    msg: Message


@dataclass
class _Staged:
    plan: ShardPlan
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    owners: dict[int, str] = field(default_factory=dict)


class Elastic:
    """One shard's part in live moves: its plan epoch, what it holds at a cut, the
    state it was sent, and where the plan went."""

    def __init__(self, host: ElasticHost) -> None:
        self.host = host
        self.epoch = 0
        self.target: int | None = None  # freeze once this many sync rounds closed
        self.frozen = False
        self.frozen_at = 0.0
        self.held: list[_Held] = []
        self.asks: list[tuple[bytes, Message, float]] = []  # freeze/align answers due
        self.staged: _Staged | None = None
        self.moved: PlanMoved | None = None  # after a commit: where the plan is
        self.current: set[bytes] = set()  # peers that said HELLO at this epoch
        self.removed_at: float | None = None
        self.to_tell: set[int] = set()  # live workers a removed shard still tells
        self.replaying = False
        self.moves = 0

    # ------------------------------------------------------------------ the gate

    def intercept(self, identity: bytes, frames: list[Any], key: str | None,
                  msg: Message) -> Message | bool:
        """Before a request is handled: True: held (answered later); a Message: the
        answer now (plan_moved); False: handle it."""
        if self.replaying:
            return False
        op = msg.op
        if self.target is not None and not self.frozen and op in DATA_OPS:
            self.tick(time.monotonic())  # the cut, before this request may pass it
        if self.moved is not None:
            if self.removed_at is not None:
                if op in (Op.STATS, Op.SHUTDOWN, Op.RESHARD):
                    return False
                return self._tell(msg)
            if op is Op.HELLO:
                body: Hello = msg.body
                plan = self.host.plan
                if plan is not None and body.plan_hash == plan.hash:
                    self.current.add(identity)
                    return False
                return self._moved(msg)
            if op in DATA_OPS and identity not in self.current and not (
                    op is Op.BYE and msg.body.dead):  # (a supervisor's report: no session)
                return self._moved(msg)
        if self.frozen and op in DATA_OPS:
            self.held.append(_Held(identity, frames, key, msg))
            return True
        return False

    def _tell(self, msg: Message) -> Message:
        """:meth:`_moved` for ``msg``, its worker (a data request names one) told."""
        worker = getattr(msg.body, "worker", None)
        if isinstance(worker, int):
            self.to_tell.discard(worker)
        return self._moved(msg)

    def _moved(self, msg: Message) -> Message:
        assert self.moved is not None
        answer = error_reply(msg.seq, ErrorCode.PLAN_MOVED,
                             f"the plan moved to {len(self.moved.servers)} shard(s), epoch "
                             f"{self.moved.epoch}")
        answer.fields["moved"] = {"epoch": self.moved.epoch, "servers": list(self.moved.servers)}
        return answer

    def tick(self, now: float) -> None:
        """Freeze once the cut is reached; answer the asks due; a removed shard stops."""
        if self.target is not None and not self.frozen and self._at_cut():
            self.frozen, self.frozen_at = True, now
            log.info("shard %d: frozen for a move at %d rounds (version %d)",
                     self.host.config.shard, self._rounds(), self._version())
        if self.asks:
            keep = []
            for identity, msg, deadline in self.asks:
                done = self._done(msg.body)
                if done or now >= deadline:
                    self.host.outbox.send(identity, self._state_reply(msg))
                else:
                    keep.append((identity, msg, deadline))
            self.asks = keep
        if self.removed_at is not None and (not self.to_tell or now - self.removed_at > LINGER):
            log.info("shard %d: removed by the move to epoch %d; stopping",
                     self.host.config.shard, self.epoch)
            self.host.stop()

    # ------------------------------------------------------------------ the steps

    def on_reshard(self, msg: Message, identity: bytes) -> Message | None:
        b: Reshard = msg.body
        try:  # the feature table holds what a move refuses (replicas, compressed pulls, ...)
            features.check({*self.host.config.features(), "live_reshard"})
        except ConfigError as e:
            raise ProtocolError(ErrorCode.BAD_FIELD, str(e)) from None
        if self.removed_at is not None:
            raise ProtocolError(ErrorCode.BAD_FIELD, "this shard was removed by a move")
        plan = self.host.plan
        if plan is not None and plan.sparse:
            raise ProtocolError(ErrorCode.BAD_FIELD, "a live reshard of sparse tables is not "
                                "supported: checkpoint, `checkpoint reshard`, resume")
        step = getattr(self, f"_{b.step}")
        answer: Message | None = step(msg, identity)
        return answer

    def _prepare(self, msg: Message, identity: bytes) -> Message:
        """A shard about to join: build a core once and drop it, so that what torch
        loads on a first optimizer (torch._dynamo: seconds) is loaded before the old
        shards freeze, not while they hold every request."""
        host = self.host
        if host.core is None and host.config.plan_hash is None:
            host.adopt_plan(ShardPlan([ParamSpec("warm", (1,), "float32")],
                                      host.config.num_shards))
            host.adopt_state(shardstate.ShardState(None))
        return reply(msg, **self._state_fields())

    def _freeze(self, msg: Message, identity: bytes) -> Message | None:
        b: Reshard = msg.body
        core = self.host.core
        sync = str(core.mode.mode) == "sync" if core is not None else \
            self.host.config.mode == "sync"
        if b.at >= 0 or self.target is None:
            target = b.at if sync else 0  # (async and SSP: a cut now, whatever ``at`` says)
            if target < 0 and core is not None:
                target = core.round.closed + (0 if core.between_rounds else 1)
            if self.frozen and target > self._rounds():
                self._release()  # a later cut: serve on until it
            self.target = max(target, 0)
        self.tick(time.monotonic())
        return self._answer_or_park(msg, identity)

    def _align(self, msg: Message, identity: bytes) -> Message | None:
        if not self.frozen:
            raise ProtocolError(ErrorCode.BAD_FIELD, "reshard align: the shard is not frozen")
        windows = msg.body.windows or {}
        core = self.host.core
        take = [h for h in self.held if h.msg.op is Op.PUSH and isinstance(h.msg.body, Push)
                and h.msg.body.parts == 1 and core is not None
                and h.msg.body.push_id < windows.get(h.msg.body.worker, 0)
                and h.msg.body.worker in core.workers
                and h.msg.body.push_id > core.workers[h.msg.body.worker].last_push_id]
        take.sort(key=lambda h: h.msg.body.push_id)
        if take:
            self.held = [h for h in self.held if h not in take]
            self._replay(take)
        return self._answer_or_park(msg, identity)

    def _capture(self, msg: Message, identity: bytes) -> Message:
        if not self.frozen:
            raise ProtocolError(ErrorCode.BAD_FIELD, "reshard capture: the shard is not frozen")
        taken = self.host._capture(False)  # (frozen until the commit: nothing writes it)
        if taken is None:
            raise ProtocolError(ErrorCode.NOT_INITIALIZED, "reshard capture: the shard holds "
                                "no state yet (no worker sent its weights)")
        meta = dict(taken.meta)
        meta["curve_owners"] = {str(w): k for w, k in self._owners().items()}
        tensors = dict(taken.tensors)
        tensors[META_TENSOR] = encode_meta(meta)
        return reply(msg, tensors, **self._state_fields())

    def _adopt(self, msg: Message, identity: bytes) -> Message:
        b: Reshard = msg.body
        tensors = dict(msg.tensors)
        meta = decode_meta(tensors)
        limits = self.host.config.plan_limits()
        try:
            plan = ShardPlan.from_description(meta["plan"], limits)
        except (ConfigError, KeyError, TypeError) as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"reshard adopt: its plan: {exc}") from None
        if plan.num_shards != len(b.servers) or meta.get("shard") != b.shard:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"reshard adopt: a state for shard "
                                f"{meta.get('shard')!r} of {plan.num_shards}, sent as shard "
                                f"{b.shard} of {len(b.servers)}")
        owners = meta.pop("curve_owners", {}) or {}
        self.staged = _Staged(plan, tensors, meta,
                              {int(w): str(k) for w, k in owners.items() if str(w).isdigit()})
        return reply(msg, **self._state_fields())

    def _commit(self, msg: Message, identity: bytes) -> Message:
        b: Reshard = msg.body
        host = self.host
        started = self.frozen_at if self.frozen else time.monotonic()
        before = host.plan.num_shards if host.plan is not None else 0
        tokens = self._parked_pulls()
        self.moved = PlanMoved(b.epoch, b.servers)
        self.epoch, self.current = b.epoch, set()
        staged, self.staged = self.staged, None
        if staged is not None and staged.meta.get("shard") == b.shard:
            host.config.shard, host.config.num_shards = b.shard, len(b.servers)
            host.checkpoints.shard = b.shard
            host.observer.relabel(b.shard)
            state = shardstate.from_checkpoint(staged.plan, staged.tensors, staged.meta)
            host.adopt_state(shardstate.ShardState(state.plan, state.meta, staged.owners,
                                                   state.load))
            role = "added" if before == 0 else "kept"
        else:
            core = host.core
            self.to_tell = {w.worker for w in core.live()} if core is not None else set()
            host.adopt_state(shardstate.ShardState(None))
            self.removed_at = time.monotonic()
            role = "removed"
        held, self.held = self.held, []
        self.frozen, self.target = False, None
        for h in held:  # (told now: a removed shard need not wait for them)
            host.outbox.send(h.identity, self._tell(h.msg))
        for identity_, seq in tokens:
            host.outbox.send(identity_, self._moved(Message(Op.PULL, seq)))
        self.moves += 1
        seconds = time.monotonic() - started
        core = host.core
        host.events.write(ev.Resharded(
            shard=b.shard if role != "removed" else host.config.shard, epoch=b.epoch,
            role=role, from_shards=before, to_shards=len(b.servers),
            version=core.version if core is not None else 0, paused_s=seconds,
            held=len(held) + len(tokens)))
        log.info("shard %d: plan epoch %d (%s, %d -> %d shards, paused %.3fs)",
                 host.config.shard, b.epoch, role, before, len(b.servers), seconds)
        return reply(msg, **self._state_fields())

    def _abort(self, msg: Message, identity: bytes) -> Message:
        self.staged = None
        self._release()
        return reply(msg, **self._state_fields())

    # ------------------------------------------------------------------ helpers

    def _release(self) -> None:
        """Serve on: the held requests are handled, in the order they came."""
        held, self.held = self.held, []
        self.frozen, self.target = False, None
        self._replay(held)

    def _replay(self, held: list[_Held]) -> None:
        self.replaying = True
        try:
            for h in held:
                self.host._handle(h.identity, h.frames, h.key)
        finally:
            self.replaying = False

    def _parked_pulls(self) -> list[tuple[bytes, int]]:
        core = self.host.core
        if core is None:
            return []
        out: list[tuple[bytes, int]] = []
        for pull in core.members.pulls.pulls:
            token: Hashable = pull.token
            if isinstance(token, tuple) and len(token) == 2:
                out.append((token[0], token[1]))
        return out

    def _owners(self) -> dict[int, str]:
        return dict(self.host.access.owners)

    def _at_cut(self) -> bool:
        core = self.host.core
        if core is None or not core.initialized:
            return False  # (nothing to move yet: the cut waits for the weights)
        if self.host.joined.pending or self.host.streamed.pending:
            return False
        if str(core.mode.mode) != "sync":
            return True
        return core.between_rounds and core.round.closed >= (self.target or 0)

    def _rounds(self) -> int:
        core = self.host.core
        return core.round.closed if core is not None else 0

    def _version(self) -> int:
        core = self.host.core
        return core.version if core is not None else 0

    def _done(self, b: Reshard) -> bool:
        if not self.frozen:
            return False
        if b.step != "align":
            return True
        core = self.host.core
        return core is None or all(
            w not in core.workers or core.workers[w].last_push_id + 1 >= p
            for w, p in (b.windows or {}).items())

    def _answer_or_park(self, msg: Message, identity: bytes) -> Message | None:
        b: Reshard = msg.body
        if self._done(b) or b.wait <= 0:
            return self._state_reply(msg)
        self.asks.append((identity, msg, time.monotonic() + b.wait))
        return None

    def _state_fields(self) -> dict[str, Any]:
        core = self.host.core
        workers = core.workers if core is not None else {}
        return {"frozen": self.frozen, "rounds": self._rounds(), "version": self._version(),
                "epoch": self.epoch,
                "mode": str(core.mode.mode) if core is not None else self.host.config.mode,
                # (the next push id each worker's window takes: >= 0 on the wire)
                "windows": {str(w): s.last_push_id + 1 for w, s in workers.items()},
                "clocks": {str(w): s.clock for w, s in workers.items()}}

    def _state_reply(self, msg: Message) -> Message:
        return reply(msg, **self._state_fields())
