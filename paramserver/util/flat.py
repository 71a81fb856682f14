"""One flat buffer per shard and dtype: a shard's slices are views into it.

A shard's weights of one dtype live in one contiguous tensor, in slice order,
and each slice is a view of its range. So is a sync round's buffer. Copying
the weights out (the shared-memory board, copy-on-write) is one copy per
dtype, and an optimizer whose update is elementwise can step the one flat
tensor per dtype instead of every slice: in a sync round the mean gradient is
already such a flat view, so that costs nothing; elsewhere the gradients are
joined into one tensor first, which pays for a small shard only (per-tensor
optimizer overhead dominates it, a copy does not).

Checkpoints keep their per-slice format: :func:`state_to_slices` and
:func:`state_from_slices` turn a flat optimizer's state into per-slice entries
and back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["ELEMENTWISE", "JOIN_BYTES", "FlatLayout", "lazy_zeros"]

#: optimizers whose step on a flat tensor equals the steps on its slices
#: (no per-tensor norm or shape-dependent rule)
ELEMENTWISE = frozenset({"sgd", "adam", "adamw", "adagrad", "rmsprop", "adamax", "nadam",
                         "radam", "asgd", "adadelta"})
#: below this many bytes per dtype an asynchronous shard joins gradients into one
#: tensor and steps it; above, the copy would cost more than the per-tensor steps
JOIN_BYTES = 1 << 20


def lazy_zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` zeros (64-byte aligned) whose pages the kernel maps only as they are
    written: calloc (numpy's zeros) takes fresh zero pages for a large buffer where
    torch.zeros writes every byte. A shard's weights so cost memory once seeded
    (INIT), not when a HELLO's plan is adopted."""
    raw = torch.from_numpy(np.zeros(n * dtype.itemsize + 64, dtype=np.uint8))
    skip = -raw.data_ptr() % 64
    return raw[skip:skip + n * dtype.itemsize].view(dtype)


class FlatLayout:
    """The flat buffers (dtype -> 1-D tensor) of some slices and their views."""

    def __init__(self, slices: Sequence[tuple[str, int, torch.dtype]]) -> None:
        self.groups: dict[torch.dtype, list[tuple[str, int, int]]] = {}
        sizes: dict[torch.dtype, int] = {}
        for key, numel, dtype in slices:
            start = sizes.get(dtype, 0)
            self.groups.setdefault(dtype, []).append((key, start, numel))
            sizes[dtype] = start + numel
        self.sizes = sizes
        self.index = {key: i for i, (key, _, _) in enumerate(slices)}  # per-slice order

    def zeros(self) -> tuple[dict[torch.dtype, torch.Tensor], dict[str, torch.Tensor]]:
        """New zeroed flat buffers and the views of every slice, in slice order."""
        flats = {d: lazy_zeros(n, d) for d, n in self.sizes.items()}
        return flats, self.views(flats, order=self.index)

    def empty(self) -> dict[str, torch.Tensor]:
        """Uninitialised slice views over fresh flat buffers (a sync round's buffer)."""
        return self.views({d: torch.empty(n, dtype=d) for d, n in self.sizes.items()},
                          order=self.index)

    def views(self, flats: Mapping[torch.dtype, torch.Tensor],
              order: Mapping[str, int]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for dtype, items in self.groups.items():
            for key, start, numel in items:
                out[key] = flats[dtype][start:start + numel]
        return dict(sorted(out.items(), key=lambda kv: order[kv[0]]))

    def rebind(self, flats: Mapping[torch.dtype, torch.Tensor],
               params: Mapping[str, torch.Tensor]) -> None:
        """Copy-on-write: each flat buffer to fresh storage, every slice view with it
        (the tensor objects stay, as the optimizer holds them)."""
        with torch.no_grad():
            for dtype, flat in flats.items():
                flat.data = flat.data.clone()
                for key, start, numel in self.groups[dtype]:
                    params[key].data = flat.data[start:start + numel]

    def join(self, dtype: torch.dtype, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The gradients of ``dtype``'s slices as one flat tensor: a view when they are
        consecutive ranges of one buffer already (a sync round's), else a copy."""
        items = self.groups[dtype]
        first = grads[items[0][0]]
        base = first.storage_offset()
        storage = first.untyped_storage().data_ptr()
        if all(grads[k].dtype == dtype and grads[k].is_contiguous()
               and grads[k].untyped_storage().data_ptr() == storage
               and grads[k].storage_offset() == base + start for k, start, _ in items):
            return first.as_strided((self.sizes[dtype],), (1,))
        return torch.cat([grads[k].reshape(-1).to(dtype) for k, _, _ in items])

    def state_to_slices(self, state: Mapping[str, Any],
                        flats: Sequence[torch.Tensor]) -> dict[str, Any]:
        """A flat optimizer's ``state_dict()`` as the per-slice one checkpoints hold:
        state tensors shaped like a flat buffer are split into its slices, others
        (a step count) are given to each slice."""
        dtypes = [f.dtype for f in flats]
        per_slice: dict[int, dict[str, Any]] = {}
        for index, entries in state["state"].items():
            dtype = dtypes[int(index)]
            for key, start, numel in self.groups[dtype]:
                row = per_slice.setdefault(self.index[key], {})
                for name, value in entries.items():
                    # copies: a checkpoint's tensors must not share memory
                    if isinstance(value, torch.Tensor) and value.shape == (self.sizes[dtype],):
                        row[name] = value[start:start + numel].clone()
                    elif isinstance(value, torch.Tensor):
                        row[name] = value.clone()
                    else:
                        row[name] = value
        groups = [{**g, "params": sorted(self.index[k] for d in (dtypes[i] for i in g["params"])
                                         for k, _, _ in self.groups[d])}
                  for g in state["param_groups"]]
        return {"state": per_slice, "param_groups": groups}

    def state_from_slices(self, state: Mapping[str, Any],
                          flats: Sequence[torch.Tensor]) -> dict[str, Any]:
        """:meth:`state_to_slices` undone: per-slice entries joined per flat buffer."""
        dtypes = [f.dtype for f in flats]
        out: dict[int, dict[str, Any]] = {}
        for i, dtype in enumerate(dtypes):
            got = [state["state"].get(self.index[k]) for k, _, _ in self.groups[dtype]]
            rows = [r for r in got if r is not None]
            if not rows or len(rows) != len(got):
                continue  # not stepped yet
            entry: dict[str, Any] = {}
            for name, value in rows[0].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and all(
                        isinstance(r.get(name), torch.Tensor) and r[name].numel() == n
                        for r, (_, _, n) in zip(rows, self.groups[dtype], strict=True)):
                    entry[name] = torch.cat([r[name].reshape(-1) for r in rows])
                else:
                    entry[name] = value
            out[i] = entry
        groups = [{**g, "params": list(range(len(dtypes)))} for g in state["param_groups"][:1]]
        return {"state": out, "param_groups": groups}
