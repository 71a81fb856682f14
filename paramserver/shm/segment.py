"""Shared-memory segments: files in ``/dev/shm`` that a worker and a shard on one
host both map (the pieces under paramserver/shm/link.py and paramserver/shm/board.py).

Files, not ``multiprocessing.shared_memory``: on Python 3.11 its resource
tracker unlinks a segment when *any* process that attached it exits, and it
neither refuses symlinks nor checks the owner and mode of what it attaches.
A file opened with ``O_NOFOLLOW``, created ``0600`` with ``O_EXCL`` and checked
with ``fstat`` on attach is the same kernel object (tmpfs) with those checks.

A peer's *name* for a segment proves nothing: every process on the host can
list ``/dev/shm``, and one user's jobs all pass the owner and mode checks. So
a segment named by a peer is attached only with a *proof* (:meth:`Segment.attach`
``proof``): bytes that whoever made the segment wrote into it at an agreed
offset, read with ``pread`` on the opened file before it is mapped; a mismatch
maps nothing (:class:`ProofError`). A shard challenges each worker with a fresh
nonce (paramserver/shm/link.py); a worker checks the token a board was made with.

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
import hmac
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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from paramserver.errors import ErrorCode, ParamServerError, ProtocolError
from paramserver.wire.frames import Limits, check_desc

__all__ = ["ALIGN", "ENV", "NONCE_BYTES", "SHM_DIR", "ProofError", "Segment", "aligned",
           "descs_to_tensors", "enabled", "host_identity", "layout", "sweep", "valid_name"]

log = logging.getLogger(__name__)

#: the switch: auto | 1 | 0 (read by every process at its first use)
ENV = "PARAMSERVER_SHM"
SHM_DIR = Path("/dev/shm")
ALIGN = 64  # each region starts on a cache line (and any dtype's alignment)
NONCE_BYTES = 16  # an ownership proof: 128 random bits (guessing one is hopeless)
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


class ProofError(ParamServerError, OSError):
    """A segment did not hold the proof its namer had to write into it: it was not
    made (or is not held) by that peer, and was neither mapped nor read further."""


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
    def attach(cls, name: str, min_size: int, directory: Path = SHM_DIR,
               proof: tuple[int, bytes] | None = None) -> Segment:
        """Map a peer's segment: a regular file of ours, 0600, at least ``min_size``,
        and with ``proof`` = ``(offset, data)``: holding ``data`` at ``offset``, read
        from the opened file before anything is mapped (the mapping is of that same
        file, whatever its name points at later). A mismatch raises :class:`ProofError`."""
        if not isinstance(name, str) or not valid_name(name):
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
            if proof is not None:
                at, want = proof
                if not want or not hmac.compare_digest(os.pread(fd, len(want), at), want):
                    raise ProofError(f"{name}: does not hold the proof its namer was to "
                                     "write into it (not that peer's segment)")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(directory / name, mm, owner=False)

    def holds(self, offset: int, data: bytes) -> bool:
        """Whether this mapping holds ``data`` at ``offset`` (a proof, checked again)."""
        return bool(data) and hmac.compare_digest(self.mm[offset:offset + len(data)], data)

    def put(self, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of a segment this process made (a proof)."""
        self.mm[offset:offset + len(data)] = data

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


def valid_name(name: str) -> bool:
    """Whether ``name`` has the form of a segment's name (no path, no other file)."""
    return len(name) <= 255 and _NAME.match(name) is not None


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(slices: Iterable[tuple[str, int]]) -> tuple[dict[str, int], int]:
    """(key -> offset, total bytes) for regions of ``(key, nbytes)``, cache-line aligned."""
    offsets: dict[str, int] = {}
    total = 0
    for key, nbytes in slices:
        offsets[key] = total
        total += aligned(nbytes)
    return offsets, total


def descs_to_tensors(seg: Segment, descs: Any, limits: Limits, base: int = 0,
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
        key, dtype, shape = check_desc(desc[:3], limits)
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
