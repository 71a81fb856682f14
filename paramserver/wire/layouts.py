"""One-frame layouts a peer sends again and again, checked once.

A small message is a header and one frame, a packed one or a single tensor's,
and the frame's descriptor (``[[dtype, [[key, shape, offset], ...]]]`` or
``[[key, dtype, shape]]``) repeats message after message: a worker's gradient
slices, a shard's weights. Checking it entry by entry, and
making a view per entry, is most of such a message's decode.
:class:`LayoutCache` keeps the descriptors that passed
:func:`paramserver.wire.protocol.decode`'s checks, with the tensors' keys, shapes
and sizes they gave; a message with the same descriptor gets its tensors in
two torch calls.

"The same" is exact, types included (``1.0`` or ``true`` where the checked
one had ``1`` is a different descriptor, refused by the full check): the
descriptor is the header's last value (:func:`~paramserver.wire.protocol.encode`
writes ``"t"`` last), so a header of encode's form (five pairs, no key twice,
``"t"`` last) must end with the very bytes of the one checked, and its decoded
value must equal it as well. What depends on the
message rather than the descriptor (the frame's length, the limits of the
decoding side) is checked on every use; whenever :meth:`PackedLayout.views`
says no, the caller runs the full check, so every refusal is the one it gives.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

__all__ = ["LayoutCache", "PackedLayout"]

_FIXMAP_5 = 0x85  # msgpack's first byte of a map of five pairs


class PackedLayout:
    """One checked descriptor list of a single frame, and what it gave (not empty)."""

    __slots__ = ("descs", "dtype", "flat1d", "keys", "largest", "limits", "nbytes", "numels",
                 "raw", "shapes")

    def __init__(self, descs: list[Any], tensors: dict[str, torch.Tensor],
                 limits: Any) -> None:
        self.descs = descs
        self.raw = msgpack.packb(descs, use_bin_type=True)  # what the header ends with
        self.limits = limits  # (the key, shape and count checks passed under these)
        views = list(tensors.values())
        self.dtype = views[0].dtype
        self.keys = list(tensors)
        self.shapes = [v.shape for v in views]
        self.numels = [v.numel() for v in views]
        self.flat1d = all(len(shape) == 1 for shape in self.shapes)
        itemsize = self.dtype.itemsize
        self.nbytes = sum(self.numels) * itemsize  # the frame's length: entries tile it
        self.largest = max(self.numels) * itemsize

    def views(self, buf: memoryview, tensors: dict[str, torch.Tensor], limits: Any) -> bool:
        """Put the frame's tensors (views of ``buf``) into the empty ``tensors``;
        False, with nothing added, when the full check must speak."""
        if (buf.nbytes != self.nbytes or self.nbytes > limits.max_total_bytes
                or self.largest > limits.max_tensor_bytes
                or (limits is not self.limits and limits != self.limits)):
            return False
        flat = torch.frombuffer(buf, dtype=self.dtype, count=self.nbytes // self.dtype.itemsize)
        if self.flat1d:
            if len(self.keys) == 1:
                tensors[self.keys[0]] = flat
            else:
                tensors.update(zip(self.keys, flat.split_with_sizes(self.numels), strict=True))
            return True
        at = 0
        for key, shape, numel in zip(self.keys, self.shapes, self.numels, strict=True):
            tensors[key] = flat[at:at + numel].view(shape)
            at += numel
        return True


class LayoutCache:
    """The one-frame layouts seen lately, by the length of their bytes; a few per
    length, so that several peers' layouts (a shard's workers, a worker's shards)
    all stay. Shared by the threads of a process: a lookup that races an eviction
    misses, and the full check runs."""

    PER_SIZE = 8
    SIZES = 16

    def __init__(self) -> None:
        self._by_size: dict[int, list[PackedLayout]] = {}

    def find(self, head: memoryview, header: dict[str, Any], limits: Any
             ) -> PackedLayout | None:
        """The layout of a header (its bytes ``head``, decoded ``header``) whose "t" is
        one checked before, or None. Only a map of five pairs, no key twice, "t" last
        (encode's form) qualifies: its last bytes are then "t"'s value's own, not those
        of a value nested in another field or of a repeated key."""
        if head[0] != _FIXMAP_5 or len(header) != 5 or next(reversed(header)) != "t":
            return None
        descs = header["t"]
        for size, layouts in list(self._by_size.items()):  # (a copy: threads may add)
            if size >= head.nbytes:
                continue
            tail = head[-size:]
            for layout in layouts:
                if tail == layout.raw and layout.descs == descs:
                    return layout
        return None

    def exact(self, raw: Any) -> PackedLayout | None:
        """The layout whose descriptor's msgpack bytes are ``raw`` (a buffer), or None:
        the same bytes are the same value, so no form of the header is needed."""
        view = memoryview(raw)
        layouts = self._by_size.get(view.nbytes)
        if layouts:
            for layout in list(layouts):  # (a copy: threads may add)
                if view == layout.raw:
                    return layout
        return None

    def remember(self, descs: list[Any], tensors: dict[str, torch.Tensor], limits: Any) -> None:
        layout = PackedLayout(descs, tensors, limits)
        if len(self._by_size) >= self.SIZES:
            self._by_size.clear()  # layouts of many sizes: start over rather than grow
        same = self._by_size.setdefault(len(layout.raw), [])
        if any(old.raw == layout.raw for old in same):
            return
        if len(same) >= self.PER_SIZE:
            same.pop(0)
        same.append(layout)
