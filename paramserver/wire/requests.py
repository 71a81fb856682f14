"""A shard's hot requests read with one typed decode: a worker's PUSH of a known
layout, and its PULL.

:func:`~paramserver.wire.protocol.decode` unpacks the header into a dict,
checks it field by field against the schema, then makes the op's record
(wire/messages.py). A worker's small push repeats one form, message after
message: the header's five keys, the push's fields, and one frame whose
descriptor was checked before (wire/layouts.py). :func:`decode_request` reads
that form with a msgspec decode of the header into Structs (every field typed,
no unknown field, each integer in the range the general path allows), the
descriptor's bytes compared with a checked layout's, and the frame's views in
one or two torch calls; no dict of the header, no schema walked.

It takes only what the general decoder takes and reads it the same
(tests/test_requests.py compares the two): anything else (another op, a field
it does not know, a value of another type or out of range, a part of a push,
shared memory, an unknown layout, a frame more or less, a header over the
limits, bytes that are not msgpack) it leaves to the general decoder, which
reads it or refuses it with its error code. Being stricter than the general
decoder is safe here, being looser never: every bound below is the general
path's or tighter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from paramserver.wire.frames import DEFAULT_LIMITS, INT_BOUND, Limits, buffer, known_layout
from paramserver.wire.messages import Pull, Push
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op, decode

__all__ = ["decode_request"]

# the general path's bounds (protocol._check_fields, then messages.parse): every
# integer within +-INT_BOUND, ids, clocks and versions >= 0, samples >= 1
_Count = Annotated[int, msgspec.Meta(ge=0, lt=INT_BOUND)]
_Samples = Annotated[int, msgspec.Meta(ge=1, lt=INT_BOUND)]
_UNSET: Any = msgspec.UNSET


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    """protocol.encode's header; the op's fields and the descriptors left as bytes."""

    v: Literal[PROTOCOL_VERSION]  # type: ignore[valid-type]
    op: Literal["push", "pull"]
    seq: _Count
    f: msgspec.Raw
    t: msgspec.Raw


class _PushFields(msgspec.Struct, forbid_unknown_fields=True):
    """A whole PUSH's fields (no parts, no shared memory, no early weights)."""

    worker: _Count
    push_id: _Count
    clock: _Count
    num_samples: _Samples
    read_version: _Count
    # any number, as the schema's (int, float) (a bool, which it takes too, is
    # left to it); read as float(loss), as messages.parse does
    loss: int | float | msgspec.UnsetType = _UNSET
    pull: bool | msgspec.UnsetType = _UNSET


class _PullFields(msgspec.Struct, forbid_unknown_fields=True):
    """A PULL's fields over TCP (no answer through the weight board asked)."""

    worker: _Count
    clock: _Count
    observer: bool | msgspec.UnsetType = _UNSET
    wait_init: bool | msgspec.UnsetType = _UNSET


_HEADER = msgspec.msgpack.Decoder(_Header)
_PUSH = msgspec.msgpack.Decoder(_PushFields)
_PULL = msgspec.msgpack.Decoder(_PullFields)
_NO_TENSORS = b"\x90"  # the empty descriptor list, as encode packs it
# a map of at most 15 pairs (msgpack's fixmap): the general decoder refuses a map of
# over 4096, and a key given twice (which both read as its last value) could
# otherwise make one that long; no other container is read here but the checked
# descriptor, compared as bytes
_FIXMAP, _FIXMAP_END = 0x80, 0x90


def _read(frames: Sequence[Any], limits: Limits) -> Message | None:
    """The message ``frames`` hold if it is of the forms above, else None."""
    count = len(frames)
    if not 1 <= count <= 2:
        return None
    head = buffer(frames[0])
    if (not 0 < head.nbytes <= limits.max_header_bytes
            or not _FIXMAP <= head[0] < _FIXMAP_END):
        return None
    try:  # (DecodeError, ValidationError; RecursionError on deep nesting: all the same)
        header = _HEADER.decode(head)
        if header.op == "push":
            if count != 2:
                return None
            if not _FIXMAP <= memoryview(header.f)[0] < _FIXMAP_END:
                return None
            p = _PUSH.decode(header.f)
        else:
            if count != 1 or memoryview(header.t) != _NO_TENSORS:
                return None
            if not _FIXMAP <= memoryview(header.f)[0] < _FIXMAP_END:
                return None
            q = _PULL.decode(header.f)
    except Exception:  # whatever it is, the general decoder says
        return None
    if header.op == "pull":
        observer, wait_init = q.observer, q.wait_init
        fields: dict[str, Any] = {"worker": q.worker, "clock": q.clock}
        if observer is not _UNSET:
            fields["observer"] = observer
        if wait_init is not _UNSET:
            fields["wait_init"] = wait_init
        return Message(Op.PULL, header.seq, fields, {}, None,
                       Pull(q.worker, q.clock, observer is True, wait_init is True, None))
    layout = known_layout(header.t)
    tensors: dict[str, Any] = {}
    if layout is None or not layout.views(buffer(frames[1]), tensors, limits):
        return None
    loss: Any = p.loss
    pull = p.pull
    fields = {"worker": p.worker, "push_id": p.push_id, "clock": p.clock,
              "num_samples": p.num_samples, "read_version": p.read_version}
    if loss is not _UNSET:
        fields["loss"] = loss
    if pull is not _UNSET:
        fields["pull"] = pull
    body = Push(p.worker, p.push_id, p.clock, p.read_version, p.num_samples,
                None if loss is _UNSET else float(loss), pull is True)
    return Message(Op.PUSH, header.seq, fields, tensors, None, body)


def decode_request(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """:func:`~paramserver.wire.protocol.decode`'s message, read by the typed
    decode above where it can, else by the general decoder (which gives the errors)."""
    msg = _read(frames, limits)
    return msg if msg is not None else decode(frames, limits)
