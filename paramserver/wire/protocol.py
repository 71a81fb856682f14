"""Wire protocol: a msgpack header plus raw tensor frames. Never pickle.

A message is a ZeroMQ multipart ``[header, frame_1, ..., frame_k]``. The
header is a msgpack map::

    {"v": PROTOCOL_VERSION, "op": "push", "seq": 7, "f": {...op fields...},
     "t": [frame descriptor, ...]}

with one descriptor per frame, in frame order, of one of two forms:

* ``[key, dtype, [shape...]]``: the frame holds that one tensor (C order);
* ``[dtype, [[key, [shape...], offset], ...]]``: a *packed* frame holds these
  tensors of one dtype back to back, each at its byte ``offset``; the entries
  tile the frame exactly, in order (each starts where the one before ends, the
  last ends at the frame's end).

The packed form carries a shard's share of one dtype in one frame: a shard's
weights of a dtype live in one flat buffer (paramserver/util/flat.py), which is sent
as it is, and small tensors are joined into one frame, since a frame costs far
more than copying a few KiB (see :data:`PACK_BYTES`). Frames are sent and
received without copies otherwise: :func:`encode` returns memoryviews over the
tensors' storage, :func:`decode` wraps each received frame with one
``torch.frombuffer`` and a packed frame's tensors are views of it.

Decoding trusts nothing: header size and msgpack container limits, the op and
each of its fields against a schema, a dtype allow-list, and
``prod(shape) * itemsize == len(frame)`` (for a packed frame: its entries
tiling it). Any violation raises :class:`~paramserver.errors.ProtocolError`
with an :class:`ErrorCode`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.util.dtypes import WIRE_DTYPES
from paramserver.wire.layouts import LayoutCache
from paramserver.wire.messages import Body, Op, check_tensors, parse

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_PACKED_BYTES",
    "PACK_BYTES",
    "PROTOCOL_VERSION",
    "Body",
    "Limits",
    "Message",
    "Op",
    "PreparedTensors",
    "decode",
    "encode",
    "error_reply",
    "reply",
]

# 2: packed frames (several tensors of one dtype in one frame); a version 1 peer
# would refuse their descriptors, so it is refused at once by the version instead
PROTOCOL_VERSION = 2
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


_INT = (int,)
_STR = (str,)
_NUM = (int, float)
_MAP = (dict,)
_LIST = (list,)
_BOOL = (bool,)
_ANY = (object,)

# op -> {field: (types, required)}; replies are checked loosely (peers we called)
_SCHEMA: dict[Op, dict[str, tuple[tuple[type, ...], bool]]] = {
    Op.HELLO: {
        "worker": (_INT, True),
        "role": (_STR, True),
        "protocol": (_INT, True),
        "plan_hash": (_STR, True),
        "plan": (_MAP, False),
        "incarnation": (_STR, True),
        # where the worker runs, for `paramserver status`; optional: older peers omit it
        "host": (_STR, False),
        "pid": (_INT, False),
        # a same-host worker offers its gradient segment (paramserver/shm/link.py)
        "shm": (_MAP, False),
    },
    # INIT too may come in parts (a large shard), each copied in as it arrives
    # "shm": the tensors lie in the sender's shared-memory segment, not in frames
    Op.INIT: {"worker": (_INT, True), "part": (_INT, False), "parts": (_INT, False),
              "shm": (_LIST, False)},
    # "via_shm": answer with a ticket to the shard's weight board instead of frames
    Op.PULL: {"worker": (_INT, True), "clock": (_INT, True), "observer": (_BOOL, False),
              "wait_init": (_BOOL, False), "via_shm": (_BOOL, False)},
    Op.PUSH: {
        "worker": (_INT, True),
        "push_id": (_INT, True),
        "clock": (_INT, True),
        "read_version": (_INT, True),
        "num_samples": (_INT, True),
        "loss": (_NUM, False),  # the worker's training loss on this push's samples
        # answer with the weights for clock + 1 once the pull gate opens: push and
        # pull in one round trip (the reply carries the push outcome under "push")
        "pull": (_BOOL, False),
        # a push sent in several messages (buckets sent as backward produces
        # them, or a large push split to bound the shard's memory): this is part
        # "part" of "parts"; only the last is answered in full
        "part": (_INT, False),
        "parts": (_INT, False),
        "shm": (_LIST, False),
        "via_shm": (_BOOL, False),
        # its answer may carry the part's next weights (workers/pushstream.py)
        "early": (_BOOL, False),
    },
    Op.HEARTBEAT: {"worker": (_INT, True)},
    # tensors "ids:<table>" (int64 row ids) and, for SPUSH and SINIT, "val:<table>"
    Op.SPULL: {"worker": (_INT, True), "observer": (_BOOL, False)},  # observer: no worker
    Op.SPUSH: {"worker": (_INT, True), "push_id": (_INT, True), "clock": (_INT, True),
               "read_version": (_INT, True), "num_samples": (_INT, True)},
    Op.SINIT: {"worker": (_INT, True), "part": (_INT, False), "parts": (_INT, False)},
    Op.BYE: {"worker": (_INT, True), "dead": (_BOOL, False)},
    Op.STATS: {},
    Op.CHECKPOINT: {"path": (_STR, False)},
    Op.SHUTDOWN: {},
    Op.REPLY: {"re": (_STR, True)},
    Op.ERROR: {"code": (_STR, True), "reason": (_STR, True)},
}
_INT_BOUND = 1 << 62


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


@dataclass
class Message:
    """One protocol message: an op, its fields and named tensors (in order)."""

    op: Op
    seq: int = 0
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the tensors made ready to send instead (paramserver/wire/lanes.py): ``tensors``
    #: is then empty, and encode sends these frames
    prepared: PreparedTensors | None = None
    #: the typed record of ``fields`` (wire/messages.py): made by decode, else on first read
    parsed: Body = field(default=None, repr=False, compare=False)

    @property
    def body(self) -> Any:
        """The op's record (wire/messages.py), checked and bounded: what handlers read.
        (Any: each handler names the record its op has, ``p: Push = msg.body``.)"""
        if self.parsed is None:
            self.parsed = parse(self.op, self.fields)
        return self.parsed

    @body.setter
    def body(self, value: Body) -> None:
        self.parsed = value

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    @property
    def nbytes(self) -> int:
        if self.prepared is not None:
            return self.prepared.nbytes
        return sum(t.nbytes for t in self.tensors.values())


def reply(request: Message, tensors: Mapping[str, torch.Tensor] | None = None,
          **fields: Any) -> Message:
    """A REPLY to ``request`` (same seq), naming the op it answers."""
    return Message(Op.REPLY, request.seq, {"re": request.op.value, **fields}, dict(tensors or {}))


def error_reply(seq: int, code: str, reason: str) -> Message:
    return Message(Op.ERROR, seq, {"code": code, "reason": reason[:2000]})


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
        descs, self.frames = _describe(tensors, copy=False)
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


def _describe(tensors: Mapping[str, torch.Tensor], copy: bool = True
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
    """:func:`_describe`'s answer, made directly, for the common small message: tensors
    of one allowed dtype, each on the CPU, non-empty and under PACK_BYTES, none
    starting where the one before it ends, MAX_PACKED_BYTES in all (a small model's
    gradient slices): one packed frame copied from them all, in order. None: any
    other case, which :func:`_describe` takes the long way."""
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
            return None  # back to back with the one before: _describe sends them as a view
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


# the header's map in encode's key order, its constant parts packed once
_PACK = msgpack.Packer(use_bin_type=True)
_HEAD_START = b"\x85" + _PACK.pack("v") + _PACK.pack(PROTOCOL_VERSION) + _PACK.pack("op")
_SEQ, _F, _T = _PACK.pack("seq"), _PACK.pack("f"), _PACK.pack("t")
_OP_BYTES = {op: _PACK.pack(op.value) for op in Op}


def encode(msg: Message, prepared: PreparedTensors | None = None, *,
           matched: bool = False) -> list[bytes | memoryview]:
    """Turn a message into multipart frames; tensor frames share the tensors' memory.

    ``prepared``: the message's tensors made ready beforehand (used when it still
    matches them; ``matched``: the caller has just checked that it does). The caller
    must not modify the tensors until ZeroMQ has sent them.
    """
    if msg.prepared is not None:
        prepared, matched = msg.prepared, True
    if prepared is not None and (matched or prepared.matches(msg.tensors)):
        # the same bytes as below: the map {"v", "op", "seq", "f", "t"} in this order
        # (packb, not the shared Packer: servers may run in threads of one process)
        head = b"".join((_HEAD_START, _OP_BYTES[msg.op], _SEQ, msgpack.packb(msg.seq), _F,
                         msgpack.packb(msg.fields, use_bin_type=True), _T, prepared.descs))
        return [head, *prepared.frames]
    descs, tensor_frames = _describe(msg.tensors)
    header = {"v": PROTOCOL_VERSION, "op": msg.op.value, "seq": msg.seq, "f": msg.fields,
              "t": descs}
    return [msgpack.packb(header, use_bin_type=True), *tensor_frames]


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame or bytes-like
    return memoryview(buf)


_OPS = {op.value: op for op in Op}
_LAYOUTS = LayoutCache()  # one-frame descriptors that passed the checks below
_MISSING = object()
# the schema as (name, is an integer, types, required) rows: the test per field the
# same, without unpacking the schema's nested tuples per message
_ROWS = {op: tuple((name, types is _INT, types, required)
                   for name, (types, required) in schema.items())
         for op, schema in _SCHEMA.items()}


def _check_fields(op: Op, fields: Any) -> dict[str, Any]:
    if not isinstance(fields, dict):
        raise ProtocolError(ErrorCode.BAD_HEADER, "'f' must be a map")
    for name, integer, types, required in _ROWS[op]:
        value = fields.get(name, _MISSING)
        if value is _MISSING:
            if required:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"{op.value}: missing field {name!r}")
            continue
        if integer:
            if type(value) is not int and (isinstance(value, bool)
                                           or not isinstance(value, int)):
                raise ProtocolError(ErrorCode.BAD_FIELD,
                                    f"{op.value}: {name!r} must be an integer")
            if not -_INT_BOUND < value < _INT_BOUND:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"{op.value}: {name!r} out of range")
        elif types is not _ANY and not isinstance(value, types):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"{op.value}: {name!r} must be {types[0].__name__}, got {type(value).__name__}",
            )
    return fields


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate multipart frames (bytes or zmq.Frame) into a Message."""
    if not frames:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "empty message")
    head = _buffer(frames[0])
    if head.nbytes > limits.max_header_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"header of {head.nbytes} bytes > {limits.max_header_bytes}"
        )
    try:
        header = msgpack.unpackb(
            head,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_header_bytes,
            max_bin_len=0,
            max_array_len=max(limits.max_tensors, 1024),
            max_map_len=4096,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(ErrorCode.BAD_HEADER, f"header is not valid msgpack: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_HEADER, "header must be a msgpack map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 equal 1
        raise ProtocolError(
            ErrorCode.PROTOCOL_VERSION,
            f"protocol version {version!r}; this side speaks {PROTOCOL_VERSION}",
        )
    name = header.get("op")
    op = _OPS.get(name) if type(name) is str else None  # (msgpack gives str, never a subclass)
    if op is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {name!r}")
    seq = header.get("seq", 0)
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < _INT_BOUND:
        raise ProtocolError(ErrorCode.BAD_HEADER, "'seq' must be a non-negative integer")
    fields = _check_fields(op, header.get("f", {}))
    body = parse(op, fields)  # the op's record, its ranges checked (wire/messages.py)
    descs = header.get("t", [])
    if not isinstance(descs, list):
        raise ProtocolError(ErrorCode.BAD_HEADER, "'t' must be a list")
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
        if layout is not None and layout.views(_buffer(frames[1]), tensors, limits):
            check_tensors(op, tensors)
            return Message(op, seq, fields, tensors, None, body)
    total = 0
    for desc, frame in zip(descs, frames[1:], strict=True):
        buf = _buffer(frame)
        if isinstance(desc, list) and len(desc) == 2:
            total = _unpack(desc, buf, tensors, total, limits)
            continue
        key, dtype, shape = _check_desc(desc, limits)
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
    check_tensors(op, tensors)
    return Message(op, seq, fields, tensors, None, body)


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
                and 0 <= shape[0] < _INT_BOUND and limits.max_ndim >= 1):
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


def _check_desc(desc: Any, limits: Limits) -> tuple[str, torch.dtype, tuple[int, ...]]:
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
        if type(d) is not int or not 0 <= d < _INT_BOUND:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{key!r}: bad shape {shape!r}")
        numel *= d
        span *= d or 1
        if span >= _INT_BOUND:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{key!r}: shape {shape!r} too large")
    return numel
