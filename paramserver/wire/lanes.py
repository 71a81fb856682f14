"""A small model's share of a shard, gathered and landed with a few calls per message.

A small model's push is one packed frame per shard (frames.PACK_BYTES), and
its pulled weights come back as one. The general path splits every gradient
into slices, checks each slice, packs them and, for the reply, checks and
copies slice by slice: some sixty Python calls per message, which on a busy
host costs more than the bytes do. :class:`SmallShare` holds what the shard
plan says once (which parameters a shard holds whole, their shapes, dtype and
the packed frame's descriptor) so that a round costs a check per tensor, one
``torch.cat`` to push and one ``torch._foreach_copy_`` to land.

It applies only where its result is the general path's to the byte: every
slice of the shard is a whole parameter of one dtype, small enough to pack (one
alone goes in a frame of its own, as the general path sends it;
:func:`SmallShare.of` says None otherwise), and each call checks the tensors
it is given; on anything else it returns None or False and the caller takes
the general path, which gives the error.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgpack
import torch

from paramserver.core.sharding import ShardPlan
from paramserver.wire.frames import PACK_BYTES, PreparedTensors, describe

__all__ = ["SmallShare"]


class SmallShare:
    """One shard's whole-parameter slices of a small model (see the module's text)."""

    __slots__ = ("descs", "dtype", "names", "nbytes", "shapes")

    def __init__(self, names: list[str], shapes: list[torch.Size], dtype: torch.dtype,
                 descs: bytes, nbytes: int) -> None:
        self.names = names  # and the slices' keys: a whole parameter's key is its name
        self.shapes = shapes
        self.dtype = dtype
        self.descs = descs  # the packed frame's descriptor list, msgpack'd
        self.nbytes = nbytes

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
        missing, of another shape or dtype, or not on the CPU."""
        flats = []
        dtype = self.dtype
        for name, shape in zip(self.names, self.shapes, strict=True):
            g = grads.get(name)
            if g is None or g.shape != shape or g.dtype is not dtype or not g.is_cpu:
                return None
            flats.append(g if len(shape) == 1 else g.reshape(-1))
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
        dtype = self.dtype
        targets = []
        for name, shape, value in zip(self.names, self.shapes, values, strict=True):
            p = params.get(name)
            if (p is None or p.shape != shape or p.dtype is not dtype or not p.is_cpu
                    or not p.is_contiguous() or value.dtype is not dtype
                    or value.shape != (p.numel(),) or not value.is_cpu):
                return False
            targets.append(p if len(shape) == 1 else p.view(-1))
        with torch.no_grad():  # targets are often nn.Parameters that require grad
            if len(targets) == 1:
                targets[0].copy_(values[0])
            else:
                torch._foreach_copy_(targets, values)
        return True
