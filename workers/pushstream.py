"""PushStream: one push sent to its shards in parts, as backward produces the buckets.

With ``prefetch`` the last part to each shard also asks for the next weights.
Where those come over TCP, the earlier parts ask for them too (``early``): a
shard that steps its round ahead part by part (paramserver/core/ahead.py) answers a
part with the next weights of that part's slices, so they travel while later
parts are still being computed and sent (issue 17, item 4). They are only
provisional: the round's answer says how many slices went back early
(``early``) and carries the rest, and does so only if the round made exactly
those weights. Otherwise, and whenever what came early does not add up, the
answer's own weights (all of them) are used, as without ``early``. A shard that
compresses pulls (workers/pullcopy.py) is not asked: its answer is a change to the
worker's copy, which weights sent early would not fit.

A stream is given what it needs of its client (workers/client.py's PSClient)
through :class:`StreamClient`: the plan, the channels, and the few things only
the client does (its request loop with recovery, landing pulled weights). The
results a push and a pull report (:class:`PushResult`, :class:`PullResult`) are
here too, since a stream makes both; PSClient re-exports them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
import torch

from paramserver.core.records import PushOutcome
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, FutureVersionError, PlanMovedError, RemoteError
from paramserver.wire.messages import PullReply, PushReply
from paramserver.wire.protocol import Message, Op
from paramserver.wire.transport import Channel
from paramserver.workers.landing import ticket_bytes

__all__ = ["PullResult", "PushResult", "PushStream", "StreamClient", "take_early"]

# the outcome reported for a push a shard refused because it rewound to a checkpoint
# older than the version our gradient was read at: lost, not fatal
REWOUND = PushOutcome(accepted=False, weight=0.0, reason="server rewound", staleness=0,
                      version=-1, applied=False)


class PullResult(msgspec.Struct, frozen=True):
    """What a pull read (a msgspec Struct: made once per round, 0.4 us against a frozen
    dataclass's 5 us)."""

    versions: tuple[int, ...]  # per shard, the version the weights were read at
    clock: int  # the worker's clock as the shards see it (max over shards)
    waited: float  # longest time a shard held the pull back (sync barrier / SSP gate)
    seconds: float  # wall time of the whole pull
    nbytes: int

    @classmethod
    def of(cls, replies: Sequence[Message], t0: float) -> PullResult:
        """What the shards' pull answers ``replies`` say, for a pull begun at ``t0``."""
        versions = []
        clock, waited, nbytes = -1, 0.0, 0
        for r in replies:  # one pass (a round's bookkeeping: no generator per field)
            b: PullReply = r.body
            versions.append(b.version)
            clock = max(clock, b.clock)
            waited = max(waited, b.waited)
            nbytes += r.nbytes or ticket_bytes(r)
        return cls(tuple(versions), clock, waited, time.perf_counter() - t0, nbytes)


class PushResult(msgspec.Struct, frozen=True):
    """What a push's shards answered (a msgspec Struct, as :class:`PullResult`)."""

    outcomes: tuple[PushOutcome, ...]  # per shard: accepted, weight, reason, staleness, ...
    seconds: float
    nbytes: int

    @classmethod
    def of(cls, msgs: Sequence[Message], outcomes: Sequence[PushOutcome | None],
           t0: float) -> PushResult:
        """A push of ``msgs`` begun at ``t0``; an outcome None: a shard that rewound."""
        nbytes = 0
        for m in msgs:
            nbytes += m.nbytes
        return cls(tuple([REWOUND if o is None else o for o in outcomes]),
                   time.perf_counter() - t0, nbytes)

    @property
    def accepted(self) -> bool:
        return all(o.accepted for o in self.outcomes)

    @property
    def staleness(self) -> int:
        return max((o.staleness for o in self.outcomes), default=0)

    @property
    def reasons(self) -> list[str]:
        return sorted({o.reason for o in self.outcomes if not o.accepted})


class StreamClient(Protocol):
    """What a push stream needs of the client that opened it (PSClient)."""

    @property
    def plan(self) -> ShardPlan: ...

    @property
    def channels(self) -> Sequence[Channel[Any]]: ...

    @property
    def lr(self) -> float | None:
        """A learning rate every push carries (the evaluating rank changed it)."""

    def host_grads(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gradients as CPU tensors in the wire dtype."""

    def wire_tensors(self, tensors: Mapping[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], bool]:
        """A push's slices as they go on the wire, and whether they are compressed."""

    def seed_from(self, params: Mapping[str, torch.Tensor]) -> None:
        """The weights a shard that lost its own is seeded from, should one rejoin."""

    def call(self, msgs: list[Message], what: str, shards: list[int], *,
             soft: tuple[type[RemoteError], ...] = (), sent: bool = False,
             window: int = 0) -> list[Message]:
        """Send each message to its shard, collect the replies (with recovery)."""

    def pull_msgs(self, clock: int) -> list[Message]:
        """A PULL at ``clock`` for every shard."""

    def pull_base(self, shard: int) -> int | None:
        """The ``base`` a pull from ``shard`` names (None: it does not compress pulls)."""

    def land_all(self, params: Mapping[str, torch.Tensor], replies: list[Message],
                 done: set[int], clock: int) -> None:
        """Copy the pulled weights of ``replies`` (but those in ``done``) into ``params``."""


def take_early(final: Message, partials: Sequence[Message], keys: Sequence[str]) -> bool:
    """Put the weights that came early with ``partials`` into ``final`` (a shard's
    answer to the last part, holding ``keys``' weights but those). False: they do
    not add up (the answer must not be used alone; pull the shard again)."""
    body = final.body
    count = body.early if isinstance(body, PullReply) else None
    if count is None:
        return True  # the answer holds every key: nothing came early for it
    early: dict[str, torch.Tensor] = {}
    for rep in partials:
        part = rep.body
        if isinstance(part, PushReply) and part.early == body.version:
            early.update(rep.tensors)
    rest = set(keys) - set(final.tensors)
    if count != len(early) or set(early) != rest:
        return False
    final.tensors = {**early, **final.tensors}
    return True


def _partial(rep: Message) -> bool:
    """Whether ``rep`` answers a part of a push that is not the last."""
    body = rep.body
    return isinstance(body, PushReply) and body.partial


class PushStream:
    """One push, sent to each shard in parts, bucket by bucket, as backward produces them.

    Each :meth:`send` ships a bucket's gradients at once (a PUSH part to every
    shard holding a slice of them) and returns without waiting, so the transfer
    overlaps the rest of backward. A shard answers the last part with the
    push's outcome; with ``prefetch`` that part also asks for the next weights,
    which the shard sends when its pull gate opens, so the pull costs no extra
    round trip. :meth:`finish` waits for every reply.
    """

    def __init__(self, client: StreamClient, worker: int, push_id: int, parts: Sequence[int],
                 read_versions: Sequence[int], num_samples: int, clock: int,
                 prefetch: bool, early: bool = True, loss: float | None = None,
                 window: int = 0) -> None:
        self.client = client
        self.worker = worker
        self.push_id = push_id  # (the client's next: pushes are numbered per worker)
        self.prefetch = prefetch
        self.early = early and prefetch
        self.parts = list(parts)  # parts each shard will get (0: one empty part at finish)
        self.sent = [0] * client.plan.num_shards
        self.clock = clock
        self.num_samples = num_samples
        self.read_versions = list(read_versions)
        self.msgs: list[Message] = []
        self.shards: list[int] = []
        self.loss = loss  # the step's training loss, sent with each part
        # > 0: parts are not sent by send() but by finish(), this many outstanding per shard
        self.window = window
        self.t0 = time.perf_counter()
        #: what send() shipped, by parameter (host tensors, not copies): a push the
        #: shards answer ``plan_moved`` goes again whole from it (``on_move``)
        self.grads: dict[str, torch.Tensor] = {}
        #: (stream, the move, params) -> finish()'s result on the new plan; None: the
        #: PlanMovedError goes up to the caller (a push in parts: follow_moves resends it)
        self.on_move: Callable[[PushStream, PlanMovedError, Mapping[str, torch.Tensor] | None],
                               tuple[PushResult, PullResult | None]] | None = None
        self.mark: Any = None  # the client's encoder as it stood before this push

    def send(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Ship one bucket: the full gradients of some parameters (any device)."""
        host = self.client.host_grads(grads)
        self.grads.update(host)
        per_shard: dict[int, dict[str, torch.Tensor]] = {}
        for name, g in host.items():
            spec = self.client.plan.param(name)
            if tuple(g.shape) != spec.shape:
                raise ConfigError(f"gradient {name!r}: shape {tuple(g.shape)}, the plan "
                                  f"says {spec.shape}")
            flat = g.reshape(-1)
            for sl in self.client.plan.slices_of(name):
                per_shard.setdefault(sl.shard, {})[sl.key] = flat[sl.start:sl.stop]
        for shard, tensors in sorted(per_shard.items()):
            self.send_part(shard, tensors)

    def send_part(self, shard: int, tensors: dict[str, torch.Tensor]) -> None:
        parts = max(1, self.parts[shard])
        part = self.sent[shard]
        if part >= parts:
            raise ConfigError(f"shard {shard} got more parts than its {parts} buckets")
        """Ship ``tensors`` as the next of ``shard``'s parts (now, or at finish with a
        window)."""
        fields: dict[str, Any] = {
            "worker": self.worker, "push_id": self.push_id, "clock": self.clock,
            "num_samples": self.num_samples, "read_version": self.read_versions[shard],
            "part": part, "parts": parts}
        if self.prefetch and part == parts - 1:
            fields["pull"] = True
            base = self.client.pull_base(shard)  # (compressed pulls: workers/pullcopy.py)
            if base is not None:
                fields["base"] = base
        elif self.early and self._over_tcp(shard) and self.client.pull_base(shard) is None:
            # (a shard that compresses pulls answers the round with the change to this
            # worker's copy: weights sent early would not be used)
            fields["early"] = True
        if self.loss is not None:
            fields["loss"] = float(self.loss)
        if self.client.lr is not None:
            fields["lr"] = self.client.lr
        tensors, compressed = self.client.wire_tensors(tensors)
        if compressed:
            fields["compressed"] = True
        msg = Message(Op.PUSH, 0, fields, tensors)
        if not self.window:
            channel = self.client.channels[shard]
            msg.seq = channel.next_seq()
            channel.send(msg)
        self.msgs.append(msg)
        self.shards.append(shard)
        self.sent[shard] += 1

    def _over_tcp(self, shard: int) -> bool:
        """Whether the shard's weights come to us in frames (not through its board)."""
        link = self.client.channels[shard].shm
        return link is None or not link.active

    def finish(self, params: Mapping[str, torch.Tensor] | None = None
               ) -> tuple[PushResult, PullResult | None]:
        """Wait for every shard's answer; with ``prefetch``, copy the weights into ``params``.

        Shards without slices get their (empty) part now.
        """
        client = self.client
        for shard, parts in enumerate(self.parts):
            if parts == 0 and self.sent[shard] == 0:
                self.send_part(shard, {})
        unsent = [s for s, n in enumerate(self.sent) if n < max(1, self.parts[s])]
        if unsent:
            raise ConfigError(f"buckets not sent before finish(); shards waiting: {unsent}")
        if self.prefetch and params is None:
            raise ConfigError("a prefetching push stream needs params to pull into")
        if params is not None:
            client.seed_from(params)
        try:
            replies = client.call(self.msgs, "PUSH", list(self.shards),
                                   soft=(FutureVersionError,), sent=not self.window,
                                   window=self.window)
        except PlanMovedError as moved:
            # a live reshard: the cut waits for whole pushes, so no shard took a part of
            # this one; it goes again whole on the new plan (PSClient.push_stream's hook)
            if self.on_move is None:
                raise
            return self.on_move(self, moved, params)
        finals: list[Message] = []
        repull: set[int] = set()  # what came early did not add up: pull these again
        for shard in range(len(client.channels)):
            idx = [i for i, s in enumerate(self.shards) if s == shard]
            got = [replies[i] for i in idx]
            if all(_partial(r) for r in got):
                # the shard lost earlier parts (it restarted): all of them again
                again = [Message(Op.PUSH, 0, dict(self.msgs[i].fields), self.msgs[i].tensors)
                         for i in idx]
                got = client.call(again, "PUSH", [shard] * len(idx),
                                   soft=(FutureVersionError,), window=self.window)
            final = [r for r in got if not _partial(r)]
            finals.append(final[-1])
            keys = [sl.key for sl in client.plan.shard_slices(shard)]
            if not take_early(final[-1], [r for r in got if _partial(r)], keys):
                repull.add(shard)
        outcomes: list[PushOutcome | None] = []
        for rep in finals:
            body = rep.body
            if isinstance(body, PullReply):  # the push's outcome with the next weights
                outcomes.append(body.push)
            else:  # its outcome alone (PushReply), or None for an ERROR
                outcomes.append(body.outcome if isinstance(body, PushReply) else None)
        pushed = PushResult.of(self.msgs, outcomes, self.t0)
        if params is None:
            return pushed, None
        missing = [s for s, r in enumerate(finals)
                   if not isinstance(r.body, PullReply) or s in repull]
        if missing:  # no weights came with these answers: ask for them
            clock = self.clock + 1
            got = client.call([client.pull_msgs(clock)[s] for s in missing], "PULL", missing)
            for s, r in zip(missing, got, strict=True):
                finals[s] = r
        with torch.no_grad():
            client.land_all(params, finals, set(), self.clock + 1)
        return pushed, PullResult.of(finals, self.t0)
