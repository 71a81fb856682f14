"""A lone contributor's sync round, stepped ahead part by part, out of place.

When a sync round can only have one contributor and its step is plain SGD,
which only reads the gradient, the next weights of a range, ``w - lr * g``,
depend on nothing that arrives later. So they are computed as each part of the
push arrives, into a second buffer, while the worker is still sending the later
parts (issue 17, item 4: the step overlapped with the communication of the
last bucket). The weights the shard serves do not change until the round
closes; then the second buffer *becomes* the weights (their storage moves,
nothing is copied), and the buffer they leave is the next round's second one.

Whatever makes the round anything else drops what was computed ahead, and the
step is then taken as usual from the pushed gradient: another worker joins
half-way, a part is not finite or the push is given up (the round is void),
the learning rate changes, a part comes in another dtype. So does a part that
finds more work waiting: writing a second buffer costs about twice the
in-place step (measured: 0.55 against 0.29 ms per 8 MiB), which pays only
while the shard would otherwise wait, as during backward (the overlap
benchmark); when parts come back to back (a 100 MiB push) it would make the
shard the bottleneck.

What was computed for a part can go back to the worker with that part's answer
(:meth:`StepAhead.ready`, asked for with the part's ``early`` field), so the
next weights travel while later parts still do; the round's answer then says
whether the round made exactly those weights (it committed ahead, at
:attr:`StepAhead.last_commit`) and carries only the rest, or carries them all.

The second buffer is the round's aggregation buffer, which such a round does
not use; or, once the weights live in the shard's weight board
(paramserver/board.py), the board's other slot (:class:`AheadSlot`, given by
the server), held open in its seqlock until it is adopted or dropped.

**Several contributors (pipelined per part, issue 45).** A round summed by
worker id (no backup workers) knows a key's sum is final once every worker it
waits for has its part of that key in (:meth:`SyncRound.complete
<paramserver.core.rounds.SyncRound.complete>`), and the step's rate once every
one of them has begun its push (the divisor is their samples). So the same
out-of-place step is taken key by key as each sum becomes final, into a spare
buffer of its own (the aggregation buffer holds the sums), and what it made
goes back with any later answer while later parts still arrive. The round's
version, its step and its answer are unchanged: the commit at the close is the
same check as for a lone push (every key, at the rate the close computes,
through the step guard), and a key written after it was stepped (a worker came
back into the round) drops it all. Such early weights are copied once per key,
not once per worker, and the copies are never written again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from paramserver.core.rounds import SyncRound
    from paramserver.util.flat import FlatLayout

__all__ = ["REST_ROUNDS", "AheadSlot", "StepAhead"]

#: at most this many rounds a shard does not step ahead after a part found more
#: work waiting (1, 2, 4, ... after tries in a row that did): the parts of such
#: pushes come back to back, and each try would cost its first part
REST_ROUNDS = 16


class AheadSlot(Protocol):
    """Where the next weights go when the weights live in a board slot."""

    def begin(self) -> dict[torch.dtype, torch.Tensor] | None:
        """Open a slot the weights do not live in; its flat buffers (None: busy)."""

    def commit(self, version: int) -> bool:
        """The weights move into the opened slot, complete at ``version``; False when
        it was dropped meanwhile (another change of the board came first)."""

    def drop(self) -> None:
        """Close the opened slot unused (its old contents are gone)."""


class StepAhead:
    """The next weights of one shard's open sync round, computed part by part."""

    def __init__(self, layout: FlatLayout, flats: Mapping[torch.dtype, torch.Tensor],
                 params: Mapping[str, torch.Tensor], sync: SyncRound) -> None:
        self.layout = layout
        self.flats = flats  # the weights' flat buffers (params are views into them)
        self.params = params
        self.round = sync
        self.slot: AheadSlot | None = None  # the board's, once the weights live there
        # whether more work is waiting (the driver's socket): stepping ahead costs
        # more than the step at the close (it writes a second buffer), so it only
        # pays while the shard would otherwise wait for the next part
        self.busy: Callable[[], bool] | None = None
        # the part being added asks for its next weights early (over TCP): stepped
        # ahead even when more work waits, as their transfer then overlaps what comes
        # after, which saves more than the second buffer costs (the overlap
        # benchmark over TCP: 4-5 % faster steps with it, none early without it)
        self.eager = False
        self.rest = 0  # rounds left not to try (parts came back to back lately)
        self.misses = 0  # tries in a row that found the shard busy
        self.active: bool | None = None  # None: not begun this round; False: dropped
        self.alpha = 0.0  # the step's -lr / divisor the next weights were computed with
        self.next: dict[str, torch.Tensor] = {}
        self.keys: set[str] = set()
        self.on_board = False
        self.committed = 0  # rounds whose step was taken ahead
        self.found_busy = 0  # tries dropped because more work was waiting
        self.last_commit: int | None = None  # the version the last such step made
        self.shared = False  # the round has several contributors (stepped into spare)
        self.spare: dict[torch.dtype, torch.Tensor] | None = None  # (made when first used)
        self.mixed = False  # another worker joined a lone round: no lone step this round
        self.copies: dict[str, torch.Tensor] = {}  # the next weights handed out, copied

    def part(self, grads: Mapping[str, torch.Tensor], alpha: float | None, more: bool,
             shared: bool = False) -> None:
        """``w + alpha * g`` for the keys of one part of the round's lone push, or
        (``shared``) for keys whose sums over several contributors are final; ``more``:
        later parts are still to come (a round is begun only then); ``alpha`` None:
        the step's rate is not known before the close, so nothing is done ahead."""
        if self.active is False:
            return
        if alpha is None or (self.mixed and not shared) or (
                self.active and shared != self.shared):
            self.drop()
            return
        if self.active is None and (not more or (self.rest > 0 and not self.eager)):
            self.active = False
            return
        # (a shared round once begun goes on: its keys come one part at a time anyway)
        if (self.busy is not None and not self.eager and not (shared and self.active)
                and self.busy()):
            self.drop()
            self.found_busy += 1
            self.rest = min(REST_ROUNDS, 1 << self.misses)
            self.misses += 1
            return
        if self.active is None:
            if not self._begin(shared):
                return
            self.alpha = alpha
        elif alpha != self.alpha:
            self.drop()
            return
        if any(g.dtype != self.params[k].dtype for k, g in grads.items()):
            self.drop()
            return
        with torch.no_grad():
            for key, g in grads.items():
                torch.add(self.params[key], g, alpha=alpha, out=self.next[key])
        self.keys.update(grads)

    def _begin(self, shared: bool = False) -> bool:
        # (a version may come again after a checkpoint is restored: only this
        # round's commit may vouch for what it hands out)
        self.last_commit = None
        self.on_board = self.slot is not None
        self.shared = shared
        if self.slot is not None:
            flats = self.slot.begin()
        elif shared:
            flats = self._spare()
        else:
            flats = self.round.flat_buffer()
        if flats is None or not self.flats:
            self.active = False
            return False
        self.next = self.layout.views(flats, order=self.layout.index)
        self.active = True
        return True

    def commit(self, alpha: float, version: int, before: Callable[[], None] | None) -> bool:
        """Make the next weights the weights, if they cover the shard at ``alpha`` (the
        step's -lr / divisor now); False: the step must be taken as usual. ``before``:
        the driver's hook before the weights change (sends still reading them)."""
        if not (self.active and alpha == self.alpha and len(self.keys) == len(self.params)):
            return False
        if self.on_board:
            assert self.slot is not None
            done = self.slot.commit(version)
        elif self.slot is not None:  # the weights moved into a board since: leave them
            done = False
        else:
            if before is not None:
                before()  # a send still reading the weights gets them copied first
            self._swap()
            done = True
        self._reset()
        self.committed += done
        if done:
            self.misses = 0
            self.last_commit = version
        return done

    def _spare(self) -> dict[torch.dtype, torch.Tensor]:
        """The buffer a round with several contributors is stepped into (its sums
        are in the aggregation buffer); the weights' old storage after a commit."""
        if self.spare is None or any(self.spare[d].numel() != f.numel()
                                     for d, f in self.flats.items()):
            self.spare = {d: torch.empty_like(f) for d, f in self.flats.items()}
        return self.spare

    def not_alone(self) -> None:
        """Another worker is in the round: a lone push's step ahead (into the
        aggregation buffer, which now holds sums) is dropped, and none begins."""
        self.mixed = True
        if self.active and not self.shared:
            self.drop()

    def released(self, exclude: Collection[str], lend: bool = False
                 ) -> dict[str, torch.Tensor] | None:
        """The next weights of every key computed this round but ``exclude`` (those
        already handed to the asker), as :meth:`ready` gives them; None: none."""
        if not self.active:
            return None
        keys = [k for k in self.params if k in self.keys and k not in exclude]
        return self.ready(keys, lend) if keys else None

    def ready(self, keys: Collection[str], lend: bool = False
              ) -> dict[str, torch.Tensor] | None:
        """The next weights of ``keys``, if all of them were computed this round (None:
        not, or the round is not stepped ahead). They are the weights the round will
        make if it commits ahead; whoever takes them must learn at the close whether
        it did (:attr:`last_commit`). Copies, unless ``lend``: the round's worker is
        the only live one, so the next step needs its next push (see below)."""
        if not (self.active and keys) or not self.keys.issuperset(keys):
            return None
        if self.on_board or not lend:  # zmq never lends a board slot (it may be remapped)
            return {key: self._copy(key) for key in keys}
        # Lent as they are. Until the round closes only a round that is not this
        # worker's alone any more writes them, and it drops them (its answer then
        # carries all the weights). If the round commits, they become the weights,
        # and with no other live worker the next step that writes those comes only
        # after this worker's next push, sent once it holds all these answers (they
        # go out before the round's answer: one connection keeps its order).
        return {key: self.next[key] for key in keys}

    def _copy(self, key: str) -> torch.Tensor:
        """A copy of ``key``'s next weights, made once this round (every worker that
        asks gets the same one; nothing writes it again)."""
        copy = self.copies.get(key)
        if copy is None:
            copy = self.copies[key] = self.next[key].clone()
        return copy

    def _swap(self) -> None:
        """The weights' flat buffers and the buffer stepped into trade storage (the
        round's buffer, or for several contributors the spare one)."""
        agg = self.spare if self.shared else self.round.flat_buffer()
        assert agg is not None
        with torch.no_grad():
            for dtype, flat in self.flats.items():
                other = agg[dtype]
                mine = flat.data
                flat.data = other.data
                other.data = mine
                for key, start, numel in self.layout.groups[dtype]:
                    self.params[key].data = flat.data[start:start + numel]
                    if not self.shared:
                        self.round.agg[key].data = other.data[start:start + numel]

    def drop(self) -> None:
        """Forget what was computed this round (it stays dropped until the round ends)."""
        if self.active is False:
            return
        if self.active and self.on_board and self.slot is not None:
            self.slot.drop()
        self.active = False
        self.next = {}
        self.keys = set()
        self.copies = {}

    def end_round(self) -> None:
        """The round closed (stepped or not): the next one starts afresh."""
        self.rest = max(0, self.rest - 1)
        if self.active:
            self.drop()
        self._reset()
        self.mixed = False

    def _reset(self) -> None:
        self.active = None
        self.next = {}
        self.keys = set()
        self.copies = {}
        self.shared = False
