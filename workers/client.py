"""PSClient: a worker's (or an observer's) view of all shards at once.

Requests go to every shard before any reply is awaited, so shards work
concurrently. Pulled slices are copied straight from the received frames into
the model's parameters; pushed gradient slices are zero-copy views of the
gradients (on CUDA, of pinned host copies). A heartbeat thread with its own
sockets keeps the worker in the live set while it computes or waits.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from paramserver.core.sharding import DTYPES, ShardPlan
from paramserver.errors import (
    ConfigError,
    DuplicateWorkerError,
    ForbiddenError,
    FutureVersionError,
    NotInitializedError,
    NotRegisteredError,
    PlanMovedError,
    RemoteError,
    TransportError,
)
from paramserver.shm.link import MIN_BYTES as SHM_MIN_BYTES
from paramserver.shm.link import ShmLink
from paramserver.shm.link import enabled as shm_enabled
from paramserver.util import faults
from paramserver.util.dtypes import GRAD_WIRE_DTYPES
from paramserver.wire.curve import CurveKeys
from paramserver.wire.lanes import SmallShare
from paramserver.wire.messages import Error, HelloReply, replace
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op, PreparedTensors
from paramserver.wire.retry import Judge, PatienceFrom, Retry
from paramserver.wire.stats import ShardStats
from paramserver.wire.transport import Channel, Fanout, request_all
from paramserver.workers import gradwire
from paramserver.workers.failover import ATTEMPT_TIMEOUT, Failover
from paramserver.workers.gradwire import compression_encoder
from paramserver.workers.landing import land, land_over_tcp
from paramserver.workers.liveness import Heartbeat, Patience
from paramserver.workers.planmove import follow_moves, resend_on
from paramserver.workers.pullcopy import PullCopies
from paramserver.workers.pushstream import PullResult, PushResult, PushStream

__all__ = ["GRAD_WIRE_DTYPES", "PART_BYTES", "PSClient", "PullResult", "PushResult",
           "PushStream", "compression_encoder"]

#: a shard's share of a push larger than this goes in parts of at most about this
#: size (whole slices: a plan chunk, 2 MiB by default, is the smallest part), which a
#: sync shard adds into its round as they arrive, so its memory stays bounded
#: whatever the number of workers
PART_BYTES = ShardPlan.DEFAULT_CHUNK_BYTES
#: the smallest part through shared memory (see PSClient._part_limit)
SHM_PART_BYTES = 8 << 20
#: parts of one push outstanding per shard: the next goes when one is answered, so a
#: shard holds about this many parts per worker (two keep it busy while one travels)
PART_WINDOW = 2

log = logging.getLogger(__name__)


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
        request_timeout: float = 5.0,
        heartbeat_interval: float = 1.0,
        curve: CurveKeys | None = None,
        wire_dtype: str | None = None,
        part_bytes: int = PART_BYTES,
        barrier_timeout: float = 0.0,
        shm: bool = True,
        optimizer: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        early_parts: bool = False,
        compression: str | None = None,
    ) -> None:
        if len(addresses) != plan.num_shards:
            raise TransportError(
                f"{len(addresses)} server addresses given but the plan has {plan.num_shards} shards"
            )
        # a shard given as its replicas (A|B): requests follow its primary (failover.py)
        self.failover = Failover.of(addresses, curve)
        if self.failover is not None:
            addresses = self.failover.primaries
            request_timeout = min(request_timeout, ATTEMPT_TIMEOUT)
        self.addresses = list(addresses)
        self.plan = plan
        self.worker = worker
        self.role = role
        # a request is re-sent every request_timeout (a restarted server lost it;
        # duplicates are harmless: pushes carry ids, pulls replace each other)
        # until `timeout` has passed in all; patience narrows it per request
        self.timeout = timeout
        self.retry = Retry.within(timeout, request_timeout)
        self.attempt_timeout = self.retry.attempt  # (what liveness.Patience reads)
        # a live shard holding a pull at its barrier is waited for this long (0: no bound)
        if barrier_timeout < 0:
            raise ConfigError(f"barrier_timeout must be >= 0 (0: no bound), got "
                              f"{barrier_timeout}")
        self.barrier_timeout = barrier_timeout
        self.barrier_label = "--barrier-timeout"  # what errors call that bound
        self._params: Mapping[str, torch.Tensor] | None = None
        self.initialized = False  # every shard held weights at connect()
        self.incarnation = uuid.uuid4().hex
        # the optimizer the script wraps, for the shards' HELLO (core/hyper.py's map);
        # ``lr``: a learning rate every push carries until it is None again (a change
        # the evaluating rank made); ``server_lr``: the shards' at connect()
        self.optimizer = None if optimizer is None else dict(optimizer)
        self.lr: float | None = None
        self.server_lr: float | None = None
        # this worker's run (launch's): a shard of another run refuses its HELLO and its
        # heartbeats (wrong_run), so a port another job took over is never talked to
        self.run_id = run_id or None
        # gradients may travel in 16 bits (the server widens them); weights never do;
        # --compression bf16/fp16 (without error feedback) is that, to the byte
        self.encoder, wire_dtype = compression_encoder(compression, wire_dtype, worker)
        # a worker on a shard's host moves tensors through shared memory if the
        # shard agrees at HELLO (paramserver/shm/link.py); anything else goes over TCP
        # (``shm=False``: TCP even then, as the benchmark's ps-tcp row measures)
        # (a compressed push goes in frames: its parts are not the slices the segment holds)
        self._use_shm = shm and role == "worker" and shm_enabled() and self.encoder is None
        self._curve, self._heartbeat_interval = curve, heartbeat_interval
        self.epoch = 0  # the plan's epoch (a live reshard raises it: workers/planmove.py)
        self.moves = 0
        self._push_id = 0
        self._pinned: dict[str, torch.Tensor] = {}
        if wire_dtype is not None and wire_dtype not in GRAD_WIRE_DTYPES:
            raise ConfigError(f"wire_dtype must be one of {', '.join(GRAD_WIRE_DTYPES)} or "
                              f"None (send gradients as they are); got {wire_dtype!r}")
        self.wire_dtype = GRAD_WIRE_DTYPES[wire_dtype] if wire_dtype else None
        if part_bytes < 0:
            raise ConfigError(f"part_bytes must be >= 0 (0: never split), got {part_bytes}")
        self.part_bytes = part_bytes
        # a push_pull in parts asks each shard, over TCP, for the next weights of the
        # slices whose sums are final before the round closes (pipelined per part,
        # docs/performance.md): off by default, as on one host (loopback) the CPU,
        # not the link, is the limit, and the early replies cost more than they save
        self.early_parts = early_parts
        self._open(addresses, plan)

    def _open(self, addresses: Sequence[str], plan: ShardPlan) -> None:
        """The channels, heartbeat and per-shard layouts of ``plan`` at ``addresses``
        (at start, and again when a live reshard moved the plan: planmove.py)."""
        worker, curve, use_shm = self.worker, self._curve, self._use_shm
        self.addresses, self.plan = list(addresses), plan
        self.channels: list[Channel[ShmLink]] = [
            Channel(a, peer=f"shard {i}", curve=curve, drop_rate=faults.drop_rate(),
                    seed=worker * 1000 + i,
                    shm=ShmLink([(sl.key, sl.nbytes) for sl in plan.shard_slices(i)],
                                f"w{worker}s{i}")
                    if use_shm and plan.shard_bytes(i) >= SHM_MIN_BYTES else None)
            for i, a in enumerate(addresses)]
        interval = self._heartbeat_interval
        self._heartbeat = (
            (self.failover.heartbeat(worker, interval, curve, self.run_id)
             if self.failover
             else Heartbeat(addresses, worker, interval, curve, self.run_id))
            if self.role == "worker" and interval > 0 else None
        )
        self._shard_slices = [plan.shard_slices(s) for s in range(plan.num_shards)]
        # the most bytes a push sends one shard (16-bit wire dtypes send fewer)
        self._largest_share = max(
            (sum(s.numel * DTYPES[s.dtype].itemsize for s in sl) for sl in self._shard_slices),
            default=0)
        # a small model's shares, gathered and landed in a few calls (paramserver/wire/lanes.py);
        # not where gradients are narrowed or compressed, or pushes go in parts
        whole = self.wire_dtype is None and self.encoder is None and (
            not self.part_bytes or self._largest_share <= self.part_bytes)
        self._small = [SmallShare.of(plan, s) if whole else None for s in range(plan.num_shards)]
        for ch, share in zip(self.channels, self._small, strict=True):
            if share is not None:  # its weight replies read in a few calls
                ch.reader = share.reader(ch.limits)
        # a request to every shard (most of them): its channel set made once
        self._every = list(range(len(self.channels)))
        self._fanout = Fanout(self.channels)
        self.copies = PullCopies(plan)  # compressed pulls' copies (workers/pullcopy.py)

    def _squeezes(self, shard: int, on: bool) -> None:
        """Whether ``shard`` compresses our pulls (its HELLO says): no small share then."""
        on = on and self.role == "worker"
        self.copies.enable(shard, on)
        if on:
            self._small[shard] = None
            self.channels[shard].reader = None

    # ------------------------------------------------------------------ session

    def _hello(self) -> Message:
        return Message(Op.HELLO, 0, {
            "worker": self.worker, "role": self.role, "protocol": PROTOCOL_VERSION,
            "plan_hash": self.plan.hash, "plan": self.plan.describe(),
            "incarnation": self.incarnation,
            "host": socket.gethostname(), "pid": os.getpid(),
            **({"optimizer": self.optimizer} if self.optimizer is not None else {}),
            **({"run": self.run_id} if self.run_id else {}),
        })

    def _init(self, shards: Sequence[int]) -> tuple[list[Message], list[int]]:
        """INIT messages for ``shards`` (in parts where large) and the shard of each."""
        assert self._params is not None
        host = {k: v.detach().cpu() for k, v in self._params.items()}
        per_shard = self.plan.split_tensors(host)
        msgs, dest = [], []
        for shard in shards:
            groups = self._groups(per_shard.get(shard, {}))
            for i, tensors in enumerate(groups):
                fields = {"worker": self.worker}
                if len(groups) > 1:
                    fields.update(part=i, parts=len(groups))
                msgs.append(Message(Op.INIT, 0, fields, tensors))
                dest.append(shard)
        return msgs, dest

    def seed_from(self, params: Mapping[str, torch.Tensor]) -> None:
        """The weights a shard that lost its own is seeded from when we rejoin it."""
        self._params = params

    def next_push_id(self) -> int:
        """A fresh push id: a shard applies each (worker, push id) once."""
        self._push_id += 1
        return self._push_id

    def call(self, msgs: list[Message], what: str, shards: list[int] | None = None,
             recover: bool = True, soft: tuple[type[RemoteError], ...] = (),
             on_reply: Callable[[int, Message], None] | None = None,
             sent: bool = False, window: int = 0) -> list[Message]:
        """Send one message per shard and collect the replies.

        A shard that answers "not registered" (it restarted without our state,
        or timed us out) gets a fresh HELLO, and INIT from our current weights
        if it lost its own; then the request is repeated. ERROR replies whose
        :class:`RemoteError` is one of the classes in ``soft`` are returned for
        the caller; others raise it (:meth:`RemoteError.from_reply`). A shard
        may appear several times in ``shards`` (requests pipelined to it);
        ``on_reply`` sees first-time successful replies as they land.
        """
        if shards is None:  # every shard once: the channel set prepared at __init__
            shards, chans, fanout = self._every, self.channels, self._fanout
        else:
            chans, fanout = [self.channels[s] for s in shards], None
        judged = self.retry.judged(patience_from=self._patience_from(what, shards))
        replies = request_all(chans, msgs, judged, what, raise_errors=False, on_reply=on_reply,
                              sent=sent, window=window, fanout=fanout)
        for i, rep in enumerate(replies):
            if rep.op is not Op.ERROR:
                continue
            peer = f"{chans[i].peer} at {chans[i].address}"
            refusal: Error = rep.body
            error = RemoteError.from_reply(peer, refusal.code, refusal.reason)
            if refusal.moved is not None:  # a live reshard: where the plan went
                raise PlanMovedError(peer, refusal.code, refusal.reason, refusal.moved.epoch,
                                     refusal.moved.servers)
            if isinstance(error, soft):
                continue
            if recover and isinstance(error, (NotRegisteredError, NotInitializedError)):
                log.warning("%s: %s; registering again", peer, refusal.reason)
                self.rejoin(shards[i])
                retry = Message(msgs[i].op, 0, dict(msgs[i].fields), msgs[i].tensors,
                                msgs[i].prepared)
                replies[i] = self.call([retry], what, [shards[i]], recover=False,
                                        soft=soft)[0]
            else:
                raise error
        return replies

    def patience(self, what: str, shards: list[int], started: float | None = None,
                 alive: bool | None = None) -> Judge | None:
        """How long a request to ``shards`` is waited for: past ``timeout`` while the
        heartbeats say a shard holds it (workers/liveness.py); None without them.
        ``started``: when the request began (default: now); ``alive``: whether the
        heartbeats ran then (default: asked now)."""
        heartbeat = self._heartbeat
        if alive is None:
            alive = heartbeat is not None and heartbeat.is_alive()
        if self.failover is not None:  # (it follows the primary without heartbeats too)
            return self.failover.patience(self, heartbeat if alive else None, what, shards,
                                          started)
        if heartbeat is None or not alive:
            return None
        return Patience(self, heartbeat, what, shards, started)

    def _patience_from(self, what: str, shards: list[int]) -> PatienceFrom | None:
        """:meth:`patience` for a request starting now, made only if a timeout passes
        (request_all's ``patience_from``); whether the heartbeats run is asked now."""
        heartbeat = self._heartbeat
        alive = heartbeat is not None and heartbeat.is_alive()
        if self.failover is None and not alive:
            return None
        return lambda started: self.patience(what, shards, started, alive)

    def rejoin(self, shard: int) -> None:
        """HELLO ``shard`` again (it restarted, or timed us out), and seed it from our
        weights if it lost its own."""
        hello: HelloReply = self.call([self._hello()], "HELLO", [shard], recover=False)[0].body
        self._squeezes(shard, hello.squeeze)
        self._prove_shm([shard])
        if not hello.initialized and self._params is not None and self.role == "worker":
            log.warning("shard %d lost its weights; seeding it from this worker's copy", shard)
            msgs, dest = self._init([shard])
            self.call(msgs, "INIT", dest, recover=False)

    def _prove_shm(self, shards: Sequence[int]) -> None:
        """HELLO again to the shards that answered our shared-memory offer with a
        challenge (its nonce is in our segment now, paramserver/shm/link.py): the reply
        grants the board. A shard that refuses the proof leaves us on TCP."""
        asked = [s for s in shards if (link := self.channels[s].shm) is not None
                 and link.proving]
        if not asked:
            return
        replies = self.call([self._hello() for _ in asked], "HELLO", asked, recover=False,
                             soft=(DuplicateWorkerError, ForbiddenError))
        for shard, rep in zip(asked, replies, strict=True):
            link = self.channels[shard].shm
            if link is not None and rep.op is Op.ERROR:
                link.granted(None)
                log.warning("shard %d refused our shared-memory segment (%s): using TCP",
                            shard, rep.body.reason)

    def _hello_until_taken(self, shards: list[int], deadline: float) -> list[Message]:
        """HELLO to ``shards``, repeated with backoff while one says another process
        holds our id (``duplicate_worker``: it may be our dead predecessor)."""
        backoff = 0.1
        while True:
            replies = self.call([self._hello() for _ in shards], "HELLO", shards,
                                 recover=False, soft=(DuplicateWorkerError,))
            refused = [r for r in replies if r.op is Op.ERROR]
            if not refused:
                return replies
            if time.monotonic() + backoff > deadline:
                first: Error = refused[0].body
                raise RemoteError.from_reply("shards", first.code, first.reason)
            log.info("worker %d still registered by its previous process; retrying in %.1fs",
                     self.worker, backoff)
            time.sleep(backoff)  # backoff before a retry, not synchronisation
            backoff = min(2.0, backoff * 2)

    def connect(self) -> int:
        """HELLO to every shard. Returns the clock to resume at (0 for a new worker).

        A restarted worker may find its previous incarnation still registered;
        the shards take it over once that one misses its heartbeats, so the
        HELLO is repeated with backoff until then (within ``timeout``). A second
        process with a live worker's id is refused for good
        (:class:`WorkerInUseError`, ``rank N is already in use by a live worker``).
        Shard 0 is asked first, alone: of two processes with one id started at
        once, the one it takes is the one every shard takes.
        """
        return follow_moves(self, lambda _: self._connect())

    def _connect(self) -> int:
        deadline = time.monotonic() + self.timeout
        replies: list[Message] = []
        for shards in ([0], list(range(1, len(self.channels)))):
            if shards:
                replies += self._hello_until_taken(shards, deadline)
        self._prove_shm(range(len(self.channels)))
        hellos: list[HelloReply] = [r.body for r in replies]
        for index, hello in enumerate(hellos):
            self._squeezes(index, hello.squeeze)
            shard = hello.shard
            if shard is not None and shard != index:
                raise ConfigError(f"address {index} ({self.addresses[index]}) is shard {shard}; "
                                  "give the addresses in shard order")
        if self._heartbeat is not None and not self._heartbeat.is_alive():
            self._heartbeat.start()
        # every shard holds weights already (a rejoin, a resumed run): nobody seeds them
        self.initialized = all(h.initialized for h in hellos)
        self.server_lr = hellos[0].lr
        return max(h.clock for h in hellos)

    def initialize(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Offer our weights to every shard; the first INIT per shard wins.

        Returns True if this worker seeded at least one shard.
        """
        return follow_moves(self, lambda _: self._initialize(params))

    def _initialize(self, params: Mapping[str, torch.Tensor]) -> bool:
        self._params = params
        msgs, shards = self._init(range(len(self.channels)))
        replies = self.call(msgs, "INIT", shards)
        return any(r.body.seeded for r in replies)  # (InitReply)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            if self._heartbeat.is_alive():
                self._heartbeat.join(timeout=2)
        for ch in self.channels:
            ch.close()

    def observe(self) -> None:
        """Go on as an observer (after :meth:`bye`): a HELLO with role observer to every
        shard, so that reads (PULL, a table's SPULL) are an observer's, ungated, and
        register nothing."""
        self.role = "observer"
        self.call([self._hello() for _ in self.channels], "HELLO", recover=False)

    def bye(self) -> None:
        follow_moves(self, lambda _: self._bye())

    def _bye(self) -> None:
        self.call([Message(Op.BYE, 0, {"worker": self.worker}) for _ in self.channels], "BYE",
                   recover=False)

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ data

    def pull_msgs(self, clock: int, wait_init: bool = False,
                  via_shm: bool | None = None) -> list[Message]:
        """A PULL at ``clock`` for every shard; ``via_shm=False``: the weights in
        frames even from a shard that lends us its board (None: the shard's choice)."""
        fields: dict[str, Any] = {"worker": self.worker, "clock": clock,
                                  "observer": self.role != "worker"}
        if wait_init:
            fields["wait_init"] = True
        if via_shm is not None:
            fields["via_shm"] = via_shm
        return [Message(Op.PULL, 0, self.copies.based(fields, s)) for s in self._every]

    def pull_base(self, shard: int) -> int | None:
        """The ``base`` a pull from ``shard`` names (None: it does not compress pulls)."""
        return self.copies.base(shard)

    def _land(self, params: Mapping[str, torch.Tensor], shard: int, rep: Message) -> bool:
        if rep.body.squeeze is not None:  # a compressed pull's answer (pullcopy.py)
            self.copies.land(params, shard, rep)
            return True
        share = self._small[shard]
        if share is not None and rep.body.shm is None and share.land(params, rep.tensors):
            return True
        return land(self.plan, self.channels[shard], params, rep)

    def land_all(self, params: Mapping[str, torch.Tensor], replies: list[Message],
                  done: set[int], clock: int) -> None:
        """Land every reply not in ``done``; shards whose board copies kept being
        overwritten are pulled again at ``clock`` over TCP."""
        again = [i for i, rep in enumerate(replies) if i not in done
                 and not self._land(params, i, rep)]
        if again:
            msgs = self.pull_msgs(clock, via_shm=False)  # frames, not another ticket
            got = self.call([msgs[i] for i in again], "PULL (TCP)", again)
            land_over_tcp(self.plan, params, [replies[i] for i in again], got)

    def pull(self, params: Mapping[str, torch.Tensor], clock: int = 0,
             wait_init: bool = False) -> PullResult:
        """Fetch every shard's slices into ``params`` (in place, any device).

        ``wait_init``: a shard not seeded yet holds the pull until another worker
        has seeded it (instead of refusing it, which makes us seed it)."""
        return follow_moves(self, lambda _: self._pull(params, clock, wait_init))

    def _pull(self, params: Mapping[str, torch.Tensor], clock: int,
              wait_init: bool) -> PullResult:
        t0 = time.perf_counter()
        observer = self.role != "worker"
        if not observer and not wait_init:
            self._params = params
        msgs = self.pull_msgs(clock, wait_init)
        done: set[int] = set()

        def assemble(i: int, rep: Message) -> None:
            # copy each shard's reply into the model as it lands, while others are in flight
            if self._land(params, i, rep):
                done.add(i)

        replies = self.call(msgs, "PULL", recover=not observer, on_reply=assemble)
        # answered only after a recovery, or to be pulled over TCP
        self.land_all(params, replies, done, clock)
        return PullResult.of(replies, t0)

    def bye_final(self, params: Mapping[str, torch.Tensor], timeout: float) -> PullResult:
        """Say BYE and pull the final weights into ``params``: per shard an observer's
        *final* pull, which the shard holds until every expected worker is done there
        (said BYE or was judged dead), and then this worker's BYE, pipelined behind it on
        the same connection. So a shard has the final pull parked before it sees the BYE
        that may end its job (``paramserver run`` stops a shard once every worker is
        done), and answers it before it stops. Waited for while the heartbeats say a
        shard holds it, for at most ``timeout`` seconds (0: no bound); past it a
        BarrierTimeoutError names who is awaited."""
        return follow_moves(self, lambda _: self._bye_final(params, timeout))

    def _bye_final(self, params: Mapping[str, torch.Tensor], timeout: float) -> PullResult:
        t0 = time.perf_counter()
        fields = {"worker": self.worker, "clock": 0, "observer": True, "final": True,
                  "via_shm": False}  # the last read: in frames, never a board ticket
        msgs: list[Message] = []
        for _ in self.channels:
            msgs += [Message(Op.PULL, 0, dict(fields)),
                     Message(Op.BYE, 0, {"worker": self.worker})]
        shards = [s for s in self._every for _ in range(2)]
        bound = self.barrier_timeout, self.barrier_label
        self.barrier_timeout, self.barrier_label = timeout, "final(timeout=...)"
        try:  # (never a HELLO on refusal: a worker that said BYE must not register again)
            replies = self.call(msgs, "final PULL", shards, recover=False)[::2]
        finally:
            self.barrier_timeout, self.barrier_label = bound
        for i, rep in enumerate(replies):
            self._land(params, i, rep)
        return PullResult.of(replies, t0)

    def host_grads(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gradients as CPU tensors in the wire dtype (gradwire.host_copies); CUDA ones
        through pinned host buffers kept between calls."""
        return gradwire.host_copies(grads, self.wire_dtype, self._pinned)

    def _split_grads(self, host: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        return gradwire.split_by_shard(self.plan, host, self.wire_dtype)

    def _in_parts(self, per_shard: Mapping[int, Mapping[str, torch.Tensor]]
                  ) -> list[list[dict[str, torch.Tensor]]] | None:
        """Each shard's slices in groups of at most ``part_bytes`` (a slice never split);
        None when every shard's share fits in one message."""
        if not self.part_bytes or self._largest_share <= self.part_bytes:
            return None  # known from the plan: no per-push work for small models
        out = [self._groups(per_shard.get(s, {}), self._part_limit(s))
               for s in range(len(self.channels))]
        return out if any(len(g) > 1 for g in out) else None

    def _part_limit(self, shard: int) -> int:
        """The part size for ``shard``: larger through shared memory, where a part's
        bytes stay in this worker's segment (they do not add to the shard's memory)
        and each part costs a message's Python on both sides (measured: 100 MiB in
        2 MiB parts 67-72 ms per round, in 8 MiB parts 61-65)."""
        link = self.channels[shard].shm
        if self.part_bytes and link is not None and link.active:
            return max(self.part_bytes, SHM_PART_BYTES)
        return self.part_bytes

    def _groups(self, tensors: Mapping[str, torch.Tensor],
                limit: int | None = None) -> list[dict[str, torch.Tensor]]:
        """``tensors`` in parts of at most ``limit`` bytes (default ``part_bytes``)."""
        return gradwire.groups(tensors, self.part_bytes if limit is None else limit)

    def _push_parts(self, groups: list[list[dict[str, torch.Tensor]]],
                    read_versions: Sequence[int], num_samples: int, clock: int,
                    loss: float | None, params: Mapping[str, torch.Tensor] | None
                    ) -> tuple[PushResult, PullResult | None]:
        """One push in parts, all sent at once (pipelined per shard); with ``params``
        the last part to each shard also asks for the next weights."""
        stream = PushStream(self, self.worker, self.next_push_id(), [len(g) for g in groups],
                            read_versions, num_samples, clock, prefetch=params is not None,
                            early=self.early_parts, loss=loss, window=PART_WINDOW)
        for shard, parts in enumerate(groups):
            for tensors in parts:
                stream.send_part(shard, tensors)
        return stream.finish(params)

    def _whole_push_msgs(self, parts: Mapping[int, Mapping[str, torch.Tensor]],
                         read_versions: Sequence[int], num_samples: int, clock: int,
                         loss: float | None = None, pull: bool = False,
                         packed: Sequence[PreparedTensors] = ()) -> list[Message]:
        """One PUSH per shard; ``pull``: each asks for the next weights back (push and
        pull in one round trip); ``packed``: each shard's tensors prepared instead."""
        head: dict[str, Any] = {"worker": self.worker, "push_id": self.next_push_id(),
                                "clock": clock, "num_samples": num_samples}
        if loss is not None:  # the servers' divergence watchdog follows the training loss
            head["loss"] = float(loss)
        if self.lr is not None:
            head["lr"] = self.lr
        msgs = []
        for s in range(len(self.channels)):
            fields = {**head, "read_version": read_versions[s]}
            if pull:
                fields = self.copies.based({**fields, "pull": True}, s)
            if packed:
                msgs.append(Message(Op.PUSH, 0, fields, {}, packed[s]))
                continue
            tensors, compressed = self.wire_tensors(parts.get(s, {}))
            if compressed:
                fields["compressed"] = True
            msgs.append(Message(Op.PUSH, 0, fields, tensors))
        return msgs

    def wire_tensors(self, tensors: Mapping[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], bool]:
        """A push's slices as they go: compressed (and True) with an encoder."""
        if self.encoder is None:
            return dict(tensors), False
        return self.encoder.encode(tensors), True

    def _small_push_msgs(self, grads: Mapping[str, torch.Tensor], read_versions: Sequence[int],
                         num_samples: int, clock: int, loss: float | None,
                         pull: bool = False) -> list[Message] | None:
        """:meth:`_whole_push_msgs` with each shard's gradients packed by its
        :class:`SmallShare` (a small model over TCP); None where the general path
        must take the push."""
        packed: list[PreparedTensors] = []
        for ch, share in zip(self.channels, self._small, strict=True):
            one = None if share is None or (ch.shm is not None and ch.shm.active) \
                else share.pack(grads)
            if one is None:
                return None
            packed.append(one)
        return self._whole_push_msgs({}, read_versions, num_samples, clock, loss, pull, packed)

    def push(self, grads: Mapping[str, torch.Tensor], read_versions: Sequence[int],
             num_samples: int, clock: int, loss: float | None = None) -> PushResult:
        """Send gradient slices to every shard, tagged with the version each was read at
        (and the training loss of those samples, if given)."""
        return follow_moves(self, lambda rv: self._push(grads, rv, num_samples, clock, loss),
                            read_versions)

    def _push(self, grads: Mapping[str, torch.Tensor], read_versions: Sequence[int],
              num_samples: int, clock: int, loss: float | None) -> PushResult:
        t0 = time.perf_counter()
        msgs = self._small_push_msgs(grads, read_versions, num_samples, clock, loss)
        if msgs is None:
            per_shard = self._split_grads(self.host_grads(grads))
            groups = self._in_parts(per_shard)
            if groups is not None:
                return self._push_parts(groups, read_versions, num_samples, clock, loss,
                                        None)[0]
            msgs = self._whole_push_msgs(per_shard, read_versions, num_samples, clock, loss)
        # a shard that restarted from an older checkpoint no longer has the
        # version our gradient was read at: that push is lost, not fatal
        replies = self.call(msgs, "PUSH", soft=(FutureVersionError,))
        return PushResult.of(
            msgs, [None if r.op is Op.ERROR else r.body.outcome for r in replies], t0)

    def push_pull(self, grads: Mapping[str, torch.Tensor], read_versions: Sequence[int],
                  num_samples: int, clock: int, params: Mapping[str, torch.Tensor],
                  loss: float | None = None) -> tuple[PushResult, PullResult]:
        """:meth:`push` at ``clock``, then :meth:`pull` for ``clock + 1``, in one round trip.

        Each shard gets one PUSH that asks for the weights back; it answers once
        the pull's gate opens (in sync mode, when the round closes) with the
        push's outcome and the weights, which are copied into ``params`` as each
        shard's reply lands. The pushed gradients must not change until this
        returns.
        """
        # grad mode off once for the round, not per landing (what torch.no_grad does,
        # without its context manager's four Python calls)
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return follow_moves(self, lambda rv: self._push_pull(
                grads, rv, num_samples, clock, params, loss), read_versions)
        finally:
            torch._C._set_grad_enabled(enabled)

    def _push_pull(self, grads: Mapping[str, torch.Tensor], read_versions: Sequence[int],
                   num_samples: int, clock: int, params: Mapping[str, torch.Tensor],
                   loss: float | None) -> tuple[PushResult, PullResult]:
        t0 = time.perf_counter()
        self.seed_from(params)
        msgs = self._small_push_msgs(grads, read_versions, num_samples, clock, loss,
                                     pull=True)
        if msgs is None:
            per_shard = self._split_grads(self.host_grads(grads))
            groups = self._in_parts(per_shard)
            if groups is not None:
                pushed, pulled = self._push_parts(groups, read_versions, num_samples, clock,
                                                  loss, params)
                assert pulled is not None
                return pushed, pulled
            msgs = self._whole_push_msgs(per_shard, read_versions, num_samples, clock, loss,
                                         pull=True)
        done: set[int] = set()

        def assemble(i: int, rep: Message) -> None:
            if self._land(params, i, rep):
                done.add(i)

        replies = self.call(msgs, "PUSH+PULL", soft=(FutureVersionError,),
                             on_reply=assemble)
        # a shard that rewound refused the push (soft error) and sent no weights
        lost = [i for i, r in enumerate(replies) if r.op is Op.ERROR]
        if lost:
            pulls = self.call([self.pull_msgs(clock + 1)[i] for i in lost], "PULL", lost)
            for i, rep in zip(lost, pulls, strict=True):
                # (the pull's answer, standing in for the lost push's: no outcome)
                rep.body = replace(rep.body, push=None, answers_push=True)
                replies[i] = rep
        if len(done) < len(replies):  # (most rounds landed every reply as it came)
            self.land_all(params, replies, done, clock + 1)
        pushed = PushResult.of(msgs, [r.body.push for r in replies], t0)
        return pushed, PullResult.of(replies, t0)

    def push_stream(self, buckets: Sequence[Sequence[str]], read_versions: Sequence[int],
                    num_samples: int, clock: int, *, prefetch: bool = True,
                    early: bool = True) -> PushStream:
        """A push sent bucket by bucket as the gradients become ready (see PushStream).

        ``early`` (with ``prefetch``): where a shard's weights come over TCP, let it
        send each bucket's next weights back before its round closes, when it can
        (see PushStream); False: they all come with the round's answer.

        ``buckets`` lists parameter names; together they must cover the plan's
        parameters, each once, and be sent with :meth:`PushStream.send`.
        """
        names = [n for b in buckets for n in b]
        if sorted(names) != sorted(p.name for p in self.plan.params):
            raise ConfigError("buckets must name every parameter of the plan exactly once")
        parts = [0] * self.plan.num_shards  # buckets with a slice on each shard
        for bucket in buckets:
            for shard in {sl.shard for n in bucket for sl in self.plan.slices_of(n)}:
                parts[shard] += 1
        stream = PushStream(self, self.worker, self.next_push_id(), parts, read_versions,
                            num_samples, clock, prefetch, early)
        stream.on_move = self._stream_moved
        stream.mark = self.encoder.mark() if self.encoder is not None else None
        return stream

    def _stream_moved(self, stream: PushStream, moved: PlanMovedError,
                      params: Mapping[str, torch.Tensor] | None
                      ) -> tuple[PushResult, PullResult | None]:
        """A streamed push (--overlap) the shards answered ``plan_moved``: it goes
        again whole on the new plan, with its push id, from the gradients its buckets
        carried, encoded from the residuals it began with."""
        if set(stream.grads) != {p.name for p in self.plan.params}:
            raise ConfigError(f"worker {self.worker}: the plan moved during a push sent "
                              "part by part (PushStream.send_part): send it again whole")
        # (push_pull numbers the push anew: one before the stream's id gives it again)
        versions = resend_on(self, moved, stream.push_id - 1, stream.mark, stream.read_versions)
        if params is None:
            return self.push(stream.grads, versions, stream.num_samples, stream.clock,
                             stream.loss), None
        return self.push_pull(stream.grads, versions, stream.num_samples, stream.clock,
                              params, loss=stream.loss)

    def stats(self) -> list[ShardStats]:
        """Each shard's STATS, as the wire decoded it."""
        replies = self.call([Message(Op.STATS) for _ in self.channels], "STATS", recover=False)
        return [r.body for r in replies]


#: moved to workers/admin.py; still importable from here
_MOVED_TO_ADMIN = frozenset({"pull_weights", "report_dead", "save_final_model", "server_stats",
                             "shutdown_servers"})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_ADMIN:
        from paramserver.workers import admin  # (admin imports this module)
        return getattr(admin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
