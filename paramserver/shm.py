"""Same-host shared memory: tensor payloads beside the ZeroMQ header, not in it.

A worker and a shard on one host (same hostname and kernel boot id, agreed at
HELLO) move tensors through files in ``/dev/shm`` that both map
(paramserver/segment.py):

* each worker channel owns a *gradient segment*, one fixed region per slice
  key of its shard; a PUSH or INIT writes its tensors there once and sends
  only the header, whose ``shm`` field lists ``[key, dtype, shape, offset]``.
  The shard wraps those regions as tensors and adds or applies them in place.
* each shard owns a *weight board* (paramserver/board.py): two seqlocked
  slots; its weights live in one, and a pull reply carries a ticket to it.

This module holds both ends of a connection: :class:`ShmLink` (a worker's
channel) and :class:`ShmHub` (a shard's peers and its board).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .board import READ_ATTEMPTS, BoardAhead, BoardReader, WeightBoard, read_guarded
from .dtypes import copy_bytes
from .errors import ErrorCode, ProtocolError
from .flat import FlatLayout
from .protocol import DTYPES, Limits, Message, Op
from .segment import (
    ALIGN,
    ENV,
    SHM_DIR,
    Segment,
    aligned,
    descs_to_tensors,
    enabled,
    host_identity,
    layout,
    sweep,
)

__all__ = [
    "ENV",
    "MIN_BYTES",
    "READ_ATTEMPTS",
    "SHM_DIR",
    "BoardReader",
    "GradSegment",
    "Segment",
    "ShmHub",
    "ShmLink",
    "WeightBoard",
    "enabled",
    "host_identity",
    "read_guarded",
    "sweep",
    "take_shm",
]

log = logging.getLogger(__name__)

#: a shard's share below this many bytes goes over TCP: a few KiB cost less to copy
#: through the socket than the segment's bookkeeping (measured: 1 KiB round trips
#: were 15% slower through shared memory)
MIN_BYTES = 64 * 1024
_RELEASE_BYTES = 1 << 20  # a shard unmaps a used run of a worker's segment from this size


# --------------------------------------------------------------------------- worker side


class GradSegment:
    """A worker channel's gradient segment: one region per slice key of its shard."""

    def __init__(self, slices: Iterable[tuple[str, int]], tag: str) -> None:
        slices = list(slices)
        self.offsets, size = layout(slices)
        # the bytes each region may hold (its key's slice in the parameter's dtype)
        self.room = {key: aligned(nbytes) for key, nbytes in slices}
        self.seg = Segment.create(tag, size)

    def write(self, tensors: Mapping[str, torch.Tensor]) -> list[list[Any]] | None:
        """Copy ``tensors`` into their regions; their descriptors, or None when one
        does not fit (a key not in the layout, a dtype it has no name for): that
        message then goes over TCP."""
        names = {v: k for k, v in DTYPES.items()}
        plan = []
        for key, t in tensors.items():
            offset = self.offsets.get(key)
            name = names.get(t.dtype)
            if offset is None or name is None or t.device.type != "cpu":
                return None
            if t.numel() * t.element_size() > self.room[key]:
                return None
            plan.append((key, name, t, offset))
        descs = []
        for key, name, t, offset in plan:
            if t.numel():
                copy_bytes(self.seg.region(offset, t.dtype, (t.numel(),)), t.detach())
            descs.append([key, name, list(t.shape), offset])
        return descs

    def close(self) -> None:
        self.seg.close()


class ShmLink:
    """A worker channel's side: its gradient segment, and the shard's board once
    the shard granted it (HELLO reply field ``shm``)."""

    def __init__(self, slices: Iterable[tuple[str, int]], tag: str) -> None:
        self.slices = list(slices)
        self.tag = tag
        self.grads: GradSegment | None = None
        self.board: BoardReader | None = None

    def offer(self) -> dict[str, Any] | None:
        """The HELLO field that offers our gradient segment (None: cannot make one)."""
        if self.grads is None:
            try:
                self.grads = GradSegment(self.slices, self.tag)
            except OSError as exc:
                log.info("no shared-memory segment (%s): this worker uses TCP", exc)
                return None
        return {"host": host_identity(), "seg": self.grads.seg.name,
                "size": self.grads.seg.size}

    def granted(self, grant: Any) -> None:
        """The shard's answer to the offer: its board, or None (TCP from now on)."""
        name = grant.get("board") if isinstance(grant, dict) else None
        if self.board is not None and self.board.seg.name == name:
            return
        if self.board is not None:
            self.board.close()
            self.board = None
        if name is None:
            return
        try:
            self.board = BoardReader(name, int(grant.get("size", 0)))
        except (OSError, ValueError) as exc:
            log.warning("cannot map the shard's weight board (%s): using TCP", exc)

    @property
    def active(self) -> bool:
        return self.board is not None and self.grads is not None

    def write(self, tensors: Mapping[str, torch.Tensor]) -> list[list[Any]] | None:
        return self.grads.write(tensors) if self.active and self.grads is not None else None

    def read(self, ticket: Any, copy: Callable[[dict[str, torch.Tensor]], None],
             limits: Limits) -> int | None:
        if self.board is None or not isinstance(ticket, dict):
            return None
        return read_guarded(self.board, ticket, copy, limits)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.grads is not None:
            self.grads.close()
            self.grads = None


# --------------------------------------------------------------------------- shard side


def take_shm(hub: ShmHub | None, msg: Message, identity: bytes) -> None:
    """A request's shared-memory fields on a shard (``hub`` None: it has none)."""
    if hub is not None:
        hub.take(msg, identity)
    elif "shm" in msg.fields:  # e.g. this shard restarted without shared memory
        raise ProtocolError(ErrorCode.NOT_REGISTERED, "this shard takes no tensors through "
                            "shared memory; say HELLO")


def _is_local(peer: str, address: str) -> bool:
    """Whether a connection from ``peer`` (zmq's Peer-Address) to a shard bound at
    ``address`` comes from this host: ipc, loopback, or the shard's own address."""
    if address.startswith("ipc://"):
        return True
    return peer == "::1" or peer.startswith("127.") or (bool(peer) and f"//{peer}:" in address)


class _Peer:
    def __init__(self, worker: int, seg: Segment) -> None:
        self.worker = worker
        self.seg = seg


class ShmHub:
    """A shard server's shared-memory peers (by ZeroMQ routing id) and its board."""

    def __init__(self, shard: int, limits: Limits) -> None:
        self.shard = shard
        self.limits = limits
        self.host = host_identity()
        self.peers: dict[bytes, _Peer] = {}
        self.board: WeightBoard | None = None
        self.pulls: dict[bytes, int] = {}  # routing id -> seq of a pull to answer via shm

    def hello(self, identity: bytes, worker: int, offer: Any, local: bool, trusted: bool,
              params: Mapping[str, torch.Tensor],
              flats: Mapping[torch.dtype, torch.Tensor] | None = None,
              flat_layout: FlatLayout | None = None) -> dict[str, Any] | None:
        """Take a worker's offer (HELLO field ``shm``) if it is on this host, local and
        trusted; the grant for the reply, or None (that worker then uses TCP). With
        ``flats`` and their ``flat_layout`` the weights move into the board."""
        self.drop(identity)
        if not (isinstance(offer, dict) and local and trusted and enabled()):
            return None
        if offer.get("host") != self.host:
            return None
        size = offer.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return None
        try:
            seg = Segment.attach(str(offer.get("seg")), size)
            if self.board is None:
                self.board = WeightBoard(params, f"board{self.shard}", flats, flat_layout)
        except (OSError, ValueError) as exc:
            log.info("shard %d: worker %d stays on TCP: %s", self.shard, worker, exc)
            return None
        for other in [i for i, p in self.peers.items() if p.worker == worker]:
            self.drop(other)  # the worker's earlier connection
        self.peers[identity] = _Peer(worker, seg)
        return {"board": self.board.seg.name, "size": self.board.seg.size}

    def resolve(self, identity: bytes, fields: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors a message's ``shm`` descriptors name in its sender's segment."""
        peer = self.peers.get(identity)
        if peer is None:
            raise ProtocolError(ErrorCode.NOT_REGISTERED, "no shared-memory segment for this "
                                "connection; say HELLO")
        return descs_to_tensors(peer.seg, fields["shm"], self.limits)

    def answer_hello(self, identity: bytes, msg: Message, frame: Any, address: str,
                     answer: Message, grants: Mapping[str, Any] | None, key: str | None,
                     core: Any) -> bool:
        """Grant a worker's HELLO offer in ``answer`` (True), or leave it on TCP: only
        a peer connected from this host and, under CURVE (``grants`` not None), with
        a key on the allow-list gets a segment."""
        if msg["role"] != "worker":
            return False
        try:
            peer = str(frame.get("Peer-Address"))
        except Exception:  # zmq raises for a property the transport lacks
            peer = ""
        trusted = grants is None or (key is not None and key in grants)
        grant = self.hello(identity, msg["worker"], msg.get("shm"), _is_local(peer, address),
                           trusted, core.params, core.flats, core.layout)
        if grant is not None:
            answer.fields["shm"] = grant
            slot = core.ahead.slot
            if self.board is not None and self.board.layout is not None and not (
                    isinstance(slot, BoardAhead) and slot.board is self.board):
                core.ahead.slot = BoardAhead(self.board)  # the next weights go there
        return grant is not None

    def take(self, msg: Message, identity: bytes) -> None:
        """A request's shared-memory fields: its tensors from the sender's segment
        (PUSH, INIT), and whether its answer goes through the board (PULL, PUSH)."""
        if msg.op in (Op.PUSH, Op.INIT) and "shm" in msg.fields:
            if msg.tensors:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "tensors both in frames and in "
                                    "shared memory")
            msg.tensors = self.resolve(identity, msg.fields)
        if msg.op in (Op.PUSH, Op.PULL) and msg.get("via_shm") is True:
            self.wants(identity, msg.seq)

    def release(self, identity: bytes, tensors: Mapping[str, torch.Tensor]) -> None:
        """A message's tensors in its sender's segment were used: unmap their pages
        from this process. The data stays (the pages are the worker's, in tmpfs, and
        a later read maps them again), but the shard's resident set no longer grows
        by each same-host worker's whole gradient (``--shm-release``)."""
        peer = self.peers.get(identity)
        if peer is None or not tensors or not peer.seg.size:
            return
        base = peer.seg.data.data_ptr()
        spans = sorted((t.data_ptr() - base, t.data_ptr() - base + t.numel() * t.element_size())
                       for t in tensors.values())
        merged: list[list[int]] = []
        for lo, hi in spans:  # regions are packed (cache-line gaps): one call per run
            if merged and lo <= merged[-1][1] + ALIGN:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            lo = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the run only
            hi = min(hi, peer.seg.size) // mmap.PAGESIZE * mmap.PAGESIZE
            if hi - lo >= _RELEASE_BYTES:
                peer.seg.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def wants(self, identity: bytes, seq: int) -> None:
        """A pull (or push + pull) that asked to be answered through the board."""
        if identity in self.peers:
            self.pulls[identity] = seq

    def ticket(self, identity: bytes, seq: int, params: Mapping[str, torch.Tensor],
               version: int) -> dict[str, Any] | None:
        """The board ticket answering ``(identity, seq)``, or None to answer over TCP."""
        if self.pulls.get(identity) != seq or self.board is None:
            return None
        del self.pulls[identity]
        return self.board.publish(params, version)

    def before_change(self, in_place: bool) -> None:
        """The weights are about to change (:meth:`WeightBoard.before_change`)."""
        if self.board is not None:
            self.board.before_change(in_place)

    def after_change(self, version: int) -> None:
        if self.board is not None:
            self.board.after_change(version)

    def before_tcp_reply(self, core: Any) -> None:
        """A reply over TCP is about to lend ``core``'s weights to ZeroMQ: if they live
        in the board, they move out to memory of their own first (copy-on-write), so
        that a slot is never written while a send may still read it."""
        if self.board is not None and self.board.home() is not None:
            self.board.moving_out(core.version)
            core.copy_on_write()

    def drop(self, identity: bytes) -> None:
        peer = self.peers.pop(identity, None)
        self.pulls.pop(identity, None)
        if peer is not None:
            peer.seg.close()

    def forget(self, known: Iterable[int]) -> None:
        """Unmap the segments of workers gone from the table (the server sweeps
        the files of dead processes, :func:`sweep`)."""
        known = set(known)
        gone = [i for i, p in self.peers.items() if p.worker not in known]
        for identity in gone:
            self.drop(identity)

    def close(self) -> None:
        for identity in list(self.peers):
            self.drop(identity)
        if self.board is not None:
            self.board.close()
            self.board = None
