"""Wire protocol: a msgpack header plus raw tensor frames. Never pickle.

A message is a ZeroMQ multipart ``[header, frame_1, ..., frame_k]``. The
header is a msgpack map::

    {"v": PROTOCOL_VERSION, "op": "push", "seq": 7, "f": {...op fields...},
     "t": [frame descriptor, ...]}

with one descriptor per tensor frame, in frame order; the frames and their
descriptors (one tensor, or a *packed* frame of several of one dtype) are
paramserver/wire/frames.py's. This module is the envelope: the header, the op
fields' schema, :class:`Message`, :func:`encode` and :func:`decode`.

The packed form carries a shard's share of one dtype in one frame: a shard's
weights of a dtype live in one flat buffer (paramserver/util/flat.py), which is sent
as it is, and small tensors are joined into one frame, since a frame costs far
more than copying a few KiB (see :data:`PACK_BYTES`). Frames are sent and
received without copies otherwise.

Decoding trusts nothing: header size and msgpack container limits, the op and
each of its fields against a schema, and the frames as frames.py checks them.
Any violation raises :class:`~paramserver.errors.ProtocolError` with an
:class:`ErrorCode`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import torch

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire.frames import (
    DEFAULT_LIMITS,
    DTYPES,
    INT_BOUND,
    MAX_HEADER_BYTES,
    MAX_PACKED_BYTES,
    PACK_BYTES,
    Limits,
    PreparedTensors,
    buffer,
    describe,
    read_tensors,
    usable,
)
from paramserver.wire.messages import Body, Op, check_tensors, parse

__all__ = [
    "DEFAULT_LIMITS",
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
    "usable",
    "weights_reply_fields",
    "weights_reply_head",
]

# 2: packed frames (several tensors of one dtype in one frame); a version 1 peer
# would refuse their descriptors, so it is refused at once by the version instead
PROTOCOL_VERSION = 2


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
        # the optimizer the worker's script wraps: {"name", "args"} (core/hyper.py)
        "optimizer": (_MAP, False),
        # the worker's run (launch's run id); optional: a worker started by hand has none
        "run": (_STR, False),
    },
    # INIT too may come in parts (a large shard), each copied in as it arrives
    # "shm": the tensors lie in the sender's shared-memory segment, not in frames
    Op.INIT: {"worker": (_INT, True), "part": (_INT, False), "parts": (_INT, False),
              "shm": (_LIST, False)},
    # "via_shm": answer with a ticket to the shard's weight board instead of frames;
    # "final": an observer's pull held until every worker is done here (opt.final())
    Op.PULL: {"worker": (_INT, True), "clock": (_INT, True), "observer": (_BOOL, False),
              "wait_init": (_BOOL, False), "via_shm": (_BOOL, False), "final": (_BOOL, False),
              # compressed pulls: the answers of this shard the worker holds (-1: none)
              "base": (_INT, False)},
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
        # the evaluating rank changed the learning rate: set before this push is taken
        "lr": (_NUM, False),
        # its slices come as parts of compressed formats (paramserver/wire/compressed.py)
        "compressed": (_BOOL, False),
        # with "pull": the compressed pulls' answers the worker holds (as PULL's)
        "base": (_INT, False),
    },
    Op.HEARTBEAT: {"worker": (_INT, True), "run": (_STR, False)},
    # tensors "ids:<table>" (int64 row ids) and, for SPUSH and SINIT, "val:<table>"
    Op.SPULL: {"worker": (_INT, True), "observer": (_BOOL, False)},  # observer: no worker
    Op.SPUSH: {"worker": (_INT, True), "push_id": (_INT, True), "clock": (_INT, True),
               "read_version": (_INT, True), "num_samples": (_INT, True), "lr": (_NUM, False)},
    Op.SINIT: {"worker": (_INT, True), "part": (_INT, False), "parts": (_INT, False)},
    Op.BYE: {"worker": (_INT, True), "dead": (_BOOL, False)},
    Op.STATS: {},
    Op.CHECKPOINT: {"path": (_STR, False)},
    Op.SHUTDOWN: {},
    # a live move's step (server/elastic.py; wire/messages.py's Reshard bounds each)
    Op.RESHARD: {"step": (_STR, True), "at": (_INT, False), "epoch": (_INT, False),
                 "shard": (_INT, False), "servers": (_LIST, False), "windows": (_MAP, False),
                 "wait": (_NUM, False)},
    Op.REPLY: {"re": (_STR, True)},
    Op.ERROR: {"code": (_STR, True), "reason": (_STR, True), "moved": (_MAP, False)},
}


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


# the header's map in encode's key order, its constant parts packed once
_PACK = msgpack.Packer(use_bin_type=True)
_HEAD_START = b"\x85" + _PACK.pack("v") + _PACK.pack(PROTOCOL_VERSION) + _PACK.pack("op")
_SEQ, _F, _T = _PACK.pack("seq"), _PACK.pack("f"), _PACK.pack("t")
_OP_BYTES = {op: _PACK.pack(op.value) for op in Op}


def _head(op: Op, seq: int, fields: dict[str, Any], descs: bytes) -> bytes:
    """The header of a message whose descriptors are packed already (``descs``)."""
    # the same bytes as encode's below: the map {"v", "op", "seq", "f", "t"} in this order
    # (packb, not the shared Packer: servers may run in threads of one process)
    return b"".join((_HEAD_START, _OP_BYTES[op], _SEQ, msgpack.packb(seq), _F,
                     msgpack.packb(fields, use_bin_type=True), _T, descs))


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
        return [_head(msg.op, msg.seq, msg.fields, prepared.descs), *prepared.frames]
    descs, tensor_frames = describe(msg.tensors)
    header = {"v": PROTOCOL_VERSION, "op": msg.op.value, "seq": msg.seq, "f": msg.fields,
              "t": descs}
    return [msgpack.packb(header, use_bin_type=True), *tensor_frames]


class _WeightsFields(msgspec.Struct):
    """A weights reply's fields in the order the outbox builds its dict; ``push``
    left out when UNSET (a PULL's reply). Values typed Any: msgspec encodes each by
    its own type, as msgpack does."""

    re: str
    version: Any
    clock: Any
    waited: Any
    push: Any = msgspec.UNSET


class _WeightsHead(msgspec.Struct):
    """encode's header map, in its order; ``t`` the prepared descriptors' bytes."""

    v: int
    op: str
    seq: Any
    f: _WeightsFields
    t: msgspec.Raw


_WEIGHTS_HEAD = msgspec.msgpack.Encoder()  # (shared by threads: each call makes its own buffer)


def weights_reply_head(seq: int, version: int, clock: int, waited: float,
                       outcome: Any, descs: bytes) -> bytes:
    """The header :func:`encode` makes for a REPLY carrying weights in prepared frames
    (``descs``), to the byte, with fewer objects: for a PULL its fields ``{"re":
    "pull", "version", "clock", "waited"}``; for a PUSH that asked for the weights
    (``outcome`` not UNSET) ``re`` "push" and ``push``: the outcome as
    ``as_dict()`` gives it (a dataclass: msgspec writes its fields in order).
    tests/test_protocol.py compares it with :func:`encode` across values."""
    if outcome is msgspec.UNSET:
        fields = _WeightsFields("pull", version, clock, waited)
    else:
        fields = _WeightsFields("push", version, clock, waited, outcome)
    try:
        return _WEIGHTS_HEAD.encode(_WeightsHead(PROTOCOL_VERSION, "reply", seq, fields,
                                                 msgspec.Raw(descs)))
    except (TypeError, OverflowError, ValueError):  # (msgpack may take what it does not)
        return _head(Op.REPLY, seq, weights_reply_fields(version, clock, waited, outcome),
                     descs)


def weights_reply_fields(version: int, clock: int, waited: float,
                         outcome: Any) -> dict[str, Any]:
    """The fields of a REPLY to a PULL, or with ``outcome`` (not UNSET) to a PUSH that
    asked for the weights: what :func:`weights_reply_head` packs, as a dict."""
    fields: dict[str, Any] = {"re": Op.PULL.value, "version": version, "clock": clock,
                              "waited": waited}
    if outcome is not msgspec.UNSET:
        fields.update(re=Op.PUSH.value, push=outcome.as_dict())
    return fields


_OPS = {op.value: op for op in Op}
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
            if not -INT_BOUND < value < INT_BOUND:
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
    head = buffer(frames[0])
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
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < INT_BOUND:
        raise ProtocolError(ErrorCode.BAD_HEADER, "'seq' must be a non-negative integer")
    fields = _check_fields(op, header.get("f", {}))
    body = parse(op, fields)  # the op's record, its ranges checked (wire/messages.py)
    descs = header.get("t", [])
    if not isinstance(descs, list):
        raise ProtocolError(ErrorCode.BAD_HEADER, "'t' must be a list")
    tensors = read_tensors(head, header, descs, frames, limits)
    check_tensors(op, tensors)
    return Message(op, seq, fields, tensors, None, body)
