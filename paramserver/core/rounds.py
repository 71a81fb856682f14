"""What a shard takes in over several messages: a sync shard's open round (its
one aggregation buffer and the pushes in parts) and an INIT sent in parts.

:class:`SyncRound` belongs to one :class:`~paramserver.core.shard.ShardCore` in sync
mode. It holds the contributors of the open round, the running sample-weighted
sum of their gradients (``sum(n_i w_i g_i)``, one buffer the size of the shard)
and every worker's push still arriving in parts (a :class:`Stream`). What it
does not hold are the rules: who may join a round, when it closes and what a
given-up push means are decided in core.py; the round only adds, voids, closes
and counts.

A part is added into the buffer as it arrives and its frames can be freed at
once, so a sync shard never holds a whole gradient of any worker beside the
buffer. The one exception holds one instead of the buffer: a push that will be
the round's only contribution (one worker, or every other one missing within
the backup allowance) is kept as its own tensors while it is being handled, and
the step reads them directly, one pass over the shard fewer. What was added
cannot be taken back out, so a push given up half-way makes the round *void*: it
closes without a step.

The buffer is summed in one fixed order, by worker id, key by key, not in
arrival order: float addition is not associative, and a round summed as it
arrives makes two identical runs end apart. A worker's part of a key may be
added as it comes only when every worker with a lower id that the round waits
for (or that is in it) has its part of that key in the buffer, or adds nothing
to this round; otherwise the part is copied aside (:attr:`SyncRound.waiting`)
and folded in its turn. So an out-of-order arrival costs a copy of its part
until its turn, at most the shard's size per worker ahead of a slower one.
With backup workers the contributors themselves depend on timing, so the round
sums in arrival order.

Because the order is per key, a key's sum is final as soon as every worker the
round waits for has its part of it in (:meth:`SyncRound.complete`), while
later parts still arrive: its step can then be taken ahead (core/ahead.py,
"pipelined per part"). A key released so (:attr:`SyncRound.sealed`) that is
written again (a worker came back into the round) calls :attr:`SyncRound.reopened`.

:class:`Seeding` is the bookkeeping of an INIT sent in parts: who seeds the
weights and which parts and keys are in; which parts are taken and when the
weights count as seeded, core.py decides.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from paramserver.core.probe import PushMeasure
from paramserver.core.records import SliceSpec, check_tensors
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.policies.base import Decision, UpdateInfo
from paramserver.util.flat import FlatLayout

__all__ = ["Seeding", "Stream", "SyncRound"]


@dataclass
class Stream:
    """A sync push arriving in parts: decided at its first part, added part by part."""

    push_id: int
    parts: int
    info: UpdateInfo
    decision: Decision | None  # None: dropped before the policy ("late", "in round")
    reason: str
    received: set[int] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)
    added: bool = False  # some of it is in the round's buffer
    voided: bool = False  # it met a void round: none of it is added
    measure: PushMeasure | None = None  # observed pushes only

    def check_header(self, part: int, clock: int, read_version: int, num_samples: int,
                     parts: int) -> None:
        """A later part must carry its push's header (else a :class:`ProtocolError`)."""
        first = self.info
        if (clock, read_version, num_samples, parts) != (
                first.clock, first.read_version, first.num_samples, self.parts):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"push {self.push_id} part {part}: its "
                                "header differs from the push's first part")


class SyncRound:
    """The open sync round of one shard whose weights are ``params``."""

    def __init__(self, params: Mapping[str, torch.Tensor],
                 layout: FlatLayout | None = None,
                 roster: Callable[[], Collection[int]] | None = None) -> None:
        self.params = params
        # the workers the round waits for, whose ids set the order of the sum
        # (None: sum in arrival order, see the module's docstring)
        self.roster = roster
        # worker -> its parts that came before their turn: (gradients, factor)
        self.waiting: dict[int, list[tuple[dict[str, torch.Tensor], float]]] = {}
        # worker (not joined yet) -> keys of its push in the buffer
        self.adding: dict[int, set[str]] = {}
        self.silent: set[int] = set()  # workers whose push adds nothing to this round
        self.sealed: set[str] = set()  # keys whose sums were read before the close
        self.reopened: Callable[[], None] | None = None  # a sealed key was written again
        self.touched: set[str] = set()  # keys written since :meth:`complete` last looked
        # with a layout the buffer is one flat buffer per dtype, the slices views into it
        self.layout = layout
        self.agg_flats: dict[torch.dtype, torch.Tensor] = {}
        self._made: dict[str, torch.Tensor] | None = None  # the views over agg_flats
        self.members: set[int] = set()  # workers that contributed to the open round
        # when the open round's first push came (None: no round open): its deadline
        # runs from then (Membership.leave_out)
        self.opened: float | None = None
        self.samples = 0  # samples of the accepted gradients in the buffer
        self.accepted = 0  # workers whose accepted gradient is in the buffer
        self.agg: dict[str, torch.Tensor] = {}
        # key -> (a contributor's own tensor, its factor), not copied yet (see add)
        self.held: dict[str, tuple[torch.Tensor, float]] = {}
        self.written: set[str] = set()  # keys of agg written in the open round
        self.void = False  # a push was given up half-way: close without a step
        self.streams: dict[int, Stream] = {}  # worker -> its sync push in the making
        self.voided = 0  # rounds closed void
        self.in_place = 0  # rounds stepped straight from a lone contributor's tensors
        self.dropped = 0  # rounds closed with nothing to apply
        # rounds closed, stepped or not: the same count on every shard of a sync run
        # at a boundary, which is how checkpoints of different shards are matched
        self.closed = 0

    def begin(self, now: float) -> None:
        """A push that will count in a round came at ``now``: the round is open (from
        the first such push since nothing was in it: one given up leaves nothing)."""
        if self.opened is None or not (self.members or self.streams):
            self.opened = now

    def empty(self) -> bool:
        """Whether nothing is in the open round (no push, whole, in parts or set aside,
        and not void): the shard stands between two rounds."""
        return not (self.members or self.streams or self.waiting or self.samples
                    or self.void or self.written or self.in_flight())

    def in_flight(self) -> bool:
        """Whether a push in the making has parts in the buffer already (or set
        aside for their turn)."""
        return (any(s.added for s in self.streams.values())
                or any(w not in self.members for w in self.waiting))

    def saved_sums(self) -> Mapping[str, torch.Tensor]:
        """The round's sums with every joined worker's parts in, for a snapshot: the
        buffer itself, or a copy with the parts still set aside added in their order
        (the live round keeps its order)."""
        joined = sorted(w for w in self.waiting if w in self.members)
        if not joined:
            return self.agg
        scratch = SyncRound(self.params)
        scratch._allocate()
        for key in self.written:
            scratch.agg[key].copy_(self.agg[key])
        scratch.written = set(self.written)
        for worker in joined:
            for grads, alpha in self.waiting[worker]:
                scratch._add(grads, alpha, False)
        return scratch.agg

    def add(self, stream: Stream, grads: Mapping[str, torch.Tensor], alpha: float,
            borrow: bool = False) -> None:
        """Add ``alpha * grads`` (one part of ``stream``, or all of it) to the buffer.

        ``borrow``: ``stream`` may be the round's only contributor (the round would
        close on its last part): a key nobody wrote yet keeps a reference to the
        pushed tensor instead of a copy (:attr:`held`), valid while its push is being
        handled. :meth:`settle` copies what is held if the round stays open after
        that; a second contributor's part settles its key first.

        A key that comes before its turn (:meth:`_lower`) is copied aside and added
        by :meth:`fold`, with the same arithmetic, when its turn comes."""
        worker = stream.info.worker
        lower = self._lower(worker)
        now = {k: g for k, g in grads.items() if self._turn(lower, k)} if lower else grads
        if len(now) < len(grads):
            self.waiting.setdefault(worker, []).append(
                ({key: g.clone() for key, g in grads.items() if key not in now}, alpha))
        if not now:
            return
        self._add(grads if len(now) == len(grads) else now, alpha, borrow, worker)
        stream.added = True
        if self.waiting:
            self.fold()

    def _order(self) -> set[int]:
        """The workers whose parts set the order of the sums: those the round waits
        for and those in it."""
        assert self.roster is not None
        return {*self.roster(), *self.members, *self.adding, *self.waiting}

    def _lower(self, worker: int) -> list[int]:
        """The workers whose part of a key comes before ``worker``'s in its sum (none:
        the round sums in arrival order)."""
        if self.roster is None:
            return []
        return [w for w in self._order() if w < worker and w not in self.silent]

    def _turn(self, lower: Collection[int], key: str) -> bool:
        return all(self._has(w, key) for w in lower)

    def _has(self, worker: int, key: str) -> bool:
        """Whether ``worker``'s part of ``key`` is in the buffer (or it adds none)."""
        if worker in self.silent or key in self.adding.get(worker, ()):
            return True
        return worker in self.members and not any(key in g for g, _ in
                                                  self.waiting.get(worker, ()))

    def mute(self, worker: int) -> None:
        """``worker``'s push adds nothing to this round (refused, rejected, or it met
        a void round): the parts after it in a key's order need not wait for it."""
        if worker in self.members or worker in self.adding or worker in self.silent:
            return
        self.silent.add(worker)
        self.touched.update(self.params)  # keys that waited on it may be final now
        if self.waiting:
            self.fold()

    def fold(self, every: bool = False) -> None:
        """Add the parts set aside whose turn has come, lowest worker id first
        (``every``: all of them, in that order: the round closes, or is saved)."""
        for worker in sorted(self.waiting):
            lower = [] if every else self._lower(worker)
            keep: list[tuple[dict[str, torch.Tensor], float]] = []
            now: list[tuple[dict[str, torch.Tensor], float]] = []
            for grads, alpha in self.waiting[worker]:
                ready = {k: g for k, g in grads.items() if self._turn(lower, k)}
                if ready:
                    now.append((ready, alpha))
                if len(ready) < len(grads):
                    keep.append(({k: g for k, g in grads.items() if k not in ready}, alpha))
            if not now:
                continue
            if keep:
                self.waiting[worker] = keep
            else:
                del self.waiting[worker]
            for grads, alpha in now:
                self._add(grads, alpha, False, worker)
            stream = self.streams.get(worker)
            if stream is not None:
                stream.added = True

    def complete(self) -> set[str]:
        """The keys written since the last look whose sums are final: every worker the
        round waits for (or that is in it) has its part of them in the buffer, or adds
        nothing. Empty when the round sums in arrival order (backup workers) or is void."""
        touched, self.touched = self.touched, set()
        if self.roster is None or self.void or not touched:
            return set()
        order = [w for w in self._order() if w not in self.silent]
        return {k for k in touched if k in self.written and k not in self.sealed
                and all(self._has(w, k) for w in order)}

    def totals(self, stream: Stream) -> tuple[int, int]:
        """(samples, contributors) the round will close with if every push begun, and
        ``stream``, is accepted as it was decided: once a key is final every worker
        the round waits for has begun its push, so these are the close's."""
        samples, contributors = self.samples, self.accepted
        for worker, s in {**self.streams, stream.info.worker: stream}.items():
            if (worker not in self.members and s.decision is not None
                    and s.decision.accept and not s.voided):
                samples += s.info.num_samples
                contributors += 1
        return samples, contributors

    def _add(self, grads: Mapping[str, torch.Tensor], alpha: float, borrow: bool,
             worker: int | None = None) -> None:
        if self.sealed and not self.sealed.isdisjoint(grads):
            self.sealed.clear()  # its sums were read too soon: what was made of them goes
            if self.reopened is not None:
                self.reopened()
        for key, g in grads.items():
            if key in self.held:
                self._settle(key)
            if key in self.written:
                self.agg[key].add_(g, alpha=alpha)  # in the buffer's dtype, also for 16-bit g
            elif borrow and g.dtype == self.params[key].dtype:
                self.held[key] = (g, alpha)
            else:
                buf = self._buffer(key)
                if g.dtype == buf.dtype:  # the round's first gradient overwrites:
                    torch.mul(g, alpha, out=buf)  # no zeroing pass per round
                else:  # widen exactly first (a 16-bit product would round)
                    buf.copy_(g)
                    if alpha != 1.0:
                        buf.mul_(alpha)
        self.written.update(grads)
        self.touched.update(grads)
        if worker is not None and worker not in self.members:
            self.adding.setdefault(worker, set()).update(grads)

    def _buffer(self, key: str) -> torch.Tensor:
        if not self.agg:
            self._allocate()
        return self.agg[key]

    def _allocate(self) -> None:
        if self.layout is None:
            self.agg = {k: torch.empty_like(p) for k, p in self.params.items()}
            return
        self.agg_flats = {d: torch.empty(n, dtype=d) for d, n in self.layout.sizes.items()}
        self.agg = self._made = self.layout.views(self.agg_flats, order=self.layout.index)

    def flat_buffer(self) -> dict[torch.dtype, torch.Tensor] | None:
        """The buffer's flat tensors, made if need be (a restored buffer is not flat);
        None without a layout."""
        if self.layout is None:
            return None
        if not self.agg or self.agg is not self._made:
            self._allocate()
        return self.agg_flats

    def _settle(self, key: str) -> None:
        g, alpha = self.held.pop(key)
        torch.mul(g, alpha, out=self._buffer(key))

    def settle(self) -> None:
        """Copy every held gradient into the buffer (its push is answered, or the
        step needs a buffer it may write)."""
        for key in list(self.held):
            self._settle(key)

    def _borrowed(self) -> tuple[dict[str, torch.Tensor], float] | None:
        """The round's sums as the lone contributor's own tensors and the factor
        they were to be scaled by; None unless every key is held at one factor."""
        if len(self.held) != len(self.params):
            return None
        alphas = {alpha for _, alpha in self.held.values()}
        if len(alphas) != 1:
            return None
        return {key: self.held[key][0] for key in self.params}, alphas.pop()

    def join(self, worker: int, samples: int) -> None:
        """``worker``'s push is complete: it is a contributor, with ``samples`` in the
        buffer (0 for a push its policy rejected)."""
        self.members.add(worker)
        self.adding.pop(worker, None)  # (a member's keys are in unless set aside)
        self.samples += samples
        if samples > 0:
            self.accepted += 1
        if self.waiting:
            self.fold()

    def give_up(self, stream: Stream) -> bool:
        """``stream`` will not be completed; True when that made the round void now."""
        self.waiting.pop(stream.info.worker, None)  # set aside: never added
        self.silent.discard(stream.info.worker)
        if stream.added and not self.void:
            self.void = True
            self.held.clear()  # never stepped: let the pushed tensors go
            return True
        return False

    def close(self, step: Callable[[Mapping[str, torch.Tensor], float], bool],
              borrow: bool = False) -> bool:
        """Close the round: ``step(sums, divisor)`` on the buffer's sample-weighted sums
        and the sample count that makes them the mean (the step divides), unless the
        round is void or holds no accepted gradient. True when it stepped (a step that
        returns False was refused: the round is dropped).

        ``borrow``: the step only reads its sums, so a lone contributor's held
        tensors are stepped from as they are (divided by ``samples / factor``): no
        pass to copy them. A step that fails closes the round all the same
        (dropped): a round that cannot be stepped must not be retried on every
        later event, wedging the shard."""
        stepped = False
        try:
            self.fold(every=True)  # a worker the round waited for did not come
            if self.void:
                self.voided += 1
                self.dropped += 1
            elif self.samples > 0:
                lone = self._borrowed() if borrow else None
                if lone is not None:
                    stepped = step(lone[0], self.samples / lone[1])
                    self.in_place += stepped
                else:
                    self.settle()
                    stepped = step({key: self.agg[key] for key in self.params}, self.samples)
                self.dropped += not stepped
            else:
                self.dropped += 1
        except Exception:
            self.dropped += 1
            self.agg = {}
            raise
        finally:
            self.closed += 1
            self.members.clear()
            self.opened = None
            self.held.clear()
            self.samples = 0
            self.accepted = 0
            self.written.clear()
            self.waiting.clear()
            self.adding.clear()
            self.silent.clear()
            self.sealed.clear()
            self.touched.clear()
            self.void = False
        return stepped


class Seeding:
    """The weights being seeded from an INIT in parts: by ``owner`` (None: nobody is
    seeding), in ``total`` parts, of which ``parts`` are in, holding ``keys``."""

    def __init__(self) -> None:
        self.owner: int | None = None
        self.parts: set[int] = set()
        self.keys: set[str] = set()
        self.total = 0

    def begin(self, worker: int, total: int) -> None:
        """``worker`` starts seeding, in ``total`` parts."""
        self.owner, self.parts, self.keys, self.total = worker, set(), set(), total

    def add(self, part: int, keys: Iterable[str]) -> None:
        self.parts.add(part)
        self.keys.update(keys)

    def is_last(self) -> bool:
        """Whether the next new part completes the seeding."""
        return len(self.parts) + 1 == self.total

    def accept(self, worker: int, part: int, parts: int, tensors: Mapping[str, torch.Tensor],
               specs: Mapping[str, SliceSpec], params: Mapping[str, torch.Tensor]
               ) -> bool | None:
        """Part ``part`` of ``parts`` of ``worker``'s INIT, copied into ``params`` once
        checked. False: another worker is seeding; None: an earlier part (or one sent
        again); True: this part completed the seeding."""
        if not 0 <= part < parts:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"INIT part {part} of {parts}: need 0 <= part < parts")
        if self.owner is None:
            self.begin(worker, parts)
        elif self.owner != worker:
            return False
        if parts != self.total:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"INIT in {parts} parts after {self.total}")
        if part in self.parts:
            return None
        check_tensors(specs, tensors, "INIT", whole=False, seen=self.keys)
        last = self.is_last()
        missing = specs.keys() - self.keys - tensors.keys()
        if last and missing:
            self.end()
            raise ProtocolError(ErrorCode.BAD_TENSOR,
                                f"INIT: missing keys after the last part: {sorted(missing)[:5]}")
        with torch.no_grad():
            for key, value in tensors.items():
                params[key].copy_(value)
        self.add(part, tensors)
        if not last:
            return None
        self.end()
        return True

    def end(self) -> None:
        """Seeded, or given up: the next INIT in parts starts over."""
        self.owner = None
