"""Same-host shared memory: tensor payloads beside the ZeroMQ header, not in it.

A worker and a shard on one host (same hostname and kernel boot id, agreed at
HELLO) move tensors through files in ``/dev/shm`` that both map
(paramserver/shm/segment.py):

* each worker channel owns a *gradient segment*, one fixed region per slice
  key of its shard; a PUSH or INIT writes its tensors there once and sends
  only the header, whose ``shm`` field lists ``[key, dtype, shape, offset]``.
  The shard wraps those regions as tensors and adds or applies them in place.
* each shard owns a *weight board* (paramserver/shm/board.py): two seqlocked
  slots; its weights live in one, and a pull reply carries a ticket to it.

A segment's name is no proof of holding it (anyone on the host can list
``/dev/shm``, and one user's jobs pass each other's owner checks), so HELLO
takes two rounds: the shard answers an offer with a fresh nonce (``prove``),
the worker writes it into its segment's first bytes and says HELLO again
(``proved``), and only then does the shard map the segment (read through the
file it opened, :meth:`Segment.attach` ``proof``) and grant its board, with
the board's token for the worker to check in turn. A failed proof is refused
(FORBIDDEN) and nothing of that segment is mapped; pushes naming tensors in a
segment, and pulls asking for the board, count only from a proven connection.

This module holds both ends of a connection: :class:`ShmLink` (a worker's
channel) and :class:`ShmHub` (a shard's peers and its board).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec
import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.shm.board import (
    READ_ATTEMPTS,
    BoardAhead,
    BoardReader,
    Ticket,
    WeightBoard,
    read_guarded,
)
from paramserver.shm.segment import (
    ALIGN,
    ENV,
    NONCE_BYTES,
    SHM_DIR,
    ProofError,
    Segment,
    aligned,
    descs_to_tensors,
    enabled,
    host_identity,
    layout,
    sweep,
    valid_name,
)
from paramserver.util.dtypes import copy_bytes
from paramserver.util.flat import FlatLayout
from paramserver.wire.messages import Hello, Init, Pull, Push, ShmGrant, ShmOffer
from paramserver.wire.protocol import DTYPES, Limits, Message

__all__ = [
    "ENV",
    "MIN_BYTES",
    "PROOF_AT",
    "READ_ATTEMPTS",
    "SHM_DIR",
    "BoardReader",
    "GradSegment",
    "ProofError",
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
#: a gradient segment's first cache line holds the shard's HELLO nonce, written back
PROOF_AT = 0
_MAX_PENDING = 1024  # challenged connections awaiting their proof (the oldest go first)


def _nonce(value: Any) -> bytes | None:
    """A nonce or token sent as hex, or None when it is not one."""
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


# --------------------------------------------------------------------------- worker side


class GradSegment:
    """A worker channel's gradient segment: one region per slice key of its shard."""

    def __init__(self, slices: Iterable[tuple[str, int]], tag: str) -> None:
        slices = list(slices)
        offsets, size = layout(slices)  # after the proof's cache line (PROOF_AT)
        self.offsets = {key: ALIGN + at for key, at in offsets.items()}
        size += ALIGN
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
        # the shard's nonce is in our segment: the next HELLO says so (``proved``)
        self.proving = False

    def offer(self) -> ShmOffer | None:
        """The HELLO field that offers our gradient segment (None: cannot make one)."""
        if self.grads is None:
            try:
                self.grads = GradSegment(self.slices, self.tag)
            except OSError as exc:
                log.info("no shared-memory segment (%s): this worker uses TCP", exc)
                return None
        return ShmOffer(host_identity(), self.grads.seg.name, self.grads.seg.size,
                        proved=self.proving)

    def granted(self, grant: Any) -> None:
        """The shard's answer to the offer: a challenge (its nonce, written into our
        segment for the next HELLO to prove we hold it), its board and the board's
        token, or None (TCP from now on)."""
        answer = ShmGrant.of(grant)
        name = answer.board
        if self.board is not None and self.board.seg.name == name:
            self.proving = False
            return  # a proof HELLO repeated: the same board
        if self.board is not None:
            self.board.close()
            self.board = None
        nonce = _nonce(answer.prove)
        self.proving = nonce is not None and self.grads is not None
        if self.proving and self.grads is not None and nonce is not None:
            self.grads.seg.put(PROOF_AT, nonce)
            return
        if name is None:
            return
        token = _nonce(answer.token)
        if token is None:
            log.warning("the shard's board grant has no token to check it by: using TCP")
            return
        try:
            self.board = BoardReader(name, answer.size, token)
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


def lends(body: Any) -> bool:
    """Whether a request's tensors lie in its sender's segment (PUSH, INIT)."""
    return isinstance(body, (Push, Init)) and body.shm is not None


def asks_board(body: Any) -> bool:
    """Whether a request asks for its answer through the weight board (PULL, PUSH)."""
    return isinstance(body, (Pull, Push)) and body.via_shm is True


def take_shm(hub: ShmHub | None, msg: Message, identity: bytes) -> None:
    """A request's shared-memory fields on a shard (``hub`` None: it has none)."""
    if hub is not None:
        hub.take(msg, identity)
    elif lends(msg.body):  # e.g. this shard restarted without shared memory
        raise ProtocolError(ErrorCode.NOT_REGISTERED, "this shard takes no tensors through "
                            "shared memory; say HELLO")


def _is_local(peer: str, address: str) -> bool:
    """Whether a connection from ``peer`` (zmq's Peer-Address) to a shard bound at
    ``address`` comes from this host: ipc, loopback, or the shard's own address."""
    if address.startswith("ipc://"):
        return True
    return peer == "::1" or peer.startswith("127.") or (bool(peer) and f"//{peer}:" in address)


class _Peer:
    """A proven connection: its worker, its segment, and the nonce it wrote there."""

    def __init__(self, worker: int, seg: Segment, nonce: bytes = b"") -> None:
        self.worker = worker
        self.seg = seg
        self.nonce = nonce


class _Pending:
    """A challenged offer: the segment named, and the nonce it must come to hold."""

    def __init__(self, worker: int, name: str, size: int) -> None:
        self.worker = worker
        self.name = name
        self.size = size
        self.nonce = os.urandom(NONCE_BYTES)

    def same(self, worker: int, name: str, size: int) -> bool:
        return (self.worker, self.name, self.size) == (worker, name, size)


class ShmHub:
    """A shard server's shared-memory peers (by ZeroMQ routing id) and its board."""

    def __init__(self, shard: int, limits: Limits) -> None:
        self.shard = shard
        self.limits = limits
        self.host = host_identity()
        self.peers: dict[bytes, _Peer] = {}  # proven connections only
        self.pending: dict[bytes, _Pending] = {}  # challenged, not proven yet
        self.board: WeightBoard | None = None
        self.pulls: dict[bytes, int] = {}  # routing id -> seq of a pull to answer via shm

    def hello(self, identity: bytes, worker: int, offer: Any, local: bool, trusted: bool,
              params: Mapping[str, torch.Tensor],
              flats: Mapping[torch.dtype, torch.Tensor] | None = None,
              flat_layout: FlatLayout | None = None) -> ShmGrant | None:
        """Take a worker's offer (HELLO field ``shm``) if it is on this host, local and
        trusted; the field for the reply, or None (that worker then uses TCP).

        An offer is first answered with a challenge (``prove``: a nonce, the same
        for a repeated offer); an offer that says it wrote it (``proved``) is
        granted the board if the segment it names holds that nonce, read from the
        opened file before it is mapped. A proof that fails raises FORBIDDEN and
        leaves the segment unmapped. With ``flats`` and their ``flat_layout`` the
        weights move into the board."""
        offered = ShmOffer.of(offer)
        if not (offered is not None and local and trusted and enabled()):
            self.drop(identity)
            return None
        size, name = offered.size, offered.seg
        if offered.host != self.host or not valid_name(name):
            self.drop(identity)
            return None
        peer = self.peers.get(identity)
        if (offered.proved and peer is not None and self.board is not None
                and (peer.worker, peer.seg.name) == (worker, name)
                and peer.seg.holds(PROOF_AT, peer.nonce)):
            return self._grant()  # a proof repeated (its answer was lost): granted again
        self.drop(identity)
        pending = self.pending.pop(identity, None)
        if not offered.proved or pending is None or not pending.same(
                worker, name, size):
            if pending is None or not pending.same(worker, name, size):
                pending = _Pending(worker, name, size)
            self.pending[identity] = pending  # (re)inserted last: the oldest go first
            while len(self.pending) > _MAX_PENDING:
                del self.pending[next(iter(self.pending))]
            return ShmGrant(prove=pending.nonce.hex())
        try:
            seg = Segment.attach(name, size, proof=(PROOF_AT, pending.nonce))
        except ProofError as exc:
            log.warning("shard %d: refused worker %d's shared-memory segment: %s",
                        self.shard, worker, exc)
            raise ProtocolError(ErrorCode.FORBIDDEN, f"shared-memory segment {name}: the "
                                "ownership proof failed (it does not hold this shard's nonce)"
                                ) from exc
        except (OSError, ValueError) as exc:
            log.info("shard %d: worker %d stays on TCP: %s", self.shard, worker, exc)
            return None
        try:
            if self.board is None:
                self.board = WeightBoard(params, f"board{self.shard}", flats, flat_layout)
        except (OSError, ValueError) as exc:
            seg.close()
            log.info("shard %d: worker %d stays on TCP: %s", self.shard, worker, exc)
            return None
        for other in [i for i, p in self.peers.items() if p.worker == worker]:
            self.drop(other)  # the worker's earlier connection
        self.peers[identity] = _Peer(worker, seg, pending.nonce)
        return self._grant()

    def _grant(self) -> ShmGrant:
        assert self.board is not None
        return ShmGrant(self.board.seg.name, self.board.seg.size, self.board.token.hex())

    def resolve(self, identity: bytes, descs: list[Any]) -> dict[str, torch.Tensor]:
        """The tensors a message's ``shm`` descriptors name in its sender's segment."""
        peer = self.peers.get(identity)
        if peer is None:
            raise ProtocolError(ErrorCode.NOT_REGISTERED, "no shared-memory segment for this "
                                "connection; say HELLO")
        return descs_to_tensors(peer.seg, descs, self.limits)

    def answer_hello(self, identity: bytes, msg: Message, frame: Any, address: str,
                     answer: Message, grants: Mapping[str, Any] | None, key: str | None,
                     core: Any) -> bool:
        """Grant a worker's HELLO offer in ``answer`` (True), or leave it on TCP: only
        a peer connected from this host and, under CURVE (``grants`` not None), with
        a key on the allow-list gets a segment."""
        hello: Hello = msg.body
        if hello.role != "worker":
            return False
        try:
            peer = str(frame.get("Peer-Address"))
        except Exception:  # zmq raises for a property the transport lacks
            peer = ""
        trusted = grants is None or (key is not None and key in grants)
        grant = self.hello(identity, hello.worker, hello.shm, _is_local(peer, address),
                           trusted, core.params, core.flats, core.layout)
        if grant is not None:
            # a challenge, or the board (an outgoing field: the set fields only)
            answer.fields.update(shm=msgspec.to_builtins(grant))
        if grant is None or grant.board is None:
            return False
        slot = core.ahead.slot
        if self.board is not None and self.board.layout is not None and not (
                isinstance(slot, BoardAhead) and slot.board is self.board):
            core.ahead.slot = BoardAhead(self.board)  # the next weights go there
        return True

    def take(self, msg: Message, identity: bytes) -> None:
        """A request's shared-memory fields: its tensors from the sender's segment
        (PUSH, INIT), and whether its answer goes through the board (PULL, PUSH)."""
        body = msg.body
        if lends(body):
            if msg.tensors:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, "tensors both in frames and in "
                                    "shared memory")
            msg.tensors = self.resolve(identity, body.shm)
        if asks_board(body):
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
               version: int) -> Ticket | None:
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
        for identity in [i for i, p in self.pending.items() if p.worker not in known]:
            del self.pending[identity]

    def close(self) -> None:
        self.pending.clear()
        for identity in list(self.peers):
            self.drop(identity)
        if self.board is not None:
            self.board.close()
            self.board = None
