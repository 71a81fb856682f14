"""A small model's share of a shard, gathered and landed with a few calls per message.

A small model's push is one packed frame per shard (frames.PACK_BYTES), and
its pulled weights come back as one. The general path splits every gradient
into slices, checks each slice, packs them and, for the reply, checks and
copies slice by slice: some sixty Python calls per message, which on a busy
host costs more than the bytes do. :class:`SmallShare` holds what the shard
plan says once (which parameters a shard holds whole, their shapes, dtype and
the packed frame's descriptor) so that a round costs a check per tensor, one
``torch.cat`` to push and one ``torch._foreach_copy_`` to land.

A share under :data:`~paramserver.wire.transport.ZERO_COPY_BYTES` (which a
channel copies into zmq as it sends) is packed into one buffer of its own,
made once with its frame: a push then costs one ``torch.cat`` into it and no
new tensor, view or frame; the next push may overwrite it as soon as the
send returned.

The pulled weights come back in a reply whose layout the share knows: its
:meth:`SmallShare.reader` reads such a reply with one typed msgspec decode of
the header (no dict of fields, no descriptor walked: the descriptor's bytes are
compared with the share's) and one split of the frame. What it accepts, the
general decoder accepts too and reads the same (the same header keys, types and
ranges, the same layout, checked against the channel's limits once); anything
else, and every reply it does not know (HELLO's, STATS', a refusal), it leaves to
the general decoder, which gives the errors.

It applies only where its result is the general path's to the byte: every
slice of the shard is a whole parameter of one dtype, small enough to pack (one
alone goes in a frame of its own, as the general path sends it;
:func:`SmallShare.of` says None otherwise), and each call checks the tensors
it is given; on anything else it returns None or False and the caller takes
the general path, which gives the error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

import msgpack
import msgspec
import torch

from paramserver.core.records import PushOutcome
from paramserver.core.sharding import ShardPlan
from paramserver.wire.frames import INT_BOUND, PACK_BYTES, Limits, PreparedTensors, buffer, describe
from paramserver.wire.messages import PullReply
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op
from paramserver.wire.transport import ZERO_COPY_BYTES

__all__ = ["OutcomeFields", "SmallShare"]

#: a reply the share's reader takes: (the frames) -> the message, or None
Reader = Callable[[Sequence[Any]], Message | None]


class OutcomeFields(msgspec.Struct, forbid_unknown_fields=True):
    """A push's outcome as a shard sends it (PushOutcome.as_dict), every field typed."""

    accepted: bool
    weight: float
    reason: str
    staleness: int
    version: int
    applied: bool
    duplicate: bool = False


class _Pulled(msgspec.Struct, forbid_unknown_fields=True):
    """The fields of a reply carrying weights in frames: a PULL's, or a PUSH's that
    asked for them (with the push's outcome, None when it was lost)."""

    re: Literal["push", "pull"]
    version: int
    clock: int
    waited: float = 0.0
    push: OutcomeFields | msgspec.UnsetType | None = msgspec.UNSET


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    """protocol.encode's header of such a reply; ``t`` left as its bytes."""

    v: Literal[PROTOCOL_VERSION]  # type: ignore[valid-type]
    op: Literal["reply"]
    seq: Annotated[int, msgspec.Meta(ge=0, lt=INT_BOUND)]
    f: _Pulled
    t: msgspec.Raw


_HEADER = msgspec.msgpack.Decoder(_Header)


class SmallShare:
    """One shard's whole-parameter slices of a small model (see the module's text)."""

    __slots__ = ("descs", "dtype", "flat", "frame", "names", "nbytes", "one_dim", "prepared",
                 "shapes", "views")

    def __init__(self, names: list[str], shapes: list[torch.Size], dtype: torch.dtype,
                 descs: bytes, nbytes: int) -> None:
        self.names = names  # and the slices' keys: a whole parameter's key is its name
        self.shapes = shapes
        self.dtype = dtype
        self.descs = descs  # the packed frame's descriptor list, msgpack'd
        self.nbytes = nbytes
        self.flat = [torch.Size((s.numel(),)) for s in shapes]  # a reply's tensors' shapes
        self.one_dim = [len(s) == 1 for s in shapes]  # (flat already: no view)
        # per parameter of more than one dimension: the tensor, its data_ptr and its flat
        # view, as the last landing made them (a view costs more than all the checks)
        self.views: list[tuple[torch.Tensor, int, torch.Tensor] | None] = [None] * len(names)
        # a small share's push: packed into this buffer, sent as this frame (both made
        # once; a channel copies a message this small into zmq, so it can be reused)
        self.frame: torch.Tensor | None = None
        self.prepared: PreparedTensors | None = None
        if nbytes < ZERO_COPY_BYTES:
            self.frame = torch.empty(nbytes // dtype.itemsize, dtype=dtype)
            self.prepared = PreparedTensors.packed(descs, self.frame, nbytes)

    @classmethod
    def of(cls, plan: ShardPlan, shard: int) -> SmallShare | None:
        """The shard's share, or None when the general path must take it."""
        slices = plan.shard_slices(shard)
        if not slices:
            return None
        dtypes = {sl.dtype for sl in slices}
        if len(dtypes) != 1:
            return None
        specs = [plan.param(sl.name) for sl in slices]
        if any(sl.key != sl.name or sl.start != 0 or sl.stop != spec.numel
               for sl, spec in zip(slices, specs, strict=True)):
            return None  # a parameter split over shards or chunks
        dtype = specs[0].torch_dtype
        if not all(0 < s.numel < PACK_BYTES // dtype.itemsize for s in specs):
            return None  # not small: the general path's frames of their own
        # the descriptor is the general path's for such slices (1-D, in this order, not
        # back to back): one frame, packed, or of its own for one tensor; else None
        descs, _ = describe({s.name: torch.empty(s.numel, dtype=dtype) for s in specs})
        if len(descs) != 1:
            return None  # more than one packed frame holds
        return cls([s.name for s in specs], [torch.Size(s.shape) for s in specs], dtype,
                   msgpack.packb(descs, use_bin_type=True),
                   sum(s.numel for s in specs) * dtype.itemsize)

    def pack(self, grads: Mapping[str, torch.Tensor]) -> PreparedTensors | None:
        """The shard's gradients as one packed frame, ready to send; None when any is
        missing, of another shape or dtype, or not on the CPU. A small share's frame
        is its own buffer: valid until the next call."""
        flats = []
        dtype = self.dtype
        for name, shape, one_dim in zip(self.names, self.shapes, self.one_dim, strict=True):
            g = grads.get(name)
            if g is None or g.shape != shape or g.dtype is not dtype or not g.is_cpu:
                return None
            flats.append(g if one_dim else g.reshape(-1))
        if self.frame is not None:
            if torch.is_grad_enabled():  # (out= refuses inputs that require grad)
                with torch.no_grad():
                    torch.cat(flats, out=self.frame)
            else:
                torch.cat(flats, out=self.frame)
            return self.prepared
        frame = torch.cat(flats) if len(flats) > 1 else flats[0].contiguous()
        return PreparedTensors.packed(self.descs, frame, self.nbytes)

    def land(self, params: Mapping[str, torch.Tensor],
             tensors: Mapping[str, torch.Tensor]) -> bool:
        """Copy a reply's ``tensors`` (this share's keys, in order) into ``params``;
        False, with nothing copied, for anything but that and contiguous CPU
        parameters of the plan's shapes and dtype."""
        if list(tensors) != self.names:
            return False
        values = list(tensors.values())
        dtype, views, shapes, flat, one_dim = (self.dtype, self.views, self.shapes, self.flat,
                                               self.one_dim)
        targets = []
        for i, name in enumerate(self.names):
            p, value = params.get(name), values[i]
            if (p is None or p.shape != shapes[i] or p.dtype is not dtype or not p.is_cpu
                    or not p.is_contiguous() or value.dtype is not dtype
                    or value.shape != flat[i] or not value.is_cpu):
                return False
            if one_dim[i]:
                targets.append(p)
                continue
            # the last view stands while it is the same tensor at the same address: its
            # shape, dtype and contiguity were just checked, so its view is the same view
            # (a tensor replaced, or its .data, misses: a fresh view)
            seen, ptr = views[i], p.data_ptr()
            if seen is None or seen[0] is not p or seen[1] != ptr:
                seen = views[i] = (p, ptr, p.view(-1))
            targets.append(seen[2])
        # targets are often nn.Parameters that require grad: copied with grad mode off
        # (push_pull turns it off once for its whole round; then this costs a test)
        if torch.is_grad_enabled():
            with torch.no_grad():
                torch._foreach_copy_(targets, values)
        else:
            torch._foreach_copy_(targets, values)
        return True

    def reader(self, limits: Limits) -> Reader | None:
        """A reader of this share's weight replies under ``limits`` (see the module's
        text); None when the layout itself is over them (the general decoder refuses)."""
        if (len(self.names) > limits.max_tensors or self.nbytes > limits.max_tensor_bytes
                or self.nbytes > limits.max_total_bytes or limits.max_ndim < 1
                or any(not 0 < len(k) <= limits.max_key_len for k in self.names)):
            return None
        descs, nbytes, dtype = self.descs, self.nbytes, self.dtype
        names, numels = self.names, [s.numel() for s in self.shapes]
        count, max_header = nbytes // dtype.itemsize, limits.max_header_bytes

        def read(frames: Sequence[Any]) -> Message | None:
            if len(frames) != 2:
                return None
            head, data = buffer(frames[0]), buffer(frames[1])
            if head.nbytes > max_header or data.nbytes != nbytes:
                return None
            try:
                header = _HEADER.decode(head)
            except msgspec.DecodeError:  # (ValidationError among them)
                return None
            f = header.f
            if memoryview(header.t) != descs:
                return None
            push = f.push
            if f.re == "pull":
                if push is not msgspec.UNSET:
                    return None  # (the general decoder ignores it: leave it to that)
                outcome = None
            elif push is msgspec.UNSET:
                return None  # a push's outcome alone: no weights
            else:
                outcome = None if push is None else PushOutcome(
                    push.accepted, float(push.weight), push.reason, push.staleness,
                    push.version, push.applied, push.duplicate)
            flat = torch.frombuffer(data, dtype=dtype, count=count)
            tensors = (dict(zip(names, flat.split_with_sizes(numels), strict=True))
                       if len(names) > 1 else {names[0]: flat})
            body = PullReply(f.version, f.clock, float(f.waited), None, outcome,
                             f.re == "push")
            # (the fields a reader of replies asks for by name; the record is ``body``)
            return Message(Op.REPLY, header.seq, {"re": f.re}, tensors, None, body)

        return read
