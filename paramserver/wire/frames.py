"""The tensor frames of a message: how named tensors become frames and back.

A message's header (paramserver/wire/protocol.py) carries one descriptor per frame,
in frame order, of one of two forms:

* ``[key, dtype, [shape...]]``: the frame holds that one tensor (C order);
* ``[dtype, [[key, [shape...], offset], ...]]``: a *packed* frame holds these
  tensors of one dtype back to back, each at its byte ``offset``; the entries
  tile the frame exactly, in order (each starts where the one before ends, the
  last ends at the frame's end).

Frames are sent and received without copies where that pays: :func:`describe`
returns memoryviews over the tensors' storage, :func:`read_tensors` wraps each
received frame with one ``torch.frombuffer`` and a packed frame's tensors are views
of it. Reading trusts nothing: a dtype allow-list, bounded keys and shapes, and
``prod(shape) * itemsize == len(frame)`` (for a packed frame: its entries tiling
it); any violation raises :class:`~paramserver.errors.ProtocolError`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.util.dtypes import WIRE_DTYPES
from paramserver.wire.layouts import LayoutCache, PackedLayout

__all__ = [
    "DEFAULT_LIMITS",
    "DTYPES",
    "INT_BOUND",
    "MAX_HEADER_BYTES",
    "MAX_PACKED_BYTES",
    "PACK_BYTES",
    "Limits",
    "PreparedTensors",
    "buffer",
    "check_desc",
    "describe",
    "known_layout",
    "read_tensors",
    "usable",
]


MAX_HEADER_BYTES = 1 << 20
#: tensors under this many bytes are joined into one frame per dtype (a packed
#: frame). pyzmq copies a frame this small anyway (its copy threshold), so joining
#: them adds no copy of note, and it saves a frame per tensor on both sides; larger
#: tensors keep a frame each, sent without a copy. Tensors that already lie back to
#: back in one buffer (a shard's weights) go as one frame whatever their size.
PACK_BYTES = 64 * 1024
#: a packed frame holds at most this many bytes (a single tensor may be larger). The
#: receiver's zmq allocates each frame: up to a few MiB that is warm heap memory a
#: tuned allocator reuses (transport.tune_allocator), beyond 32 MiB fresh pages every
#: time (measured, one worker and one shard over TCP: a 100 MiB push + pull as 100 MiB
#: frames took 173-210 ms, as 4 MiB frames 142 ms); and far below the limit a zmq
#: receiver puts on a frame (Limits.max_tensor_bytes, 2 GiB)
MAX_PACKED_BYTES = 4 << 20

# frames are only read, never written: torch warns about read-only buffers
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES = WIRE_DTYPES
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
#: integers on the wire stay within +-2^62 (a header field, a shape's size)
INT_BOUND = 1 << 62


@dataclass(frozen=True)
class Limits:
    """Decode limits, so a message cannot make a process allocate without bound."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_tensors: int = 65536
    max_tensor_bytes: int = 1 << 31
    max_total_bytes: int = 1 << 33
    max_key_len: int = 1024
    max_ndim: int = 8


DEFAULT_LIMITS = Limits()


def _tensor_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a tensor's storage (CPU, contiguous)."""
    if t.device.type != "cpu":
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor on {t.device}; move it to the CPU first")
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.detach()
    if flat.dim() != 1:
        flat = flat.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def _identity(tensors: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    return tuple((k, id(t), t.data_ptr(), t.shape, t.dtype) for k, t in tensors.items())


class PreparedTensors:
    """A fixed set of tensors (a shard's weights), ready to send again and again: their
    descriptor list packed once and their zero-copy frames made once. Every pull
    reply carries the same weights, so this takes the per-tensor work out of
    encoding it; it stands while no tensor is replaced (copy-on-write moves the
    weights to fresh storage, and then a new one is prepared). Only contiguous CPU
    tensors qualify: the frames must be views of the tensors themselves, so tensors
    are packed only when they lie back to back (a shard's slices of one dtype in its
    flat buffer: one frame per dtype), never copied into a packed frame."""

    __slots__ = ("descs", "frames", "key", "nbytes")

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not usable(tensors):
            raise ValueError("only contiguous CPU tensors can be prepared")
        self.key = _identity(tensors)
        descs, self.frames = describe(tensors, copy=False)
        self.descs: bytes = msgpack.packb(descs, use_bin_type=True)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    @classmethod
    def packed(cls, descs: bytes, frame: torch.Tensor, nbytes: int) -> PreparedTensors:
        """One packed frame made by the caller (a contiguous CPU tensor of ``nbytes``)
        with its descriptor list ``descs``, already msgpack'd: sent once, not kept."""
        out = cls.__new__(cls)
        out.key, out.descs, out.nbytes = (), descs, nbytes
        # (detached: a gradient may require grad, and then so does what cat made of it)
        out.frames = [memoryview(frame.detach().view(torch.uint8).numpy())]  # type: ignore[arg-type]
        return out

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        return self.key == _identity(tensors)


def usable(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether :class:`PreparedTensors` can hold these tensors."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())


def describe(tensors: Mapping[str, torch.Tensor], copy: bool = True
              ) -> tuple[list[list[Any]], list[bytes | memoryview]]:
    """Descriptors and frames, per dtype: each run of tensors lying back to back in
    one buffer as one packed frame of that buffer (no copy); then, with ``copy``,
    the others under PACK_BYTES copied into one packed frame; each other tensor in a
    frame of its own. Without ``copy`` every frame is a view of the tensors."""
    if copy:
        packed = _pack_small(tensors)
        if packed is not None:
            return packed
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        groups.setdefault(t.dtype, []).append((key, t))
    descs: list[list[Any]] = []
    frames: list[bytes | memoryview] = []
    for dtype, items in groups.items():
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            raise ProtocolError(ErrorCode.BAD_TENSOR,
                                f"{items[0][0]!r}: dtype {dtype} is not allowed")
        if len(items) > 1:
            alone = []
            for run in _capped(_runs(items)):
                if len(run) == 1:
                    alone.append(run[0])
                    continue
                first = run[0][1]
                descs.append([name, _entries(run)])
                frames.append(_tensor_view(first.detach().as_strided(
                    (sum(t.numel() for _, t in run),), (1,))))
            items = alone
        if copy and len(items) > 1:
            small, rest = _split_small(items, dtype.itemsize)
            if len(small) > 1:
                for pack in _capped([small]):
                    descs.append([name, _entries(pack)])
                    # 1-D tensors (gradient slices) as they are: a reshape costs a few us
                    frames.append(_tensor_view(torch.cat(
                        [t if t.dim() == 1 else t.reshape(-1) for _, t in pack])))
                items = rest
        for key, t in items:
            descs.append([key, name, list(t.shape)])
            frames.append(_tensor_view(t))
    return descs, frames


def _pack_small(tensors: Mapping[str, torch.Tensor]
                ) -> tuple[list[list[Any]], list[bytes | memoryview]] | None:
    """:func:`describe`'s answer, made directly, for the common small message: tensors
    of one allowed dtype, each on the CPU, non-empty and under PACK_BYTES, none
    starting where the one before it ends, MAX_PACKED_BYTES in all (a small model's
    gradient slices): one packed frame copied from them all, in order. None: any
    other case, which :func:`describe` takes the long way."""
    if len(tensors) < 2:
        return None
    items = list(tensors.items())
    dtype = items[0][1].dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        return None
    limit = PACK_BYTES // dtype.itemsize
    entries: list[list[Any]] = []
    flats: list[torch.Tensor] = []
    offset = 0
    end = -1  # where the tensor before ends, if contiguous (then it would start a run)
    for key, t in items:
        numel = t.numel()
        if t.dtype is not dtype or not t.is_cpu or not 0 < numel < limit:
            return None
        ptr = t.data_ptr()
        if ptr == end:
            return None  # back to back with the one before: describe sends them as a view
        contiguous = t.is_contiguous()
        end = ptr + numel * dtype.itemsize if contiguous else -1
        entries.append([key, list(t.shape), offset])
        offset += numel * dtype.itemsize
        # 1-D contiguous tensors (gradient slices) as they are: a reshape costs a few us
        flats.append(t if t.dim() == 1 and contiguous else t.reshape(-1))
    if offset > MAX_PACKED_BYTES:
        return None
    return [[name, entries]], [_tensor_view(torch.cat(flats))]


def _runs(items: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """``items`` cut into runs of contiguous CPU tensors lying back to back, in this
    order, in one storage (a shard's slices of its flat buffer; a parameter's chunks
    in its gradient); any other tensor is a run of its own."""
    runs: list[list[tuple[str, torch.Tensor]]] = []
    end = -1  # the address where the current run's next tensor would start
    for item in items:
        t = item[1]
        # an empty tensor's data_ptr() is 0: its address from its storage instead
        ptr = t.data_ptr() if t.numel() else (
            t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size())
        if (ptr == end and t.is_contiguous() and t.device.type == "cpu"
                and t.untyped_storage().data_ptr()
                == runs[-1][0][1].untyped_storage().data_ptr()):
            runs[-1].append(item)
        else:
            runs.append([item])
            if not (t.is_contiguous() and t.device.type == "cpu"):
                end = -1
                continue
        end = ptr + t.numel() * t.element_size()
    return runs


def _capped(groups: list[list[tuple[str, torch.Tensor]]]
            ) -> list[list[tuple[str, torch.Tensor]]]:
    """``groups`` cut where one would pass MAX_PACKED_BYTES (a tensor stays whole)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    for group in groups:
        size = 0
        out.append([])
        for item in group:
            n = item[1].numel() * item[1].element_size()
            if out[-1] and size + n > MAX_PACKED_BYTES:
                out.append([])
                size = 0
            out[-1].append(item)
            size += n
    return out


def _split_small(items: list[tuple[str, torch.Tensor]], itemsize: int
                 ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """``items`` as (CPU tensors under PACK_BYTES, the others)."""
    small: list[tuple[str, torch.Tensor]] = []
    rest: list[tuple[str, torch.Tensor]] = []
    limit = PACK_BYTES // itemsize
    for item in items:
        t = item[1]
        (small if t.numel() < limit and t.device.type == "cpu" else rest).append(item)
    return small, rest


def _entries(items: Sequence[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """A packed frame's ``[key, shape, byte offset]`` entries, back to back."""
    out: list[list[Any]] = []
    offset = 0
    for key, t in items:
        out.append([key, list(t.shape), offset])
        offset += t.numel() * t.element_size()
    return out


def buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame or bytes-like
    return memoryview(buf)


_LAYOUTS = LayoutCache()  # one-frame descriptors that passed the checks below


def known_layout(raw: Any) -> PackedLayout | None:
    """The one-frame layout whose descriptor list is, as msgpack, the bytes ``raw``,
    if one passed :func:`read_tensors`' checks lately (paramserver/wire/requests.py)."""
    return _LAYOUTS.exact(raw)


def read_tensors(head: memoryview, header: dict[str, Any], descs: list[Any],
                 frames: Sequence[Any], limits: Limits) -> dict[str, torch.Tensor]:
    """The tensors of ``frames[1:]`` as ``descs`` (the header's "t") describe them,
    each checked; ``head`` and ``header`` (frame 0, raw and unpacked) key the cache of
    one-frame layouts checked before."""
    if len(descs) != len(frames) - 1:
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"header describes {len(descs)} frames but {len(frames) - 1} arrived",
        )
    if len(descs) > limits.max_tensors:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(descs)} tensors > {limits.max_tensors}")
    tensors: dict[str, torch.Tensor] = {}
    one_frame = len(descs) == 1 and type(descs[0]) is list
    if one_frame:  # a small message's one frame: its layout checked before?
        layout = _LAYOUTS.find(head, header, limits)
        if layout is not None and layout.views(buffer(frames[1]), tensors, limits):
            return tensors
    total = 0
    for desc, frame in zip(descs, frames[1:], strict=True):
        buf = buffer(frame)
        if isinstance(desc, list) and len(desc) == 2:
            total = _unpack(desc, buf, tensors, total, limits)
            continue
        key, dtype, shape = check_desc(desc, limits)
        if key in tensors:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor key {key!r} appears twice")
        if len(tensors) >= limits.max_tensors:  # packed frames before this one held some
            raise ProtocolError(ErrorCode.TOO_LARGE, f"over {limits.max_tensors} tensors")
        itemsize = dtype.itemsize
        numel = math.prod(shape)
        if numel * itemsize != buf.nbytes:
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"{key!r}: shape {shape} x {itemsize} bytes = {numel * itemsize}, "
                f"but the frame holds {buf.nbytes} bytes",
            )
        total = _count(key, buf.nbytes, total, limits)
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype)
            if len(shape) != 1:  # a reshape costs as much as the view itself
                t = t.reshape(shape)
        tensors[key] = t
    if one_frame and tensors and total:
        _LAYOUTS.remember(descs, tensors, limits)
    return tensors


def _count(key: str, nbytes: int, total: int, limits: Limits) -> int:
    """``total`` plus one tensor's ``nbytes``, both within the limits."""
    if nbytes > limits.max_tensor_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{key!r}: {nbytes} bytes over the limit")
    total += nbytes
    if total > limits.max_total_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, "message over the total size limit")
    return total


def _unpack(desc: list[Any], buf: memoryview, tensors: dict[str, torch.Tensor], total: int,
            limits: Limits) -> int:
    """A packed frame's tensors into ``tensors``: views of one ``frombuffer`` over it,
    each entry checked as a single frame's descriptor is, and the entries tiling the
    frame exactly (no gap, no overlap, nothing past its end). Returns ``total``."""
    name, entries = desc
    dtype = _check_dtype("packed frame", name)
    if not isinstance(entries, list) or not entries:
        raise ProtocolError(ErrorCode.BAD_TENSOR,
                            "packed frame descriptor must be [dtype, [[key, shape, offset], ...]]")
    if len(tensors) + len(entries) > limits.max_tensors:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"over {limits.max_tensors} tensors")
    itemsize = dtype.itemsize
    max_key = limits.max_key_len
    end = 0
    rows: list[tuple[str, list[int], int]] = []  # (key, shape, numel), checked
    here: set[str] = set()  # this frame's keys so far
    flat1d = True  # every entry 1-D: the views in one split() call
    for entry in entries:
        if type(entry) is not list or len(entry) != 3:
            raise ProtocolError(ErrorCode.BAD_TENSOR, "packed entry must be [key, shape, offset]")
        key, shape, offset = entry
        if type(key) is not str or not 0 < len(key) <= max_key:
            _check_key(key, limits)  # raises
        if (type(shape) is list and len(shape) == 1 and type(shape[0]) is int
                and 0 <= shape[0] < INT_BOUND and limits.max_ndim >= 1):
            numel = shape[0]  # _check_shape's verdict on a 1-D shape, inline
        else:
            numel = _check_shape(key, shape, limits)
            flat1d = False
        if key in tensors or key in here:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor key {key!r} appears twice")
        if type(offset) is not int or offset != end:
            raise ProtocolError(ErrorCode.BAD_TENSOR,
                                f"{key!r}: offset {offset!r}; the entry before ends at {end}")
        nbytes = numel * itemsize
        if end + nbytes > buf.nbytes:
            raise ProtocolError(ErrorCode.BAD_TENSOR,
                                f"{key!r}: bytes {end}-{end + nbytes} past the frame's "
                                f"{buf.nbytes}")
        total = _count(key, nbytes, total, limits)
        here.add(key)
        rows.append((key, shape, numel))
        end += nbytes
    if end != buf.nbytes:
        raise ProtocolError(ErrorCode.BAD_TENSOR,
                            f"packed frame of {buf.nbytes} bytes, its tensors fill {end}")
    flat = (torch.frombuffer(buf, dtype=dtype, count=buf.nbytes // itemsize)
            if buf.nbytes >= itemsize else torch.empty(0, dtype=dtype))
    if flat1d:
        # the entries tile the frame exactly (checked): one call makes every view
        for (key, _, _), view in zip(rows, flat.split_with_sizes([n for _, _, n in rows]),
                                     strict=True):
            tensors[key] = view
        return total
    at = 0
    for key, shape, numel in rows:
        # as_strided: the cheapest view torch makes (indexing costs twice as much)
        tensors[key] = flat.as_strided(shape, _strides(shape), at)
        at += numel
    return total


def _strides(shape: list[int]) -> list[int]:
    """C-order strides of ``shape`` (in elements)."""
    if len(shape) == 1:
        return [1]
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * max(shape[i], 1)
    return strides


def check_desc(desc: Any, limits: Limits) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if not (isinstance(desc, list) and len(desc) == 3):
        raise ProtocolError(ErrorCode.BAD_TENSOR, "tensor descriptor must be [key, dtype, shape]")
    key, dtype_name, shape = desc
    _check_key(key, limits)
    dtype = _check_dtype(repr(key), dtype_name)
    _check_shape(key, shape, limits)
    return key, dtype, tuple(shape)


def _check_key(key: Any, limits: Limits) -> None:
    if type(key) is not str or not 0 < len(key) <= limits.max_key_len:
        raise ProtocolError(ErrorCode.BAD_TENSOR, "tensor key must be a non-empty string")


def _check_dtype(what: str, name: Any) -> torch.dtype:
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"{what}: dtype {name!r} not allowed; allowed: {', '.join(DTYPES)}",
        )
    return dtype


def _check_shape(key: str, shape: Any, limits: Limits) -> int:
    """The number of elements of a valid ``shape`` (a list of at most max_ndim sizes).

    The product of its sizes, a size 0 counted as 1, must stay under 2^62 too: torch
    computes a tensor's strides that way, even an empty one's, and [0, 2^61, 2^61]
    would overflow them (an error that is not the peer's bad_tensor)."""
    if type(shape) is not list or len(shape) > limits.max_ndim:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"{key!r}: bad shape {shape!r}")
    numel = span = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < INT_BOUND:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{key!r}: bad shape {shape!r}")
        numel *= d
        span *= d or 1
        if span >= INT_BOUND:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{key!r}: shape {shape!r} too large")
    return numel
