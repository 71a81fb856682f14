"""Same-host shared memory: tensor payloads beside the ZeroMQ header, not in it.

A worker and a shard on one host (same hostname and kernel boot id, agreed at
HELLO) move tensors through files in ``/dev/shm`` that both map:

* each worker channel owns a *gradient segment*, one fixed region per slice
  key of its shard; a PUSH or INIT writes its tensors there once and sends
  only the header, whose ``shm`` field lists ``[key, dtype, shape, offset]``.
  The shard wraps those regions as tensors and adds or applies them in place.
* each shard owns a *weight board*: two slots, each with a sequence number
  and a version, written seqlock-style (odd while a slot is being written).
  A pull reply carries a ticket (slot, sequence, version, layout); the worker
  copies the slot into its model and checks the sequence afterwards, so a copy
  overlapped by a write is noticed and redone from the newest slot
  (:func:`read_guarded`), and after :data:`READ_ATTEMPTS` it pulls over TCP.

Files, not ``multiprocessing.shared_memory``: on Python 3.11 its resource
tracker unlinks a segment when *any* process that attached it exits, and it
neither refuses symlinks nor checks the owner and mode of what it attaches.
A file opened with ``O_NOFOLLOW``, created ``0600`` with ``O_EXCL`` and checked
with ``fstat`` on attach is the same kernel object (tmpfs) with those checks.

Names carry the owner's uid, pid and the pid's start time, so a sweep
(:func:`sweep`, at a process's first segment and at exit, and on a shard when
a worker dies) removes the segments of processes that are gone, SIGKILL
included. ``PARAMSERVER_SHM`` switches the path: ``auto`` (default: on where a
plain store is ordered, x86-64 Linux with /dev/shm), ``1`` (on wherever Linux
has /dev/shm) or ``0`` (off: every byte over TCP, as across hosts).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import mmap
import os
import platform
import re
import socket
import stat
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .dtypes import copy_bytes
from .errors import ErrorCode, ProtocolError
from .flat import FlatLayout
from .protocol import DTYPES, Limits, Message, Op, _check_desc

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

#: the switch: auto | 1 | 0 (read by every process at its first use)
ENV = "PARAMSERVER_SHM"
SHM_DIR = Path("/dev/shm")
#: copies of a board slot tried before a pull falls back to TCP
READ_ATTEMPTS = 16
#: a shard's share below this many bytes goes over TCP: a few KiB cost less to copy
#: through the socket than the segment's bookkeeping (measured: 1 KiB round trips
#: were 15% slower through shared memory)
MIN_BYTES = 64 * 1024
_ALIGN = 64  # each region starts on a cache line (and any dtype's alignment)
_HEADER = 4096  # the board's header page: per slot a sequence number and a version
_RELEASE_BYTES = 1 << 20  # a shard unmaps a used run of a worker's segment from this size
_PREFIX = "paramserver-shm"
_NAME = re.compile(rf"^{_PREFIX}\.(\d+)\.(\d+)\.(\d+)\.[0-9a-f]+\.[a-z0-9]+$")
_RUN = uuid.uuid4().hex[:12]  # this process's run token, in each of its segment names
_OWN: set[Path] = set()  # segments this process created (unlinked at exit)
_LOCK = threading.Lock()
_SWEPT = False


def enabled() -> bool:
    """Whether this process may use shared memory (``PARAMSERVER_SHM``)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if sys.platform != "linux" or not SHM_DIR.is_dir():
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    # auto: the seqlock needs stores seen in program order, which x86-64 gives
    # plain Python/torch stores; elsewhere it would need fences we cannot issue
    return platform.machine() in ("x86_64", "AMD64")


def host_identity() -> str:
    """Hostname and kernel boot id: equal only for processes on one running host."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks (None: no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # the command name may hold spaces and parentheses: split after the last ")"
        return int(text[text.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _owner_alive(pid: int, start: int) -> bool:
    return _start_time(pid) == start


def sweep(directory: Path = SHM_DIR) -> list[str]:
    """Unlink this user's segments whose owning process is gone; return their names."""
    removed: list[str] = []
    uid = os.geteuid()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if m is None or int(m.group(1)) != uid:
            continue
        if _owner_alive(int(m.group(2)), int(m.group(3))):
            continue
        try:
            os.unlink(directory / name)
            removed.append(name)
        except OSError:
            continue
    if removed:
        log.info("removed %d shared-memory segment(s) of exited processes", len(removed))
    return removed


def _unlink_own() -> None:
    with _LOCK:
        for path in list(_OWN):
            with contextlib.suppress(OSError):
                path.unlink()
            _OWN.discard(path)
    sweep()


class Segment:
    """One mapped ``/dev/shm`` file; ``data`` is its bytes as a uint8 tensor."""

    def __init__(self, path: Path, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.name = path.name
        self.mm = mm
        self.size = len(mm)
        self.owner = owner
        self.data = torch.frombuffer(mm, dtype=torch.uint8) if self.size else torch.empty(0)

    @classmethod
    def create(cls, tag: str, size: int, directory: Path = SHM_DIR) -> Segment:
        """A new segment of ``size`` bytes, mode 0600, unlinked when this process exits."""
        global _SWEPT
        if not _SWEPT:
            _SWEPT = True
            sweep(directory)  # the leftovers of killed processes, before adding ours
            atexit.register(_unlink_own)
        pid = os.getpid()
        name = f"{_PREFIX}.{os.geteuid()}.{pid}.{_start_time(pid) or 0}.{_RUN}.{tag}"
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, max(size, 1))
            mm = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        with _LOCK:
            _OWN.add(path)
        return cls(path, mm, owner=True)

    @classmethod
    def attach(cls, name: str, min_size: int, directory: Path = SHM_DIR) -> Segment:
        """Map a peer's segment: a regular file of ours, 0600, at least ``min_size``."""
        if not isinstance(name, str) or _NAME.match(name) is None:
            raise OSError(f"not a segment name: {name!r}")
        fd = os.open(directory / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(f"{name}: not a regular file of this user")
            if st.st_mode & 0o077:
                raise OSError(f"{name}: mode {st.st_mode & 0o777:o}, not 0600")
            if st.st_size < max(min_size, 1):
                raise OSError(f"{name}: {st.st_size} bytes, need {min_size}")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(directory / name, mm, owner=False)

    def region(self, offset: int, dtype: torch.dtype, shape: Iterable[int]) -> torch.Tensor:
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        return self.data[offset:offset + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Unmap (when no tensor still views it) and, as the owner, unlink."""
        if self.owner:
            with _LOCK:
                _OWN.discard(self.path)
            self.path.unlink(missing_ok=True)
        self.data = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):  # a tensor still views it: unmapped later
            self.mm.close()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout(slices: Iterable[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """(key -> offset, total bytes) for regions of ``(key, nbytes)``, cache-line aligned."""
    offsets: dict[str, int] = {}
    total = 0
    for key, nbytes in slices:
        offsets[key] = total
        total += _aligned(nbytes)
    return offsets, total


def _descs_to_tensors(seg: Segment, descs: Any, limits: Limits, base: int = 0,
                      end: int | None = None) -> dict[str, torch.Tensor]:
    """Tensors over ``seg`` from ``[key, dtype, shape, offset]`` descriptors, each
    checked as the wire decoder checks frames, and inside ``[base, end)``."""
    end = seg.size if end is None else end
    if not isinstance(descs, list) or len(descs) > limits.max_tensors:
        raise ProtocolError(ErrorCode.BAD_HEADER, "'shm' must list at most max_tensors entries")
    tensors: dict[str, torch.Tensor] = {}
    total = 0
    for desc in descs:
        if not isinstance(desc, list) or len(desc) != 4:
            raise ProtocolError(ErrorCode.BAD_TENSOR, "shm descriptor: [key, dtype, shape, offset]")
        key, dtype, shape = _check_desc(desc[:3], limits)
        offset = desc[3]
        if key in tensors:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor key {key!r} appears twice")
        nbytes = math.prod(shape) * dtype.itemsize
        if (isinstance(offset, bool) or not isinstance(offset, int) or offset < 0
                or offset % dtype.itemsize or base + offset + nbytes > end):
            raise ProtocolError(ErrorCode.BAD_TENSOR,
                                f"{key!r}: offset {offset!r} is outside the shared segment")
        if nbytes > limits.max_tensor_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{key!r}: {nbytes} bytes over the limit")
        total += nbytes
        if total > limits.max_total_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, "message over the total size limit")
        tensors[key] = seg.region(base + offset, dtype, shape)
    return tensors


# --------------------------------------------------------------------------- worker side


class GradSegment:
    """A worker channel's gradient segment: one region per slice key of its shard."""

    def __init__(self, slices: Iterable[tuple[str, int]], tag: str) -> None:
        slices = list(slices)
        self.offsets, size = layout(slices)
        # the bytes each region may hold (its key's slice in the parameter's dtype)
        self.room = {key: _aligned(nbytes) for key, nbytes in slices}
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


class BoardReader:
    """A worker's mapping of a shard's weight board."""

    def __init__(self, name: str, size: int) -> None:
        self.seg = Segment.attach(name, size)
        self.slot_bytes = (self.seg.size - _HEADER) // 2
        self.head = self.seg.data[:_HEADER].view(torch.int64)

    def seq(self, slot: int) -> int:
        return int(self.head[8 + slot * 8])

    def version(self, slot: int) -> int:
        return int(self.head[9 + slot * 8])

    def current(self) -> int:
        return int(self.head[1])

    def tensors(self, slot: int, descs: Any, limits: Limits) -> dict[str, torch.Tensor]:
        base = _HEADER + slot * self.slot_bytes
        return _descs_to_tensors(self.seg, descs, limits, base, base + self.slot_bytes)

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


def _offset_in(p: torch.Tensor, flat: torch.Tensor) -> int:
    return int(p.storage_offset() - flat.storage_offset()) * p.element_size()


def _inside(p: torch.Tensor, flats: Mapping[torch.dtype, torch.Tensor]) -> bool:
    """Whether ``p`` is a contiguous view into its dtype's flat buffer."""
    flat = flats.get(p.dtype)
    return (flat is not None and p.is_contiguous()
            and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and p.storage_offset() - flat.storage_offset() >= 0
            and p.storage_offset() + p.numel() <= flat.storage_offset() + flat.numel())


class WeightBoard:
    """A shard's double-buffered, seqlocked copy of its weights for same-host pulls.

    With the shard's flat buffers and their layout (paramserver/flat.py), the
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
        # with the shard's flat buffers (params are views into them, paramserver/flat.py)
        # a slot holds each buffer whole, and publishing is one copy per dtype
        self.flats = dict(flats or {})
        self.flat_at: dict[torch.dtype, int] = {}
        if self.flats and all(_inside(p, self.flats) for p in params.values()):
            at = 0
            for dtype, flat in self.flats.items():
                self.flat_at[dtype] = at
                at += _aligned(flat.numel() * flat.element_size())
            self.offsets = {k: self.flat_at[p.dtype] + _offset_in(p, self.flats[p.dtype])
                            for k, p in params.items()}
            self.slot_bytes = at
        else:
            self.flats = {}
            self.offsets, self.slot_bytes = layout(
                (k, p.numel() * p.element_size()) for k, p in params.items())
        self.seg = Segment.create(tag, _HEADER + 2 * self.slot_bytes)
        self.head = self.seg.data[:_HEADER].view(torch.int64)
        names = {v: k for k, v in DTYPES.items()}
        self.descs = [[k, names[p.dtype], list(p.shape), self.offsets[k]]
                      for k, p in params.items()]
        self.nbytes = sum(p.numel() * p.element_size() for p in params.values())
        self.ticket: dict[str, Any] | None = None  # the latest publication, while current
        self.published = 0
        # the weights live in a slot (None: they are copied into one per publication)
        self.layout = flat_layout if self.flats else None
        self.params = params
        self.open_slot: int | None = None  # the slot being changed (its sequence odd)
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
        return self.seg.region(_HEADER + slot * self.slot_bytes + self.flat_at[dtype], dtype,
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

    def before_change(self, in_place: bool) -> None:
        """The weights are about to change (a step, a seeding). Where they live in a
        slot, its seqlock is taken; ``in_place`` False and the slot handed out since
        its last change: they move to the other slot first, so it stays readable."""
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
        home = self.home()
        if home is not None and self.open_slot == home:
            self._close(home, version)
        self.ticket = None

    def stale(self) -> None:
        """The weights are about to change: the next pull publishes them again."""
        self.ticket = None

    def publish(self, params: Mapping[str, torch.Tensor], version: int) -> dict[str, Any]:
        """The ticket of a slot holding ``params`` at ``version``: the slot they live
        in, or one written now unless the latest publication is still current. The
        slot written is the one not published last, so the latest stays readable
        while it is written; with a layout the weights then live there."""
        if self.ticket is not None and self.ticket["version"] == version:
            return self.ticket
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
            base = _HEADER + slot * self.slot_bytes
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
        self.ticket = {"slot": slot, "seq": int(self.head[at]), "version": version,
                       "t": self.descs, "nbytes": self.nbytes}
        return self.ticket

    def close(self) -> None:
        self.seg.close()


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
        return _descs_to_tensors(peer.seg, fields["shm"], self.limits)

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
            if merged and lo <= merged[-1][1] + _ALIGN:
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
