"""A shard's weight board: two seqlocked slots of its weights in shared memory,
read by same-host workers (paramserver/shm/link.py connects the two sides).

Each slot has a sequence number and a version, written seqlock-style (odd
while a slot is being written). A pull reply carries a ticket (slot,
sequence, version, layout); the worker copies the slot into its model and
checks the sequence afterwards, so a copy overlapped by a write is noticed
and redone from the newest slot (:func:`read_guarded`), and after
:data:`READ_ATTEMPTS` it pulls over TCP.

A board holds a random token in its header page, made with it and told only
to the workers it is granted to (the grant's ``token``): a worker maps a board
only if it holds that token (:meth:`Segment.attach` ``proof``), so a grant
cannot make it read some other job's or shard's board in its place.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.shm.segment import NONCE_BYTES, Segment, aligned, descs_to_tensors, layout
from paramserver.util.dtypes import copy_bytes
from paramserver.util.flat import FlatLayout
from paramserver.wire.protocol import DTYPES, Limits

__all__ = ["HEADER", "READ_ATTEMPTS", "TOKEN_AT", "BoardAhead", "BoardReader", "Ticket",
           "WeightBoard", "read_guarded"]

#: copies of a board slot tried before a pull falls back to TCP
READ_ATTEMPTS = 16
HEADER = 4096  # the board's header page: per slot a sequence number and a version
TOKEN_AT = 2048  # where in the header page the board's token lies (past the slots' words)


class BoardReader:
    """A worker's mapping of a shard's weight board."""

    def __init__(self, name: str, size: int, token: bytes | None = None) -> None:
        """Map board ``name`` if it holds ``token`` (the grant's); None only for a
        board this process made itself (tests), which proves nothing."""
        self.seg = Segment.attach(name, size, proof=None if token is None else (TOKEN_AT, token))
        self.slot_bytes = (self.seg.size - HEADER) // 2
        self.head = self.seg.data[:HEADER].view(torch.int64)

    def seq(self, slot: int) -> int:
        return int(self.head[8 + slot * 8])

    def version(self, slot: int) -> int:
        return int(self.head[9 + slot * 8])

    def current(self) -> int:
        return int(self.head[1])

    def tensors(self, slot: int, descs: Any, limits: Limits) -> dict[str, torch.Tensor]:
        base = HEADER + slot * self.slot_bytes
        return descs_to_tensors(self.seg, descs, limits, base, base + self.slot_bytes)

    def close(self) -> None:
        self.seg.close()


def read_guarded(board: BoardReader, ticket: Mapping[str, Any],
                 copy: Callable[[dict[str, torch.Tensor]], None],
                 limits: Limits, attempts: int = READ_ATTEMPTS) -> int | None:
    """Copy a published slot with ``copy``; the version copied, or None if every
    attempt was overlapped by a write (the caller then pulls over TCP).

    The ticket's slot is tried first while it still holds the ticket's sequence
    number; then the newest slot, whose version is at least the ticket's. A
    copy counts only if the slot's sequence number was even before and equal
    after it: the writer makes it odd while it writes.
    """
    slot, seq, version = int(ticket["slot"]), int(ticket["seq"]), int(ticket["version"])
    if slot not in (0, 1):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"board slot {slot!r}")
    descs = ticket["t"]
    for attempt in range(attempts):
        if attempt:
            slot = board.current()
            seq = board.seq(slot)
            if seq & 1 or board.version(slot) < version:
                continue
        elif board.seq(slot) != seq:
            continue
        got = board.version(slot)
        copy(board.tensors(slot, descs, limits))
        if board.seq(slot) == seq:
            return got
    return None


def _offset_in(p: torch.Tensor, flat: torch.Tensor) -> int:
    return int(p.storage_offset() - flat.storage_offset()) * p.element_size()


def _inside(p: torch.Tensor, flats: Mapping[torch.dtype, torch.Tensor]) -> bool:
    """Whether ``p`` is a contiguous view into its dtype's flat buffer."""
    flat = flats.get(p.dtype)
    return (flat is not None and p.is_contiguous()
            and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and p.storage_offset() - flat.storage_offset() >= 0
            and p.storage_offset() + p.numel() <= flat.storage_offset() + flat.numel())


class Ticket(TypedDict):
    """A pull's answer through the board (the reply's ``shm`` field): which slot holds
    the weights, its sequence when published, their version, their descriptors
    ([key, dtype, shape, offset]) and bytes."""

    slot: int
    seq: int
    version: int
    t: list[list[Any]]
    nbytes: int


class WeightBoard:
    """A shard's double-buffered, seqlocked copy of its weights for same-host pulls.

    With the shard's flat buffers and their layout (paramserver/util/flat.py), the
    weights *live* in a slot: the flat buffers are moved into it, so publishing
    copies nothing, and the shard holds no other copy of them. Every change of
    the weights is bracketed (:meth:`before_change`, :meth:`after_change`): the
    slot's sequence number is odd while it is written, so a reader copying it
    notices and retries. A sync shard changes its slot in place (every worker
    read the round's weights before it pushed); an asynchronous one, whose
    workers read while others push, first copies a slot handed out since its
    last change into the other slot and changes that one, so the handed-out
    version stays readable. Zero-copy TCP replies never lend a slot: the driver
    moves the weights out first (:meth:`ShmHub.before_tcp_reply`).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], tag: str,
                 flats: Mapping[torch.dtype, torch.Tensor] | None = None,
                 flat_layout: FlatLayout | None = None) -> None:
        # with the shard's flat buffers (params are views into them, paramserver/util/flat.py)
        # a slot holds each buffer whole, and publishing is one copy per dtype
        self.flats = dict(flats or {})
        self.flat_at: dict[torch.dtype, int] = {}
        if self.flats and all(_inside(p, self.flats) for p in params.values()):
            at = 0
            for dtype, flat in self.flats.items():
                self.flat_at[dtype] = at
                at += aligned(flat.numel() * flat.element_size())
            self.offsets = {k: self.flat_at[p.dtype] + _offset_in(p, self.flats[p.dtype])
                            for k, p in params.items()}
            self.slot_bytes = at
        else:
            self.flats = {}
            self.offsets, self.slot_bytes = layout(
                (k, p.numel() * p.element_size()) for k, p in params.items())
        self.seg = Segment.create(tag, HEADER + 2 * self.slot_bytes)
        self.head = self.seg.data[:HEADER].view(torch.int64)
        self.token = os.urandom(NONCE_BYTES)  # a grant's proof that the board is ours
        self.seg.put(TOKEN_AT, self.token)
        names = {v: k for k, v in DTYPES.items()}
        self.descs = [[k, names[p.dtype], list(p.shape), self.offsets[k]]
                      for k, p in params.items()]
        self.nbytes = sum(p.numel() * p.element_size() for p in params.values())
        self.ticket: Ticket | None = None  # the latest publication, while current
        self.published = 0
        # the weights live in a slot (None: they are copied into one per publication)
        self.layout = flat_layout if self.flats else None
        self.params = params
        self.open_slot: int | None = None  # the slot being changed (its sequence odd)
        self.ahead: int | None = None  # the slot the next weights are written into
        self.lent = False  # the weights' slot was handed out since it last changed
        # where each slot holds each dtype's buffer (asked on every change and reply)
        self._slot_ptrs = [{d: self._slot_flat(slot, d).data_ptr() for d in self.flats}
                           for slot in (0, 1)]
        if self.layout is not None:
            self._fill(0)
            self._adopt(0)

    # -- the slots

    def _slot_flat(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        flat = self.flats[dtype]
        return self.seg.region(HEADER + slot * self.slot_bytes + self.flat_at[dtype], dtype,
                               (flat.numel(),))

    def _fill(self, slot: int) -> None:
        """Copy the flat buffers into ``slot``."""
        with torch.no_grad():
            for dtype, flat in self.flats.items():
                if flat.numel():
                    copy_bytes(self._slot_flat(slot, dtype), flat)

    def _adopt(self, slot: int) -> None:
        """Move the flat buffers (and the slice views over them) into ``slot``, which
        holds their values: the tensor objects stay, as the optimizer holds them."""
        assert self.layout is not None
        with torch.no_grad():
            for dtype, flat in self.flats.items():
                flat.data = self._slot_flat(slot, dtype)
                for key, start, numel in self.layout.groups[dtype]:
                    self.params[key].data = flat.data[start:start + numel].view(
                        self.params[key].shape)

    def home(self) -> int | None:
        """The slot the weights live in, or None (they were moved out, or never in)."""
        if self.layout is None:
            return None
        for slot, ptrs in enumerate(self._slot_ptrs):
            if all(f.numel() == 0 or f.data_ptr() == ptrs[d] for d, f in self.flats.items()):
                return slot
        return None

    def _open(self, slot: int) -> None:
        self.head[8 + slot * 8] += 1  # odd: being written
        self.open_slot = slot

    def _close(self, slot: int, version: int) -> None:
        at = 8 + slot * 8
        self.head[at + 1] = version
        self.head[at] += 1  # even: complete
        self.head[1] = slot
        self.open_slot = None

    # -- changes and publications

    # -- the next weights, written ahead into the other slot (paramserver/core/ahead.py)

    def begin_ahead(self) -> dict[torch.dtype, torch.Tensor] | None:
        """Open the slot the weights do not live in, for the next weights to be written
        out of place; its flat buffers, or None (no layout, or a change under way)."""
        if self.layout is None or self.open_slot is not None or self.ahead is not None:
            return None
        home = self.home()
        slot = 1 - (home if home is not None else int(self.head[1]))
        self.head[8 + slot * 8] += 1  # odd: a reader of an older ticket for it retries
        self.ahead = slot
        return {d: self._slot_flat(slot, d) for d in self.flats}

    def commit_ahead(self, version: int) -> bool:
        """The weights move into the slot written ahead, complete at ``version``."""
        slot = self.ahead
        if slot is None:
            return False  # dropped by another change of the board
        self.ahead = None
        self._adopt(slot)
        self.open_slot = slot
        self._close(slot, version)
        self.lent = False
        self.ticket = None
        return True

    def drop_ahead(self) -> None:
        """Close the slot opened ahead unused: what it held is gone, so it is marked
        as holding no version, and its sequence is even again."""
        slot = self.ahead
        if slot is None:
            return
        self.ahead = None
        self.head[9 + slot * 8] = -1
        self.head[8 + slot * 8] += 1

    def before_change(self, in_place: bool) -> None:
        """The weights are about to change (a step, a seeding). Where they live in a
        slot, its seqlock is taken; ``in_place`` False and the slot handed out since
        its last change: they move to the other slot first, so it stays readable."""
        self.drop_ahead()
        self.ticket = None
        home = self.home()
        if home is None or self.open_slot == home:
            return
        if self.lent and not in_place:
            other = 1 - home
            self._open(other)
            self._fill(other)
            self._adopt(other)
        else:
            self._open(home)
        self.lent = False

    def after_change(self, version: int) -> None:
        """The change is done: the weights' slot is complete at ``version``."""
        if self.open_slot is not None and self.open_slot == self.home():
            self._close(self.open_slot, version)

    def moving_out(self, version: int) -> None:
        """The weights are about to leave the board (a zero-copy TCP reply): the slot
        they leave is complete at ``version`` and stays readable."""
        self.drop_ahead()
        home = self.home()
        if home is not None and self.open_slot == home:
            self._close(home, version)
        self.ticket = None

    def publish(self, params: Mapping[str, torch.Tensor], version: int) -> Ticket:
        """The ticket of a slot holding ``params`` at ``version``: the slot they live
        in, or one written now unless the latest publication is still current. The
        slot written is the one not published last, so the latest stays readable
        while it is written; with a layout the weights then live there."""
        if self.ticket is not None and self.ticket["version"] == version:
            return self.ticket
        self.drop_ahead()  # a publication mid-round: the round steps as usual
        home = self.home()
        if home is not None:
            if self.open_slot == home or int(self.head[9 + home * 8]) != version:
                if self.open_slot != home:
                    self._open(home)
                self._close(home, version)
            self.lent = True
            slot = home
        else:
            slot = 1 - int(self.head[1]) if self.published or self.layout else 0
            self._open(slot)
            base = HEADER + slot * self.slot_bytes
            with torch.no_grad():
                if self.flats:
                    self._fill(slot)
                for key, p in params.items() if not self.flats else ():
                    if p.numel():
                        copy_bytes(self.seg.region(base + self.offsets[key], p.dtype,
                                                   (p.numel(),)), p.reshape(-1))
            self._close(slot, version)
            if self.layout is not None:
                self._adopt(slot)  # the copy just made is the weights from now on
                self.lent = True
        self.published += 1
        at = 8 + slot * 8
        self.ticket = Ticket(slot=slot, seq=int(self.head[at]), version=version,
                             t=self.descs, nbytes=self.nbytes)
        return self.ticket

    def close(self) -> None:
        self.seg.close()


class BoardAhead:
    """A board as the place a round's next weights are written ahead (the
    :class:`~paramserver.core.ahead.AheadSlot` of a shard whose weights live in it)."""

    def __init__(self, board: WeightBoard) -> None:
        self.board = board

    def begin(self) -> dict[torch.dtype, torch.Tensor] | None:
        return self.board.begin_ahead()

    def commit(self, version: int) -> bool:
        return self.board.commit_ahead(version)

    def drop(self) -> None:
        self.board.drop_ahead()
