"""ShardPlan: which shard owns which element range of which parameter.

The plan is a pure function of (parameter names, shapes and dtypes in
registration order, number of shards, chunk size, split flag), so every process
computes the same one without talking to the others; its :attr:`ShardPlan.hash`
is compared at HELLO to refuse a worker with another model or shard count.

Algorithm (the design's, after BytePS):

1. A parameter whose byte size exceeds ``chunk_bytes`` (and ``split`` is on) is
   cut into ``ceil(numel / chunk_elems)`` contiguous element ranges of the
   flattened tensor, where ``chunk_elems = max(1, chunk_bytes // itemsize)``.
   The ranges are as equal as possible (sizes differ by at most one element),
   so no chunk exceeds ``chunk_bytes`` and the pieces balance better than
   fixed-size chunks with a small remainder. When ``chunk_bytes`` is a multiple
   of the item size this is exactly ``ceil(nbytes / chunk_bytes)`` chunks.
2. Chunks are assigned greedily, largest first (ties: registration order, then
   start), each to the currently least-loaded shard in bytes (ties: lowest id).
   Hence max(shard bytes) - min(shard bytes) <= the largest chunk.

A shard may own no slice at all when there are fewer chunks than shards (for
example a tiny model on many shards); callers must allow an empty shard.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import torch

from paramserver.core.limits import DEFAULT_CHUNK_BYTES, PlanLimits
from paramserver.errors import ConfigError, RegistryError
from paramserver.sparse.shard import TableDescription, TableSpec
from paramserver.util.dtypes import PARAM_DTYPES, copy_bytes, copy_to_address, dtype_name

__all__ = [
    "DTYPES",
    "ParamDescription",
    "ParamSpec",
    "PlanDescription",
    "PlanLimits",
    "ShardPlan",
    "Slice",
    "dtype_name",
]

# Dtypes a parameter may have: the one table in paramserver.util.dtypes.
DTYPES = PARAM_DTYPES

_MAX_LISTED = 10  # names listed per category in diff() before "... and N more"


@dataclass(frozen=True)
class ParamSpec:
    """One model parameter: its name, shape and dtype (e.g. ``"float32"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"parameter name must be a non-empty string, got {self.name!r}")
        try:
            shape = tuple(int(d) for d in self.shape)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"parameter {self.name!r}: bad shape {self.shape!r}") from exc
        if any(d < 0 for d in shape):
            raise ConfigError(f"parameter {self.name!r}: negative dimension in {shape}")
        # Accept lists (from JSON) but store a tuple so specs hash and compare by value.
        object.__setattr__(self, "shape", shape)
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"parameter {self.name!r}: unknown dtype {self.dtype!r}; "
                f"allowed: {', '.join(DTYPES)}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Slice:
    """A contiguous element range ``[start, stop)`` of one flattened parameter.

    ``key`` is the parameter name when the tensor is not split, else
    ``f"{name}[{start}:{stop}]"``; it is unique within a plan and is what
    travels on the wire.
    """

    key: str
    name: str
    start: int
    stop: int
    shard: int
    dtype: str

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize



class ParamDescription(TypedDict):
    name: str
    shape: list[int]
    dtype: str


class PlanDescription(TypedDict):
    """A plan as JSON (:meth:`ShardPlan.describe`): what HELLO carries, a checkpoint
    keeps and the plan's hash is taken of."""

    params: list[ParamDescription]
    num_shards: int
    chunk_bytes: int
    split: bool
    sparse: NotRequired[list[TableDescription]]  # only a plan with tables has it


class ShardPlan:
    """Deterministic assignment of parameter element ranges to shards."""

    DEFAULT_CHUNK_BYTES = DEFAULT_CHUNK_BYTES

    def __init__(
        self,
        params: Sequence[ParamSpec],
        num_shards: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        split: bool = True,
        sparse: Sequence[TableSpec] = (),
    ) -> None:
        params = tuple(params)
        # row-sparse tables (paramserver/sparse/shard.py) are split by row hash, not chunked
        self.sparse: tuple[TableSpec, ...] = tuple(sparse)
        if not params and not self.sparse:
            raise ConfigError("a shard plan needs at least one parameter; the list is empty")
        for p in params:
            if not isinstance(p, ParamSpec):
                raise ConfigError(f"expected ParamSpec, got {type(p).__name__}: {p!r}")
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ConfigError(f"num_shards must be an integer >= 1, got {num_shards!r}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
        names = [p.name for p in params] + [t.name for t in self.sparse]
        dups = sorted(n for n, c in Counter(names).items() if c > 1)
        if dups:
            raise ConfigError(f"duplicate parameter names: {', '.join(dups)}")

        self.params: tuple[ParamSpec, ...] = params
        self.num_shards: int = num_shards
        self.chunk_bytes: int = chunk_bytes
        self.split: bool = bool(split)
        self._index = {p.name: i for i, p in enumerate(params)}
        self._param = {p.name: p for p in params}

        slices = self._assign(self._chunks())
        order = sorted(slices, key=lambda s: (self._index[s.name], s.start))
        self.slices: tuple[Slice, ...] = tuple(order)
        self._by_key = {s.key: s for s in self.slices}
        self._by_shard: dict[int, tuple[Slice, ...]] = {
            k: tuple(s for s in self.slices if s.shard == k) for k in range(num_shards)
        }
        self._by_name: dict[str, tuple[Slice, ...]] = {
            p.name: tuple(s for s in self.slices if s.name == p.name) for p in params
        }
        self._hash: str | None = None

    # -- construction -------------------------------------------------------

    @classmethod
    def from_module(
        cls,
        module: torch.nn.Module,
        num_shards: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        split: bool = True,
    ) -> ShardPlan:
        """Plan for ``module.named_parameters()`` in registration order (shared ones once),
        and a sparse table for each submodule with a ``table_spec(name)`` method (a
        ``ShardedEmbedding``), named by its path in the module."""
        specs = [
            ParamSpec(name, tuple(p.shape), dtype_name(p.dtype))
            for name, p in module.named_parameters()
        ]
        tables = [m.table_spec(name) for name, m in module.named_modules()
                  if callable(getattr(m, "table_spec", None))]
        return cls(specs, num_shards, chunk_bytes, split, tables)

    @classmethod
    def from_description(cls, d: Mapping[str, Any], limits: PlanLimits | None = None
                         ) -> ShardPlan:
        """Rebuild a plan from :meth:`describe` output; malformed input (or, with
        ``limits``, a plan over them) -> :class:`ConfigError`."""
        return cls(*cls.checked_plan(d, limits))

    @classmethod
    def checked_plan(cls, d: Any, limits: PlanLimits | None = None
                     ) -> tuple[list[ParamSpec], int, int, bool, tuple[TableSpec, ...]]:
        """(params, num_shards, chunk_bytes, split, sparse tables) of a description,
        validated without building the plan; with ``limits``, what it would cost its
        shards in all (:meth:`PlanLimits.cost`) is bounded too. Raises ConfigError."""
        specs, num_shards, chunk_bytes, split = cls.checked(d, limits)
        tables = cls.checked_sparse(d, limits)
        if limits is not None:
            cost = limits.cost(sum(p.nbytes for p in specs), tables)
            if cost > limits.max_model_bytes:
                raise ConfigError(f"the plan would cost its shards {cost} bytes (weights, "
                                  f"optimizer state, table rows, ids and versions) > "
                                  f"{limits.max_model_bytes} (--max-model-bytes)")
        return specs, num_shards, chunk_bytes, split, tables

    @staticmethod
    def checked_sparse(d: Any, limits: PlanLimits | None = None) -> tuple[TableSpec, ...]:
        """The sparse tables of a description (none: ``()``), validated; with ``limits``
        their declared bytes count against ``max_model_bytes``. Raises ConfigError."""
        raw = d.get("sparse", []) if isinstance(d, Mapping) else None
        if not isinstance(raw, list | tuple):
            raise ConfigError("malformed shard plan description: sparse must be a list")
        if limits is not None and len(raw) > limits.max_params:
            raise ConfigError(f"{len(raw)} sparse tables > the limit {limits.max_params}")
        tables = tuple(TableSpec.from_description(t) for t in raw)
        if limits is not None and limits.cost(0, tables) > limits.max_model_bytes:
            raise ConfigError(f"the sparse tables would cost over {limits.max_model_bytes} "
                              f"bytes (--max-model-bytes)")
        return tables

    @staticmethod
    def checked(d: Any, limits: PlanLimits | None = None
                ) -> tuple[list[ParamSpec], int, int, bool]:
        """(params, num_shards, chunk_bytes, split) of a description, validated without
        building the plan: with ``limits``, its declared sizes and chunk count are
        computed arithmetically and bounded. Raises :class:`ConfigError`."""
        try:
            raw = d["params"]
            if not isinstance(raw, list | tuple):
                raise TypeError("params must be a list")
            if limits is not None and len(raw) > limits.max_params:
                raise ConfigError(f"{len(raw)} parameters > the limit {limits.max_params}")
            specs = []
            for p in raw:
                shape = p["shape"]
                if not isinstance(shape, list | tuple) or (
                        limits is not None and len(shape) > limits.max_ndim):
                    raise ConfigError(f"parameter {p.get('name')!r}: bad shape {shape!r}")
                if any(isinstance(x, bool) or not isinstance(x, int) for x in shape):
                    raise ConfigError(f"parameter {p.get('name')!r}: dimensions must be "
                                      f"integers, got {shape!r}")
                specs.append(ParamSpec(p["name"], tuple(shape), p["dtype"]))
            num_shards, chunk_bytes, split = d["num_shards"], d["chunk_bytes"], d["split"]
            dups = sorted(n for n, c in Counter(p.name for p in specs).items() if c > 1)
            if dups:
                raise ConfigError(f"duplicate parameter names: {_listing(dups)}")
        except ConfigError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed shard plan description: {exc!r}") from exc
        for name, value in (("num_shards", num_shards), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(split, bool):
            raise ConfigError(f"split must be true or false, got {split!r}")
        if limits is not None:
            if split and chunk_bytes < limits.min_chunk_bytes:
                raise ConfigError(f"chunk_bytes {chunk_bytes} < the minimum "
                                  f"{limits.min_chunk_bytes}")
            total = chunks = 0
            for p in specs:
                total += p.nbytes
                if total * limits.dense_copies > limits.max_model_bytes:
                    raise ConfigError(f"the model would cost over {limits.max_model_bytes} "
                                      f"bytes (--max-model-bytes)")
                n = 1
                if split and p.nbytes > chunk_bytes:
                    n = -(-p.numel // max(1, chunk_bytes // p.itemsize))
                chunks += n
            if chunks > limits.max_chunks:
                raise ConfigError(f"the plan cuts the model into {chunks} chunks > the limit "
                                  f"{limits.max_chunks}")
            if num_shards > limits.max_chunks:
                raise ConfigError(f"{num_shards} shards > the limit {limits.max_chunks}")
        return specs, num_shards, chunk_bytes, split

    @staticmethod
    def description_hash(specs: Sequence[ParamSpec], num_shards: int, chunk_bytes: int,
                         split: bool, sparse: Sequence[TableSpec] = ()) -> str:
        """:attr:`hash` of the plan these would build, without building it."""
        desc = ShardPlan.description(specs, num_shards, chunk_bytes, split, sparse)
        blob = json.dumps(desc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def _chunks(self) -> list[tuple[int, int, int]]:
        """(param index, start, stop) of every chunk, in registration order."""
        chunks: list[tuple[int, int, int]] = []
        for i, p in enumerate(self.params):
            n = 1
            if self.split and p.nbytes > self.chunk_bytes:
                chunk_elems = max(1, self.chunk_bytes // p.itemsize)
                n = -(-p.numel // chunk_elems)
            base, extra = divmod(p.numel, n)
            start = 0
            for j in range(n):
                stop = start + base + (1 if j < extra else 0)
                chunks.append((i, start, stop))
                start = stop
        return chunks

    def _assign(self, chunks: list[tuple[int, int, int]]) -> list[Slice]:
        counts: dict[int, int] = {}
        for i, _, _ in chunks:
            counts[i] = counts.get(i, 0) + 1

        def nbytes(c: tuple[int, int, int]) -> int:
            return (c[2] - c[1]) * self.params[c[0]].itemsize

        # Largest first; ties by registration order then start: fully deterministic.
        ordered = sorted(chunks, key=lambda c: (-nbytes(c), c[0], c[1]))
        heap = [(0, k) for k in range(self.num_shards)]  # (load bytes, shard id)
        out: list[Slice] = []
        for i, start, stop in ordered:
            load, shard = heapq.heappop(heap)
            p = self.params[i]
            key = p.name if counts[i] == 1 else f"{p.name}[{start}:{stop}]"
            out.append(Slice(key, p.name, start, stop, shard, p.dtype))
            heapq.heappush(heap, (load + nbytes((i, start, stop)), shard))
        return out

    # -- queries ------------------------------------------------------------

    def shard_slices(self, shard: int) -> tuple[Slice, ...]:
        """Slices owned by ``shard``, ordered by (registration order, start); may be empty."""
        if shard not in self._by_shard:
            raise ConfigError(f"shard {shard!r} out of range 0..{self.num_shards - 1}")
        return self._by_shard[shard]

    def slices_of(self, name: str) -> tuple[Slice, ...]:
        """The slices of parameter ``name``, ordered by start."""
        if name not in self._by_name:
            raise RegistryError(f"parameter {name!r} is not in the shard plan")
        return self._by_name[name]

    def slice_for(self, key: str) -> Slice:
        """The slice with this wire key; unknown keys raise :class:`RegistryError`."""
        try:
            return self._by_key[key]
        except KeyError:
            raise RegistryError(f"slice key {key!r} is not in the shard plan") from None

    def param(self, name: str) -> ParamSpec:
        """The spec of parameter ``name``; unknown names raise :class:`RegistryError`."""
        try:
            return self._param[name]
        except KeyError:
            raise RegistryError(f"parameter {name!r} is not in the shard plan") from None

    def shard_bytes(self, shard: int) -> int:
        return sum(s.nbytes for s in self.shard_slices(shard))

    def describe(self) -> PlanDescription:
        """Canonical JSON-able description; everything the plan is computed from."""
        return self.description(self.params, self.num_shards, self.chunk_bytes, self.split,
                                self.sparse)

    @staticmethod
    def description(specs: Sequence[ParamSpec], num_shards: int, chunk_bytes: int,
                    split: bool, sparse: Sequence[TableSpec] = ()) -> PlanDescription:
        """:meth:`describe` of the plan these would build, without building it."""
        out = PlanDescription(
            params=[ParamDescription(name=p.name, shape=list(p.shape), dtype=p.dtype)
                    for p in specs],
            num_shards=num_shards, chunk_bytes=chunk_bytes, split=bool(split))
        if sparse:  # a plan without tables describes (and hashes) as it always did
            out["sparse"] = [t.describe() for t in sparse]
        return out

    @property
    def hash(self) -> str:
        """sha256 hex of the canonical JSON of :meth:`describe`; equal in every process."""
        if self._hash is None:
            self._hash = self.description_hash(self.params, self.num_shards, self.chunk_bytes,
                                               self.split, self.sparse)
        return self._hash

    def diff(self, other: Mapping[str, Any]) -> str:
        """Say in words how ``other`` (another plan's :meth:`describe`) differs; "" if equal."""
        # compared as described, never built: the other plan may come from a peer,
        # and building it could cost in proportion to the sizes it declares
        try:
            their_params, their_shards, their_chunk, their_split = ShardPlan.checked(
                other, PlanLimits(max_model_bytes=1 << 62, max_chunks=1 << 62))
        except ConfigError as exc:
            return f"the other plan's description is unusable: {exc}"
        their_param = {p.name: p for p in their_params}
        parts: list[str] = []
        if self.num_shards != their_shards:
            parts.append(f"number of shards {self.num_shards} vs {their_shards}")
        if self.chunk_bytes != their_chunk:
            parts.append(f"chunk size {self.chunk_bytes} vs {their_chunk} bytes")
        if self.split != their_split:
            parts.append(f"split {self.split} vs {their_split}")
        ours_names = [p.name for p in self.params]
        their_names = [p.name for p in their_params]
        only_ours = [n for n in ours_names if n not in their_param]
        only_theirs = [n for n in their_names if n not in self._param]
        if only_ours:
            parts.append(f"parameters only in ours: {_listing(only_ours)}")
        if only_theirs:
            parts.append(f"parameters only in theirs: {_listing(only_theirs)}")
        shapes, dtypes = [], []
        for p in self.params:
            q = their_param.get(p.name)
            if q is None:
                continue
            if p.shape != q.shape:
                shapes.append(f"{p.name}: {p.shape} vs {q.shape}")
            if p.dtype != q.dtype:
                dtypes.append(f"{p.name}: {p.dtype} vs {q.dtype}")
        if shapes:
            parts.append(f"shape mismatch {_listing(shapes)}")
        if dtypes:
            parts.append(f"dtype mismatch {_listing(dtypes)}")
        common_ours = [n for n in ours_names if n in their_param]
        common_theirs = [n for n in their_names if n in self._param]
        if common_ours != common_theirs:
            at = next(
                i for i, (a, b) in enumerate(zip(common_ours, common_theirs, strict=True)) if a != b
            )
            parts.append(
                f"parameters registered in a different order "
                f"(first at position {at}: {common_ours[at]} vs {common_theirs[at]})"
            )
        theirs_sparse = other.get("sparse", []) if isinstance(other, Mapping) else []
        if [t.describe() for t in self.sparse] != theirs_sparse:
            parts.append(f"sparse tables {[t.name for t in self.sparse]} vs "
                         f"{[t.get('name') if isinstance(t, dict) else t for t in theirs_sparse]}"
                         f" (or their sizes, init or seed)")
        if not parts:
            return ""
        return "shard plans differ (ours vs theirs): " + "; ".join(parts)

    # -- tensors ------------------------------------------------------------

    def split_tensors(
        self, name_to_tensor: Mapping[str, torch.Tensor]
    ) -> dict[int, dict[str, torch.Tensor]]:
        """shard -> {slice key -> 1-D detached view of the flattened parameter range}.

        Every shard id appears, possibly with an empty dict. Views share memory
        with contiguous inputs (no copy); a non-contiguous input is copied once.
        Extra names in ``name_to_tensor`` are ignored; missing ones, or a wrong
        shape or dtype, raise :class:`ConfigError`.
        """
        flat: dict[str, torch.Tensor] = {}
        for p in self.params:
            t = self._checked(p, name_to_tensor).detach()
            flat[p.name] = t if t.dim() == 1 else t.reshape(-1)  # 1-D: reshape is a no-op
        out: dict[int, dict[str, torch.Tensor]] = {k: {} for k in range(self.num_shards)}
        for s in self.slices:
            f = flat[s.name]
            # a slice that is its whole parameter (a small model's): no view of a view
            out[s.shard][s.key] = f if s.start == 0 and s.stop == f.numel() else f[s.start:s.stop]
        return out

    def assemble_into(
        self,
        name_to_tensor: Mapping[str, torch.Tensor],
        key_to_slice_tensor: Mapping[str, torch.Tensor],
    ) -> None:
        """Copy slice values into their ranges of the full tensors, in place and bit-exact.

        ``key_to_slice_tensor`` may hold any subset of the plan's keys (e.g. one
        shard's reply). Slice tensors may live on another device (copied over);
        their dtype must equal the parameter's, so nothing is silently rounded.
        """
        pending: dict[str, list[tuple[Slice, torch.Tensor]]] = {}
        for key, value in key_to_slice_tensor.items():
            s = self.slice_for(key)
            if value.numel() != s.numel:
                raise ConfigError(
                    f"slice {key!r} has {value.numel()} elements, the plan says {s.numel}"
                )
            if value.dtype != DTYPES[s.dtype]:
                raise ConfigError(f"slice {key!r} has dtype {value.dtype}, the plan says {s.dtype}")
            pending.setdefault(s.name, []).append((s, value))
        if self._assemble_direct(name_to_tensor, pending):
            return
        with torch.no_grad():  # targets are often nn.Parameters that require grad
            for name, items in pending.items():
                target = self._checked(self._param[name], name_to_tensor)
                # view(-1) aliases the target; a non-contiguous one is copied back at the end.
                flat = target.view(-1) if target.is_contiguous() else target.reshape(-1).clone()
                for s, value in items:
                    copy_bytes(flat[s.start : s.stop], value.detach())
                if not target.is_contiguous():
                    target.copy_(flat.view(target.shape))

    def _assemble_direct(self, name_to_tensor: Mapping[str, torch.Tensor],
                         pending: Mapping[str, list[tuple[Slice, torch.Tensor]]]) -> bool:
        """The common case of :meth:`assemble_into` (contiguous CPU targets and slices,
        checked as it checks them) as one ``memmove`` per slice into the target's
        bytes, without a view per slice (a few us each, which a small model's pull
        is made of). False, with nothing copied: a case it leaves to the general path."""
        targets = []
        for name, items in pending.items():
            target = self._checked(self._param[name], name_to_tensor)
            # (is_cpu: device.type == "cpu" without building a torch.device)
            if not target.is_cpu or not target.is_contiguous():
                return False
            for _, value in items:
                if not value.is_cpu or not value.is_contiguous():
                    return False
            targets.append((target, items))
        for target, items in targets:
            base, size = target.data_ptr(), target.element_size()
            for s, value in items:  # (the numel check above proved value's size)
                copy_to_address(base + s.start * size, value)
        return True

    def _checked(self, p: ParamSpec, name_to_tensor: Mapping[str, torch.Tensor]) -> torch.Tensor:
        t = name_to_tensor.get(p.name)
        if t is None:
            raise ConfigError(f"no tensor given for parameter {p.name!r}")
        if t.shape != p.shape:  # torch.Size is a tuple: no copy needed to compare
            raise ConfigError(f"parameter {p.name!r} has shape {tuple(t.shape)}, plan: {p.shape}")
        if t.dtype != p.torch_dtype:
            raise ConfigError(f"parameter {p.name!r} has dtype {t.dtype}, plan: {p.dtype}")
        return t

    # -- dunder -------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardPlan) and self.describe() == other.describe()

    def __hash__(self) -> int:
        return hash(self.hash)

    def __repr__(self) -> str:
        return (
            f"ShardPlan({len(self.params)} params, {len(self.slices)} slices, "
            f"num_shards={self.num_shards}, chunk_bytes={self.chunk_bytes}, "
            f"split={self.split}, hash={self.hash[:12]})"
        )


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return f"{shown} ... and {more} more" if more > 0 else shown
