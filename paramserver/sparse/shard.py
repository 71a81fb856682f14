"""Row-sparse embedding tables on the shards: placement, initialization, updates. No I/O.

A table of ``rows x dim`` is split across the shards by row, by a hash of the
row id (:func:`shard_of`): Zipfian ids (a few very hot rows, usually the small
ids) spread evenly, where ranges would put every hot row on one shard. A shard
holds only its rows, in ascending id order (:func:`owned_rows`), so a row's
place on its shard is a binary search away and an id sent to the wrong shard is
caught by the same search.

Tables are initialized on the shards from the plan (:class:`TableSpec`: a
rule and a seed), in blocks of :data:`INIT_BLOCK` global rows, each drawn from
its own generator: a row's initial value does not depend on the number of
shards, and :func:`full_table` reproduces the whole table for a reference run.
``init="pretrained"`` tables wait for a worker to stream their rows in (SINIT).

:class:`SparseShard` holds one shard's tables, their optimizer (torch.optim
on ``torch.sparse_coo`` gradients: SGD, Adagrad, SparseAdam; SGD with momentum
is applied lazily, to the rows a step touches) and what a push does to them:
checked (:meth:`SparseShard.check_push`), stepped (:meth:`SparseShard.apply`), or
held in the open sync round and stepped once as its sample-weighted mean
(:meth:`SparseShard.hold`, :meth:`SparseShard.close_round`). Which push is
applied, held, refused or answered again is not decided here: the shard core's
rules decide it, as for dense slices (paramserver/core/rows.py, core/rules.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import torch

from paramserver.errors import ConfigError, ErrorCode, ProtocolError

__all__ = ["INIT_BLOCK", "INIT_RULES", "SPARSE_OPTIMIZERS", "RowPush", "SparseMeta",
           "SparseShard", "SparseTable", "TableDescription", "TableSpec", "full_table",
           "init_rows", "owned_rows", "shard_of"]

#: rows drawn from one generator at initialization (the unit of determinism)
INIT_BLOCK = 4096
INIT_RULES = ("normal", "uniform", "zeros", "pretrained")
#: server optimizer name -> how a sparse table trains with it
SPARSE_OPTIMIZERS = ("sgd", "adagrad", "adam", "sparseadam")
_TABLE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MAX_ROWS = 1 << 40
#: bytes a shard keeps per table row besides its values: its id and the version
#: of the last step that changed it (int64 each)
ROW_OVERHEAD = 16
#: row ids one SPULL, SPUSH or SINIT may carry, all its tables together: what a
#: request may make a shard gather, step or answer is bounded by it (a reply of at
#: most this many rows), whatever the request repeats
MAX_REQUEST_ROWS = 1 << 18
#: tables STATS lists (the rest are counted in tables_count)
STATS_TABLES = 512


class TableDescription(TypedDict):
    """A table in a plan's description (JSON: HELLO, the config, a checkpoint)."""

    name: str
    rows: int
    dim: int
    dtype: str
    init: str
    std: float
    seed: int


class SparseMeta(TypedDict):
    """What a checkpoint's metadata keeps of a shard's sparse tables, beside their
    tensors (:meth:`SparseShard.state_dict`)."""

    version: int
    rounds: int
    initialized: dict[str, bool]  # table -> seeded
    tables: list[TableDescription]
    param_groups: list[dict[str, Any]]  # the optimizer's, as torch's state_dict has them


@dataclass(frozen=True)
class TableSpec:
    """A row-sparse table: ``rows x dim`` of ``dtype``, initialized on the shards by
    ``init`` (normal(0, std), uniform(-bound, bound), zeros, or pretrained: streamed
    in by a worker) from ``seed``."""

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    init: str = "normal"
    std: float = 1.0  # normal: the standard deviation; uniform: the bound
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"table name must be a non-empty string without '/', "
                              f"got {self.name!r}")
        for what in ("rows", "dim", "seed"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if what != "seed" else 0):
                raise ConfigError(f"table {self.name!r}: {what} must be a positive integer, "
                                  f"got {v!r}")
        if self.rows > MAX_ROWS:
            raise ConfigError(f"table {self.name!r}: {self.rows} rows > {MAX_ROWS}")
        if self.dtype not in _TABLE_DTYPES:
            raise ConfigError(f"table {self.name!r}: dtype must be one of "
                              f"{', '.join(_TABLE_DTYPES)}, got {self.dtype!r}")
        if self.init not in INIT_RULES:
            raise ConfigError(f"table {self.name!r}: init must be one of "
                              f"{', '.join(INIT_RULES)}, got {self.init!r}")
        if isinstance(self.std, bool) or not isinstance(self.std, int | float) or not (
                math.isfinite(self.std) and self.std >= 0):
            raise ConfigError(f"table {self.name!r}: std must be finite and >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TABLE_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.dim * self.torch_dtype.itemsize

    def held_bytes(self, copies: int) -> int:
        """What a shard keeps for this table: ``copies`` of its values (the rows and
        their optimizer state), and per row its id and last step's version."""
        return self.nbytes * copies + self.rows * ROW_OVERHEAD

    def describe(self) -> TableDescription:
        return TableDescription(name=self.name, rows=self.rows, dim=self.dim, dtype=self.dtype,
                                init=self.init, std=float(self.std), seed=self.seed)

    @classmethod
    def from_description(cls, d: Any) -> TableSpec:
        try:
            return cls(d["name"], d["rows"], d["dim"], d["dtype"], d["init"], d["std"],
                       d["seed"])
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed sparse table description: {exc!r}") from exc


# ---------------------------------------------------------------------- placement

def shard_of(ids: torch.Tensor | np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each row id: Fibonacci hashing (the high bits of id x 2^64/phi),
    so consecutive hot ids land on different shards."""
    a = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = (a * _GOLDEN) >> np.uint64(32)
    return (h % np.uint64(num_shards)).astype(np.int64)


def owned_rows(rows: int, num_shards: int, shard: int) -> torch.Tensor:
    """The ids shard ``shard`` holds, ascending (int64)."""
    out = []
    for start in range(0, rows, 1 << 20):  # bounded temporaries for large tables
        ids = np.arange(start, min(rows, start + (1 << 20)), dtype=np.int64)
        out.append(ids[shard_of(ids, num_shards) == shard])
    return torch.from_numpy(np.concatenate(out) if out else np.zeros(0, np.int64))


# ---------------------------------------------------------------------- initialization

def _block(spec: TableSpec, block: int) -> torch.Tensor:
    n = min(INIT_BLOCK, spec.rows - block * INIT_BLOCK)
    out = torch.empty(n, spec.dim, dtype=spec.torch_dtype)
    if spec.init in ("zeros", "pretrained"):
        return out.zero_()
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + block) % (1 << 63))
    if spec.init == "normal":
        return out.normal_(0.0, float(spec.std), generator=gen)
    return out.uniform_(-float(spec.std), float(spec.std), generator=gen)


def init_rows(spec: TableSpec, ids: torch.Tensor) -> torch.Tensor:
    """The initial values of rows ``ids`` (ascending), the same whatever the shard count."""
    out = torch.empty(len(ids), spec.dim, dtype=spec.torch_dtype)
    if len(ids) == 0:
        return out
    blocks = ids // INIT_BLOCK
    bounds = torch.searchsorted(blocks, torch.unique(blocks), right=True)
    lo = 0
    for hi in bounds.tolist():
        b = int(blocks[lo])
        out[lo:hi] = _block(spec, b)[ids[lo:hi] - b * INIT_BLOCK]
        lo = hi
    return out


def full_table(spec: TableSpec) -> torch.Tensor:
    """The whole initial table (for reference runs and small tables)."""
    return init_rows(spec, torch.arange(spec.rows))


# ---------------------------------------------------------------------- one table

def check_ids(ids: Any, what: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"{what}: row ids must be a 1-D int64 tensor")
    return ids


class SparseTable:
    """One table's rows on one shard, and what its optimizer keeps per row."""

    def __init__(self, spec: TableSpec, num_shards: int, shard: int) -> None:
        self.spec = spec
        self.ids = owned_rows(spec.rows, num_shards, shard)
        self.num_shards, self.shard = num_shards, shard
        self.weight = init_rows(spec, self.ids)
        # the version of the shard's last step that changed each row (-1: never)
        self.updated = torch.full((len(self.ids),), -1, dtype=torch.int64)
        self.initialized = spec.init != "pretrained"

    def local(self, ids: torch.Tensor, what: str, unique: bool = True) -> torch.Tensor:
        """Positions of ``ids`` in this shard's rows; a bad, foreign or repeated id ->
        :class:`ProtocolError` (BAD_TENSOR)."""
        check_ids(ids, what)
        if len(ids) == 0:
            return ids
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.spec.rows:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{what}: row id out of range "
                                f"0..{self.spec.rows - 1} in table {self.spec.name!r}")
        pos = torch.searchsorted(self.ids, ids).clamp_(max=max(0, len(self.ids) - 1))
        if len(self.ids) == 0 or not bool((self.ids[pos] == ids).all()):
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{what}: a row id of table "
                                f"{self.spec.name!r} belongs to another shard")
        if unique and len(torch.unique(pos)) != len(pos):
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{what}: row ids must be unique")
        return pos

    def check_values(self, values: Any, n: int, what: str) -> torch.Tensor:
        if (not isinstance(values, torch.Tensor) or values.dtype != self.spec.torch_dtype
                or tuple(values.shape) != (n, self.spec.dim)):
            got = (f"{values.dtype} {tuple(values.shape)}" if isinstance(values, torch.Tensor)
                   else type(values).__name__)
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{what}: values of table "
                                f"{self.spec.name!r} must be {self.spec.dtype} "
                                f"({n}, {self.spec.dim}), got {got}")
        if n and not bool(torch.isfinite(values).all()):
            raise ProtocolError(ErrorCode.NONFINITE, f"{what}: values of table "
                                f"{self.spec.name!r} hold NaN or Inf; not applied")
        return values


# ---------------------------------------------------------------------- the optimizer

class SparseStepper:
    """torch.optim over the tables' weights, fed ``sparse_coo`` gradients of the
    touched rows only. SGD with momentum keeps a per-row buffer applied lazily
    (a row's momentum decays only when the row is touched), as torch has no
    sparse momentum."""

    def __init__(self, name: str, args: Mapping[str, Any],
                 weights: Sequence[torch.Tensor]) -> None:
        name = name.lower()
        if name not in SPARSE_OPTIMIZERS:
            raise ConfigError(f"sparse tables train with {', '.join(SPARSE_OPTIMIZERS)}; "
                              f"the shards run {name!r}")
        args = dict(args)
        self.lr = float(args.get("lr", 0.1 if name == "sgd" else 0.01))
        self.momentum = float(args.get("momentum", 0.0)) if name == "sgd" else 0.0
        params = list(weights) or [torch.zeros(1, 1)]
        opt: torch.optim.Optimizer
        if name == "sgd":
            opt = torch.optim.SGD(params, lr=self.lr)
        elif name == "adagrad":
            keep: dict[str, Any] = {k: args[k] for k in
                                    ("lr_decay", "initial_accumulator_value", "eps") if k in args}
            opt = torch.optim.Adagrad(params, lr=self.lr, **keep)
        else:
            keep = {k: (tuple(args[k]) if k == "betas" else args[k])
                    for k in ("betas", "eps") if k in args}
            opt = torch.optim.SparseAdam(params, lr=self.lr, **keep)
        self.optimizer = opt
        self.buffers: dict[int, torch.Tensor] = {}  # lazy momentum, per table index

    def step(self, index: int, weight: torch.Tensor, rows: torch.Tensor,
             grad: torch.Tensor, scale: float) -> None:
        """Rows ``rows`` (positions, unique) of table ``index`` step on ``grad``,
        the learning rate scaled by ``scale``."""
        if self.momentum:
            buf = self.buffers.setdefault(index, torch.zeros_like(weight))
            b = buf[rows].mul_(self.momentum).add_(grad)
            buf[rows] = b
            grad = b
        weight.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), grad, weight.shape,
                                              check_invariants=False)
        group = self.optimizer.param_groups[0]
        saved = group["lr"]
        group["lr"] = saved * scale
        try:
            # only this table has a gradient: torch.optim skips the others
            self.optimizer.step()
        finally:
            group["lr"] = saved
            weight.grad = None


# ---------------------------------------------------------------------- one shard

@dataclass(frozen=True)
class RowPush:
    """A sparse push checked against the tables: per table, the positions of its rows
    and their gradient values; ``rows`` in all, ``stale_rows`` of them changed at or
    after the version the push was read at (what a staleness policy is told)."""

    steps: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]
    rows: int
    stale_rows: int


@dataclass
class _Held:
    """The open sync round's rows: per worker, per table, positions and weighted
    values (summed by worker id, so that a seed gives the same rows bit for bit)."""

    rows: dict[int, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    values: dict[int, dict[str, list[torch.Tensor]]] = field(default_factory=dict)

    def ordered(self) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per table, every worker's positions and values, lowest worker id first."""
        out: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for worker in sorted(self.rows):
            for name, pos in self.rows[worker].items():
                rows, values = out.setdefault(name, ([], []))
                rows += pos
                values += self.values[worker][name]
        return out


class SparseShard:
    """One shard's sparse tables, their optimizer, and what a push does to them.

    ``live()`` names the live workers (the dense core's live set): a pretrained
    table's seeder that left it is replaced by the next live one.
    """

    def __init__(self, specs: Sequence[TableSpec], num_shards: int, shard: int, *,
                 optimizer: str, optimizer_args: Mapping[str, Any],
                 live: Callable[[], Collection[int]], build: bool = True) -> None:
        self.specs = tuple(specs)
        self.num_shards = num_shards
        # the tables cost their rows, ids and version counters: made by build(), which
        # a server runs once the plan's owner seeds (not when a HELLO brings the plan)
        self.tables: dict[str, SparseTable] = {}
        self.index = {s.name: i for i, s in enumerate(self.specs)}
        self.shard = shard
        self.live = live
        self._optimizer = (optimizer, dict(optimizer_args))
        # (an optimizer that cannot train the tables is refused now, at no cost)
        self.stepper = SparseStepper(optimizer, optimizer_args, [])
        self.built = False
        self.version = 0
        self.held = _Held()  # the open sync round's rows
        self.rounds = 0
        # pretrained tables: the worker streaming them in, and (parts in, parts)
        self.seeder: int | None = None
        self.seed_parts: tuple[set[int], int] = (set(), 0)
        if build:
            self.build()

    def build(self) -> None:
        """Allocate and draw the tables and their optimizer: seconds for a large plan,
        so a server runs it in a thread (``built`` turns True last, once all is in)."""
        if self.built:
            return
        tables = {s.name: SparseTable(s, self.num_shards, self.shard) for s in self.specs}
        name, args = self._optimizer
        self.stepper = SparseStepper(name, args, [t.weight for t in tables.values()])
        self.tables = tables
        self.built = True

    @classmethod
    def for_server(cls, plan: Any, config: Any, live: Callable[[], Collection[int]]
                   ) -> SparseShard | None:
        """The sparse tables of a shard server's ``plan`` (None: it has none), trained
        by its ``config``'s optimizer, ``live`` the dense core's live set; a table the
        configured optimizer cannot train -> ProtocolError (BAD_FIELD)."""
        if not plan.sparse:
            return None
        try:
            return cls(plan.sparse, plan.num_shards, config.shard,
                       optimizer=config.optimizer, optimizer_args=config.optimizer_args,
                       live=live, build=False)
        except ConfigError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"invalid plan: {exc}") from exc

    @staticmethod
    def of_worker(sparse: SparseShard | None, heard: Callable[[int, float], object],
                  worker: int, now: float, observer: bool = False) -> SparseShard:
        """``sparse`` for a request of ``worker``, or of an observer (a read that changes
        nothing, such as the launcher's final pull); else the ProtocolError to answer.
        ``heard(worker, now)``: the core's check that a worker is registered and has not
        said BYE, and its note of the sign of life (the request)."""
        if sparse is None:
            raise ProtocolError(ErrorCode.BAD_FIELD, "this shard's plan has no sparse tables")
        if not observer:
            heard(worker, now)
        return sparse

    def table(self, name: Any) -> SparseTable:
        t = self.tables.get(name) if isinstance(name, str) else None
        if t is None:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"no sparse table {name!r} on this shard")
        return t

    @staticmethod
    def split(tensors: Mapping[str, torch.Tensor], what: str
              ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """``ids:<table>`` and ``val:<table>`` tensors -> {table: (ids, values)}. The
        count of ids per request is bounded where the message is decoded
        (paramserver.wire.messages.check_tensors)."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for key in tensors:
            kind, _, name = key.partition(":")
            if kind not in ("ids", "val") or not name:
                raise ProtocolError(ErrorCode.BAD_TENSOR, f"{what}: unexpected tensor {key!r}")
        for key, ids in tensors.items():
            if key.startswith("ids:"):
                name = key[4:]
                out[name] = (ids, tensors.get(f"val:{name}"))
        for key in tensors:
            if key.startswith("val:") and key[4:] not in out:
                raise ProtocolError(ErrorCode.BAD_TENSOR, f"{what}: {key!r} without its ids")
        return out

    # ------------------------------------------------------------------ reads

    def pull(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows for each ``ids:<table>`` asked: {``val:<table>``: rows}.

        With ``since:<table>`` (per id, the version a worker's cached copy was read at,
        -1: none) only the rows changed since are sent: ``sel:<table>`` (their
        positions in the ids) and ``val:<table>``; the others are still valid."""
        since = {k[6:]: v for k, v in tensors.items() if k.startswith("since:")}
        wanted = self.split({k: v for k, v in tensors.items() if not k.startswith("since:")},
                            "SPULL")
        if any(v is not None for _, v in wanted.values()) or set(since) - set(wanted):
            raise ProtocolError(ErrorCode.BAD_TENSOR, "SPULL carries row ids (and since) only")
        found = {name: (self.table(name), ids) for name, (ids, _) in wanted.items()}
        out = {}
        for name, (t, ids) in found.items():
            if not t.initialized:
                raise ProtocolError(ErrorCode.NOT_INITIALIZED,
                                    f"table {name!r} waits for its pretrained rows")
            # unique ids (as the client sends them): a repeated id would be answered
            # by a copy of its row per repeat, so repeats are refused before any row is read
            pos = t.local(ids, "SPULL")
            read = since.get(name)
            if read is None:
                out[f"val:{name}"] = t.weight[pos]
                continue
            check_ids(read, "SPULL since")
            if len(read) != len(ids):
                raise ProtocolError(ErrorCode.BAD_TENSOR, "SPULL: since and ids differ in length")
            # a copy read at a version this shard has not reached came from before it
            # rewound to a checkpoint: it may hold lost steps, so it is sent afresh too
            sel = torch.nonzero((read < 0) | (read > self.version)
                                | (t.updated[pos] >= read)).squeeze(1)
            out[f"sel:{name}"] = sel
            out[f"val:{name}"] = t.weight[pos[sel]]
        return out

    # ------------------------------------------------------------------ pretrained rows

    def seed(self, worker: int, tensors: Mapping[str, torch.Tensor], part: int,
             parts: int) -> bool:
        """A part of pretrained rows from ``worker`` (the first to send one seeds the
        table; others are refused with False). True once every table is in."""
        if not 0 <= part < parts:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"part {part} of {parts}")
        given = self.split(tensors, "SINIT")
        checked = []
        for name, (ids, values) in given.items():
            t = self.table(name)
            pos = t.local(ids, "SINIT")
            checked.append((t, pos, t.check_values(values, len(ids), "SINIT")))
        live = set(self.live())
        if worker not in live:  # a seeder that leaves or dies must be noticed (below)
            raise ProtocolError(ErrorCode.NOT_REGISTERED,
                                f"worker {worker} is not in the live set; say HELLO")
        if self.seeder is not None and self.seeder not in live:
            # the seeder said BYE, timed out or was reported dead before its last part:
            # the next live worker's SINIT seeds the tables from the start (as INIT does)
            self.seeder, self.seed_parts = None, (set(), 0)
        if self.initialized or (self.seeder is not None and self.seeder != worker):
            return self.initialized
        if self.seeder is None or self.seed_parts[1] != parts:
            self.seeder, self.seed_parts = worker, (set(), parts)
        for t, pos, values in checked:
            if not t.initialized:
                t.weight[pos] = values
        self.seed_parts[0].add(part)
        if len(self.seed_parts[0]) == parts:
            for t in self.tables.values():
                t.initialized = True
            self.seeder = None
        return self.initialized

    @property
    def initialized(self) -> bool:
        return self.built and all(t.initialized for t in self.tables.values())

    # ------------------------------------------------------------------ updates

    def check_push(self, read_version: int, tensors: Mapping[str, torch.Tensor]) -> RowPush:
        """A SPUSH's tensors checked against the tables (else a ProtocolError, and
        nothing changed), with how many of its rows changed since ``read_version``."""
        given = self.split(tensors, "SPUSH")
        steps: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name, (ids, values) in given.items():
            t = self.table(name)
            if not t.initialized:
                raise ProtocolError(ErrorCode.NOT_INITIALIZED, f"table {name!r} not seeded")
            pos = t.local(ids, "SPUSH")
            steps.append((name, pos, t.check_values(values, len(ids), "SPUSH")))
        stale = sum(int((self.tables[n].updated[p] >= read_version).sum()) for n, p, _ in steps)
        return RowPush(tuple(steps), sum(len(p) for _, p, _ in steps), stale)

    def apply(self, push: RowPush, scale: float) -> None:
        """One step on ``push``'s rows, the learning rate scaled by ``scale``."""
        self._step(push.steps, scale)

    def hold(self, worker: int, push: RowPush, factor: float) -> None:
        """Add ``factor`` times ``worker``'s ``push``'s rows to the open sync round."""
        rows = self.held.rows.setdefault(worker, {})
        held = self.held.values.setdefault(worker, {})
        for name, pos, values in push.steps:
            rows.setdefault(name, []).append(pos)
            held.setdefault(name, []).append(values * factor)

    def close_round(self, divisor: float) -> None:
        """One step on the open round's summed rows divided by ``divisor`` (the
        round's sample count: the sums become the sample-weighted mean)."""
        steps = []
        for name, (rows, values) in self.held.ordered().items():
            # each row's sum in worker order, whatever other rows the shard holds (a
            # coalesce sorts all of them, and the order it sums one row's repeats in
            # changed with them): a run resharded (core/reshard.py) sums as it did
            pos, inverse = torch.unique(torch.cat(rows), sorted=True, return_inverse=True)
            summed = torch.zeros((len(pos), self.tables[name].spec.dim),
                                 dtype=values[0].dtype)
            summed.index_add_(0, inverse, torch.cat(values))  # (in order, on the CPU)
            steps.append((name, pos, summed / divisor))
        self._step(steps, 1.0)
        self.held = _Held()
        self.rounds += 1

    def drop_round(self) -> None:
        """The open round closes without a step (nothing in it was accepted)."""
        self.held = _Held()

    def _step(self, steps: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
              scale: float) -> None:
        for name, pos, values in steps:
            t = self.tables[name]
            if len(pos):
                self.stepper.step(self.index[name], t.weight, pos, values, scale)
                t.updated[pos] = self.version
        self.version += 1

    def forget(self, worker: int, restart: bool = False) -> None:
        """A worker left, died or (``restart``) starts over: a pretrained table it was
        seeding is seeded afresh by the next live worker's SINIT. (Its parked push
        and push ids are the core's rules' to forget: core/rows.py.)"""
        if restart and self.seeder == worker:
            self.seeder, self.seed_parts = None, (set(), 0)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> tuple[dict[str, torch.Tensor], SparseMeta]:
        """(tensors, metadata) for the shard's checkpoint; the open sync round is not
        saved (its pushes are sent again by their workers after a restart)."""
        tensors: dict[str, torch.Tensor] = {}
        for name, t in self.tables.items():
            tensors[f"sparse/{name}/weight"] = t.weight
            tensors[f"sparse/{name}/updated"] = t.updated
        for index, buf in self.stepper.buffers.items():
            tensors[f"sparse_momentum/{index}"] = buf
        opt = self.stepper.optimizer.state_dict()
        for i, entries in opt["state"].items():
            for key, value in entries.items():
                tensors[f"sparse_optim/{i}/{key}"] = value
        meta = SparseMeta(version=self.version, rounds=self.rounds,
                          initialized={n: t.initialized for n, t in self.tables.items()},
                          tables=[t.spec.describe() for t in self.tables.values()],
                          param_groups=opt["param_groups"])
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor],
                        meta: Mapping[str, Any]) -> None:
        """Put :meth:`state_dict`'s output back; refused (ConfigError) unless it fits."""
        self.build()
        specs = [t.spec.describe() for t in self.tables.values()]
        if meta.get("tables") != specs:
            raise ConfigError("the checkpoint's sparse tables differ from the plan's")
        for name, t in self.tables.items():
            w, u = tensors[f"sparse/{name}/weight"], tensors[f"sparse/{name}/updated"]
            if w.shape != t.weight.shape or w.dtype != t.weight.dtype or u.shape != t.updated.shape:
                raise ConfigError(f"sparse table {name!r} in the checkpoint does not fit")
            if not bool(torch.isfinite(w).all()):
                raise ConfigError(f"sparse table {name!r} in the checkpoint holds NaN or Inf")
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("sparse_optim/"):
                _, index, entry = key.split("/", 2)
                state.setdefault(int(index), {})[entry] = value.clone()
        self.stepper.optimizer.load_state_dict({"state": state,
                                                "param_groups": meta["param_groups"]})
        with torch.no_grad():
            for name, t in self.tables.items():
                t.weight.copy_(tensors[f"sparse/{name}/weight"])
                t.updated.copy_(tensors[f"sparse/{name}/updated"])
                t.initialized = bool(meta["initialized"][name])
        self.stepper.buffers = {int(k.split("/", 1)[1]): v.clone() for k, v in tensors.items()
                                if k.startswith("sparse_momentum/")}
        self.version = int(meta["version"])
        self.rounds = int(meta.get("rounds", 0))
        self.held = _Held()

    def stats(self) -> dict[str, Any]:
        # a plan may declare up to 65,536 tables; a decoder takes 4,096 entries per map
        listed = list(self.tables.items())[:STATS_TABLES]
        return {"version": self.version, "rounds": self.rounds, "built": self.built,
                "tables": {n: {"rows": len(t.ids), "initialized": t.initialized}
                           for n, t in listed},
                "tables_count": len(self.tables)}
