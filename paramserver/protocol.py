"""Wire protocol: a msgpack header plus one raw frame per tensor. Never pickle.

A message is a ZeroMQ multipart ``[header, frame_1, ..., frame_k]``. The
header is a msgpack map::

    {"v": PROTOCOL_VERSION, "op": "push", "seq": 7, "f": {...op fields...},
     "t": [[key, dtype, [shape...]], ...]}

and frame i holds the raw bytes of tensor i (C order). Frames are sent and
received without copies: :func:`encode` returns memoryviews over the tensors'
storage, :func:`decode` wraps received buffers with ``torch.frombuffer``.

Decoding trusts nothing: header size and msgpack container limits, the op and
each of its fields against a schema, a dtype allow-list, and
``prod(shape) * itemsize == len(frame)``. Any violation raises
:class:`~paramserver.errors.ProtocolError` with an :class:`ErrorCode`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack
import torch

from .dtypes import WIRE_DTYPES
from .errors import ErrorCode, ProtocolError

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "PROTOCOL_VERSION",
    "Limits",
    "Message",
    "Op",
    "PreparedTensors",
    "decode",
    "encode",
    "error_reply",
    "reply",
]

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20

# frames are only read, never written: torch warns about read-only buffers
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES = WIRE_DTYPES
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class Op(StrEnum):
    HELLO = "hello"
    INIT = "init"
    PULL = "pull"
    PUSH = "push"
    HEARTBEAT = "heartbeat"
    BYE = "bye"
    STATS = "stats"
    CHECKPOINT = "checkpoint"
    SHUTDOWN = "shutdown"
    # row-sparse tables (paramserver/sparse.py): rows by id, gradients of rows, seed rows
    SPULL = "spull"
    SPUSH = "spush"
    SINIT = "sinit"
    REPLY = "reply"
    ERROR = "error"


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
        # a same-host worker offers its gradient segment (paramserver/shm.py)
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

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


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
    flat = t.detach().reshape(-1)
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
    tensors qualify: the frames must be views of the tensors themselves."""

    __slots__ = ("descs", "frames", "key")

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not usable(tensors):
            raise ValueError("only contiguous CPU tensors can be prepared")
        self.key = _identity(tensors)
        descs, self.frames = _describe(tensors)
        self.descs: bytes = msgpack.packb(descs, use_bin_type=True)

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        return self.key == _identity(tensors)


def usable(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether :class:`PreparedTensors` can hold these tensors."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())


def _describe(tensors: Mapping[str, torch.Tensor]
              ) -> tuple[list[list[Any]], list[bytes | memoryview]]:
    descs: list[list[Any]] = []
    frames: list[bytes | memoryview] = []
    for key, t in tensors.items():
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{key!r}: dtype {t.dtype} is not allowed")
        descs.append([key, name, list(t.shape)])
        frames.append(_tensor_view(t))
    return descs, frames


# the header's map in encode's key order, its constant parts packed once
_PACK = msgpack.Packer(use_bin_type=True)
_HEAD_START = b"\x85" + _PACK.pack("v") + _PACK.pack(PROTOCOL_VERSION) + _PACK.pack("op")
_SEQ, _F, _T = _PACK.pack("seq"), _PACK.pack("f"), _PACK.pack("t")
_OP_BYTES = {op: _PACK.pack(op.value) for op in Op}


def encode(msg: Message, prepared: PreparedTensors | None = None) -> list[bytes | memoryview]:
    """Turn a message into multipart frames; tensor frames share the tensors' memory.

    ``prepared``: the message's tensors made ready beforehand (used when it still
    matches them). The caller must not modify the tensors until ZeroMQ has sent them.
    """
    if prepared is not None and prepared.matches(msg.tensors):
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


def _check_fields(op: Op, fields: Any) -> dict[str, Any]:
    if not isinstance(fields, dict):
        raise ProtocolError(ErrorCode.BAD_HEADER, "'f' must be a map")
    schema = _SCHEMA[op]
    for name, (types, required) in schema.items():
        if name not in fields:
            if required:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"{op.value}: missing field {name!r}")
            continue
        value = fields[name]
        if types is _INT and (isinstance(value, bool) or not isinstance(value, int)):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{op.value}: {name!r} must be an integer")
        if types is _INT and not -_INT_BOUND < value < _INT_BOUND:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{op.value}: {name!r} out of range")
        if types is not _INT and types is not _ANY and not isinstance(value, types):
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
    try:
        op = Op(str(header.get("op")))
    except ValueError as exc:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {header.get('op')!r}") from exc
    seq = header.get("seq", 0)
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < _INT_BOUND:
        raise ProtocolError(ErrorCode.BAD_HEADER, "'seq' must be a non-negative integer")
    fields = _check_fields(op, header.get("f", {}))
    descs = header.get("t", [])
    if not isinstance(descs, list):
        raise ProtocolError(ErrorCode.BAD_HEADER, "'t' must be a list")
    if len(descs) != len(frames) - 1:
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"header describes {len(descs)} tensors but {len(frames) - 1} frames arrived",
        )
    if len(descs) > limits.max_tensors:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(descs)} tensors > {limits.max_tensors}")
    tensors: dict[str, torch.Tensor] = {}
    total = 0
    for desc, frame in zip(descs, frames[1:], strict=True):
        key, dtype, shape = _check_desc(desc, limits)
        if key in tensors:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"tensor key {key!r} appears twice")
        buf = _buffer(frame)
        itemsize = dtype.itemsize
        numel = math.prod(shape)
        if numel * itemsize != buf.nbytes:
            raise ProtocolError(
                ErrorCode.BAD_TENSOR,
                f"{key!r}: shape {shape} x {itemsize} bytes = {numel * itemsize}, "
                f"but the frame holds {buf.nbytes} bytes",
            )
        if buf.nbytes > limits.max_tensor_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{key!r}: {buf.nbytes} bytes over the limit")
        total += buf.nbytes
        if total > limits.max_total_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, "message over the total size limit")
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype).reshape(shape)
        tensors[key] = t
    return Message(op, seq, fields, tensors)


def _check_desc(desc: Any, limits: Limits) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if not (isinstance(desc, list) and len(desc) == 3):
        raise ProtocolError(ErrorCode.BAD_TENSOR, "tensor descriptor must be [key, dtype, shape]")
    key, dtype_name, shape = desc
    if not isinstance(key, str) or not 0 < len(key) <= limits.max_key_len:
        raise ProtocolError(ErrorCode.BAD_TENSOR, "tensor key must be a non-empty string")
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ProtocolError(
            ErrorCode.BAD_TENSOR,
            f"{key!r}: dtype {dtype_name!r} not allowed; allowed: {', '.join(DTYPES)}",
        )
    if not isinstance(shape, list) or len(shape) > limits.max_ndim or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _INT_BOUND for d in shape
    ):
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"{key!r}: bad shape {shape!r}")
    return key, dtype, tuple(shape)
