"""What a shard server sends: replies, the pull replies the core releases, and the
zero-copy sends still reading the weights' memory.

Weights go out zero-copy. Because zmq may still be reading a tensor's memory
after ``send`` returns, :class:`Outbox` tracks those sends; if one is in flight
when the optimizer is about to write, :meth:`Outbox.settle` moves the core's
parameters to fresh storage first (copy-on-write), so no reader ever sees a
half-updated tensor.

A pull is answered when the core's gate opens (:meth:`ShardCore.ready_pulls
<paramserver.core.shard.ShardCore.ready_pulls>`), possibly long after it came; the
outbox remembers which parked pulls are an observer's (no worker metrics) and
which came with a push (the reply carries the push's outcome too).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import msgspec
import zmq

from paramserver.core.records import PullReply, PushOutcome
from paramserver.core.shard import ShardCore
from paramserver.observe.recorder import ShardObserver
from paramserver.wire.protocol import (
    Message,
    Op,
    PreparedTensors,
    usable,
    weights_reply_fields,
    weights_reply_head,
)
from paramserver.wire.transport import RouterSocket

if TYPE_CHECKING:
    from paramserver.server.tracer import ShardTracer
    from paramserver.shm.link import ShmHub

__all__ = ["Outbox"]


def _fields(ready: PullReply, outcome: Any) -> dict[str, Any]:
    """A pull reply's fields (``outcome``: the push's, or UNSET for a PULL's answer)."""
    return weights_reply_fields(ready.version, ready.clock, ready.waited, outcome)


class Outbox:
    """Replies of one shard server's ``socket``, counted in ``counters``."""

    #: the shard's, once it is bound (ShardServer.start)
    socket: RouterSocket

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        # zero-copy replies that may still be read from the weights' memory:
        # (tracker, peer identity, the request's seq)
        self.inflight: list[tuple[zmq.MessageTracker, bytes, int]] = []
        self.observer_pulls: set[Hashable] = set()  # tokens of observer pulls
        # worker -> (token, push outcome) of its parked PUSH-with-pull; one per worker,
        # as the core keeps one parked pull per worker
        self.push_pulls: dict[int, tuple[Hashable, PushOutcome]] = {}
        # worker -> (version, keys): the next weights of these keys went back early,
        # with the parts of its parked push (StepAhead.ready); its answer leaves them
        # out if the round made exactly those weights
        self.early: dict[int, tuple[int, frozenset[str]]] = {}
        # the weights' descriptors and frames, made once for every pull reply
        self._weights: PreparedTensors | None = None
        # same-host peers' pulls are answered with a ticket to the weight board
        self.shm: ShmHub | None = None
        self.tracer: ShardTracer | None = None  # --trace: each pull answered (tracer.py)

    def _prepared(self, core: ShardCore) -> PreparedTensors | None:
        prepared = self._weights
        if prepared is None or not prepared.matches(core.params):
            prepared = self._weights = (PreparedTensors(core.params) if usable(core.params)
                                        else None)
        return prepared

    def send(self, identity: bytes, msg: Message,
             prepared: PreparedTensors | None = None) -> int:
        """Send ``msg``; ``prepared``: its tensors' frames, checked just now to match
        them (see :meth:`_prepared`). Returns its tensors' bytes."""
        if not msg.tensors:
            self.socket.send(identity, msg, nbytes=0)
            return 0
        nbytes = msg.nbytes if prepared is None else prepared.nbytes
        return self._sent(identity, msg.seq, nbytes, self.socket.send(
            identity, msg, track=True, prepared=prepared, matched=prepared is not None,
            nbytes=nbytes))

    def _send_weights(self, identity: bytes, seq: int, head: bytes,
                      prepared: PreparedTensors) -> int:
        """:meth:`send` of a weights reply whose header is made (``head``)."""
        nbytes = prepared.nbytes
        return self._sent(identity, seq, nbytes, self.socket.send_frames(
            identity, [head, *prepared.frames], nbytes, track=True))

    def _sent(self, identity: bytes, seq: int, nbytes: int,
              tracker: zmq.MessageTracker | None) -> int:
        """A reply of ``nbytes`` of tensors went out: counted, and its frames held
        (``inflight``) until zmq no longer reads them."""
        if tracker is not None and not tracker.done:
            self.inflight.append((tracker, identity, seq))
        self.counters["bytes_out"] += nbytes
        return nbytes

    def acknowledged(self, identity: bytes, seq: int) -> None:
        """A peer's request ``seq`` proves it received our replies to its earlier ones.

        A client sends a request after the one a zero-copy reply answered only
        once it holds that whole reply (or gave up on it), so every byte of it
        was already copied out of our memory into the kernel. This learns it
        as the next request arrives, instead of waiting for pyzmq to report
        the send done from its garbage-collector thread, which lags behind
        under load (and then cost a copy of the whole shard).
        """
        if self.inflight:
            self.inflight = [e for e in self.inflight if e[1] != identity or e[2] >= seq]

    def settle(self, core: ShardCore | None) -> None:
        """Copy-on-write: parameters still being sent must not be written in place.

        pyzmq marks a send done from its garbage-collector thread, which usually
        has not run yet when the worker that read the reply already pushes
        again; so wait for pending sends up to about the time copying the shard
        would take (4 GB/s) before copying it.
        """
        if not self.inflight:
            return
        pending = [t for t, _, _ in self.inflight if not t.done]
        if pending and core is not None:
            nbytes = sum(p.numel() * p.element_size() for p in core.params.values())
            deadline = time.monotonic() + min(0.05, nbytes / 4e9)
            for tracker in pending:
                try:
                    tracker.wait(max(0.0, deadline - time.monotonic()))
                except zmq.NotDone:
                    break
            pending = [t for t in pending if not t.done]
        if pending and core is not None:
            core.copy_on_write()
            self.counters["copy_on_write"] += 1
        self.inflight = []

    def park_observer(self, token: Hashable) -> None:
        """An observer's pull was parked: its answer feeds no worker metrics."""
        self.observer_pulls.add(token)

    def park_push_pull(self, worker: int, token: Hashable, outcome: PushOutcome,
                       early: tuple[int, frozenset[str]] | None = None) -> None:
        """A PUSH asked for the pull too: its answer is the pull's, with ``outcome`` in it.
        ``early``: (version, keys) whose next weights went back with its earlier parts."""
        self.push_pulls[worker] = (token, outcome)
        if early is None:
            self.early.pop(worker, None)
        else:
            self.early[worker] = early

    def answer_pulls(self, core: ShardCore, now: float, observer: ShardObserver,
                     later: list[Callable[[], None]] | None = None) -> None:
        """Send every pull reply whose gate is open ``now``. ``later``: where to queue
        each reply's metrics, to be recorded once the replies are out (else at once)."""
        for ready in core.ready_pulls(now):
            if self.tracer is not None and ready.token not in self.observer_pulls:
                self.tracer.served(ready, now)
            identity, seq = cast("tuple[bytes, int]", ready.token)
            combined = self.push_pulls.get(ready.worker)
            outcome: Any = msgspec.UNSET  # (a PULL's answer: no outcome in it)
            early = None
            if combined is not None and combined[0] == ready.token:
                del self.push_pulls[ready.worker]
                outcome = combined[1]
                early = self.early.pop(ready.worker, None)
            looks = ready.token in self.observer_pulls  # an observer's: never compressed
            again = core.squeeze.again if core.squeeze is not None else 0
            squeezed = None if core.squeeze is None or looks else \
                core.answer_squeezed(ready.worker, ready.version)
            ticket = (self.shm.ticket(identity, seq, core.params, ready.version)
                      if self.shm is not None and squeezed is None else None)
            if squeezed is not None:  # a compressed pull (core/pullsqueeze.py): in frames
                fields = weights_reply_fields(squeezed.version, ready.clock, ready.waited,
                                              outcome)
                fields["squeeze"] = squeezed.count
                if squeezed.delta:
                    fields["delta"] = True
                self.counters["pulls_compressed" if squeezed.delta else "pulls_whole"] += 1
                if core.squeeze is not None and core.squeeze.again != again:
                    self.counters["pulls_answered_again"] += 1  # (its first answer was lost)
                nbytes = self.send(identity, Message(Op.REPLY, seq, fields,
                                                     squeezed.tensors))
            elif ticket is not None:
                fields = _fields(ready, outcome)
                fields["shm"] = ticket
                self.counters["shm_pulls"] += 1
                nbytes = self.send(identity, Message(Op.REPLY, seq, fields, {}))
            elif early is not None and early[0] == ready.version == core.ahead.last_commit:
                # the round made the weights that went back early: the rest only
                fields = _fields(ready, outcome)
                fields["early"] = len(early[1])
                self.counters["early_answers"] += 1
                rest = {k: p for k, p in core.params.items() if k not in early[1]}
                if self.shm is not None:
                    self.shm.before_tcp_reply(core)
                nbytes = self.send(identity, Message(Op.REPLY, seq, fields, rest))
            else:
                if self.shm is not None:
                    self.shm.before_tcp_reply(core)  # zmq never lends a board slot
                prepared = self._prepared(core)
                if prepared is None:
                    nbytes = self.send(identity, Message(Op.REPLY, seq, _fields(
                        ready, outcome), core.params))
                else:  # the weights' frames made once, the header with as few objects
                    nbytes = self._send_weights(identity, seq, weights_reply_head(
                        seq, ready.version, ready.clock, ready.waited, outcome,
                        prepared.descs), prepared)
            if looks:
                self.observer_pulls.discard(ready.token)
                continue
            record = partial(observer.pull, ready.worker,
                             ready.waited + time.monotonic() - now, ready.waited, nbytes)
            if later is not None:
                later.append(record)
            else:
                record()

    def forget(self, known: Collection[int]) -> None:
        """Drop parked push-with-pull answers of workers the core no longer knows."""
        for worker in [w for w in self.push_pulls if w not in known]:
            del self.push_pulls[worker]
        for worker in [w for w in self.early if w not in known]:
            del self.early[worker]
