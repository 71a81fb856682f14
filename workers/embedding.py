"""ShardedEmbedding: an embedding table that lives on the shards, row by row.

The table is never held by a worker: ``forward(ids)`` pulls the rows of the
batch's unique ids from the shards that own them (one SPULL per shard, all in
flight at once) and returns the looked-up embeddings with autograd connected
to those rows. On :meth:`DistributedOptimizer.step` the rows' gradients are
summed per unique id and pushed as (row ids, values) to their shards (one
SPUSH per shard), before the dense push. Shards initialize the table from its
rule and seed (:class:`paramserver.sparse.shard.TableSpec`);
:meth:`ShardedEmbedding.from_pretrained` streams a given table in instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paramserver.core.records import PushOutcome
from paramserver.errors import (
    ConfigError,
    FutureVersionError,
    NotRegisteredError,
    RemoteError,
)
from paramserver.sparse.shard import MAX_REQUEST_ROWS, TableSpec, owned_rows, shard_of
from paramserver.wire.messages import Error
from paramserver.wire.protocol import Message, Op
from paramserver.wire.transport import request_all
from paramserver.workers.client import PART_BYTES, PSClient

__all__ = ["ShardedEmbedding", "ShardedEmbeddingBag", "SparseClient", "pull_tables",
           "refuse_sparse_grads", "sparse_grad_refusal", "sparse_modules"]

log = logging.getLogger(__name__)

# the outcome reported for a SPUSH a shard refused because it rewound to a checkpoint
# older than our read: lost, not fatal; its version 0 makes the next push read anew
_REWOUND = PushOutcome(accepted=False, weight=0.0, reason="server rewound", staleness=0,
                       version=0, applied=False)


class SparseClient:
    """A worker's row-sparse requests to every shard, beside its :class:`PSClient`."""

    def __init__(self, client: PSClient) -> None:
        self.client = client
        self.num_shards = len(client.channels)
        self.versions = [0] * self.num_shards  # the latest table version seen per shard
        self._push_id = 0
        self.nbytes = 0  # tensor bytes sent and received, for benchmarks

    def _ask(self, msgs: Sequence[Message], shards: Sequence[int], what: str) -> list[Message]:
        """One request per shard, concurrently. Unanswered ones are sent again (same
        push id: a shard applies a push once, and a sync shard answers it when its
        round closes); a shard that restarted without us gets a HELLO first."""
        client = self.client
        chans = [client.channels[s] for s in shards]
        self.nbytes += sum(m.nbytes for m in msgs)
        # as for dense requests: a shard whose heartbeats say it holds our push (a sync
        # round waiting for others) is waited for past `timeout`; a silent one is named
        patience = client.patience(what, list(shards))
        replies = request_all(chans, list(msgs), client.retry.judged(patience), what,
                              raise_errors=False)
        for i, rep in enumerate(replies):
            if rep.op is not Op.ERROR:
                continue
            peer = f"{chans[i].peer} at {chans[i].address}"
            refusal: Error = rep.body
            error = RemoteError.from_reply(peer, refusal.code, refusal.reason)
            if isinstance(error, FutureVersionError) and msgs[i].op is Op.SPUSH:
                # the shard rewound to a checkpoint older than our read: this push is
                # lost, not fatal; its answer's version 0 makes the next push read anew
                replies[i] = Message(Op.REPLY, 0, {}, {}, None, _REWOUND)
                continue
            if not isinstance(error, NotRegisteredError):
                raise error
            log.warning("%s: %s; registering again", peer, refusal.reason)
            client.rejoin(shards[i])
            again = Message(msgs[i].op, 0, dict(msgs[i].fields), msgs[i].tensors)
            replies[i] = request_all([chans[i]], [again], client.retry, what)[0]
        self.nbytes += sum(r.nbytes for r in replies)
        return replies

    def pull(self, table: str, ids: torch.Tensor, dim: int, dtype: torch.dtype,
             cache: RowCache | None = None) -> tuple[torch.Tensor, list[int]]:
        """Rows ``ids`` (unique, int64) of ``table`` and the version read per shard.
        With ``cache``, rows it holds travel only if a step changed them since."""
        owner = torch.from_numpy(shard_of(ids, self.num_shards))
        shards = list(range(self.num_shards))
        where = [torch.nonzero(owner == s).squeeze(1) for s in shards]
        since = cache.since(ids) if cache is not None else None
        msgs = []
        for w in where:
            tensors = {f"ids:{table}": ids[w].contiguous()}
            if since is not None:
                tensors[f"since:{table}"] = since[w].contiguous()
            fields: dict[str, object] = {"worker": self.client.worker}
            if self.client.role != "worker":  # e.g. the evaluator after opt.final()
                fields["observer"] = True
            msgs.append(Message(Op.SPULL, 0, fields, tensors))
        replies = self._ask(msgs, shards, "SPULL")
        out = torch.empty(len(ids), dim, dtype=dtype)
        for s, (w, rep) in enumerate(zip(where, replies, strict=True)):
            self.versions[s] = rep.body.version  # (SPullReply)
            if cache is None:
                out[w] = rep.tensors[f"val:{table}"]
                continue
            sent = w[rep.tensors[f"sel:{table}"]]
            kept = torch.ones(len(ids), dtype=torch.bool)
            kept[sent] = False
            kept_w = w[kept[w]]
            if len(kept_w):
                out[kept_w] = cache.rows_of(ids[kept_w])
            out[sent] = rep.tensors[f"val:{table}"]
            cache.store(ids[w], out[w], self.versions[s])
        return out, list(self.versions)

    def push(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
             read_versions: Sequence[int], num_samples: int, clock: int
             ) -> list[PushOutcome]:
        """Gradient rows {table: (ids, values)} to their shards, one SPUSH each (every
        shard gets one, empty or not: a sync round counts every worker's samples)."""
        self._push_id += 1
        per: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_shards)]
        for table, (ids, values) in grads.items():
            owner = torch.from_numpy(shard_of(ids, self.num_shards))
            for s in range(self.num_shards):
                w = torch.nonzero(owner == s).squeeze(1)
                per[s][f"ids:{table}"] = ids[w].contiguous()
                per[s][f"val:{table}"] = values[w].contiguous()
        msgs = [Message(Op.SPUSH, 0, {
            "worker": self.client.worker, "push_id": self._push_id, "clock": clock,
            "read_version": int(read_versions[s]), "num_samples": int(num_samples),
            **({"lr": self.client.lr} if self.client.lr is not None else {})}, per[s])
            for s in range(self.num_shards)]
        replies = self._ask(msgs, range(self.num_shards), "SPUSH")
        outcomes: list[PushOutcome] = [r.body for r in replies]
        for s, o in enumerate(outcomes):
            self.versions[s] = o.version
        return outcomes

    def seed(self, tables: dict[str, torch.Tensor], part_bytes: int = PART_BYTES) -> None:
        """Stream whole tables {name: tensor} to the shards in parts of about
        ``part_bytes`` per shard (the first worker to send seeds them)."""
        plans = []
        for name, tensor in tables.items():
            owner = torch.from_numpy(shard_of(torch.arange(len(tensor)), self.num_shards))
            plans.append((name, tensor, [torch.nonzero(owner == s).squeeze(1)
                                         for s in range(self.num_shards)]))
        row_bytes = max(t.shape[1] * t.element_size() for t in tables.values())
        # a shard refuses a request of more than MAX_REQUEST_ROWS ids, all tables together
        step = max(1, min(part_bytes // row_bytes, MAX_REQUEST_ROWS // len(plans)))
        longest = max(len(w) for _, _, ws in plans for w in ws)
        parts = max(1, -(-longest // step))
        for part in range(parts):
            msgs = []
            for s in range(self.num_shards):
                tensors: dict[str, torch.Tensor] = {}
                for name, tensor, ws in plans:
                    ids = ws[s][part * step:(part + 1) * step]
                    tensors[f"ids:{name}"] = ids.contiguous()
                    tensors[f"val:{name}"] = tensor[ids].contiguous()
                msgs.append(Message(Op.SINIT, 0, {"worker": self.client.worker,
                                                  "part": part, "parts": parts}, tensors))
            self._ask(msgs, range(self.num_shards), "SINIT")


class RowCache:
    """At most ``capacity`` rows a worker read, each with the shard version it is valid
    at; a pull sends those versions and gets back only the rows changed since, so a
    cached row is never served stale. Least recently used rows go first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"cache capacity must be >= 1 row, got {capacity}")
        self.capacity = capacity
        self.rows: OrderedDict[int, tuple[torch.Tensor, int]] = OrderedDict()

    def since(self, ids: torch.Tensor) -> torch.Tensor:
        got = [self.rows.get(i) for i in ids.tolist()]
        return torch.tensor([-1 if g is None else g[1] for g in got], dtype=torch.int64)

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.rows[i][0] for i in ids.tolist()])

    def store(self, ids: torch.Tensor, values: torch.Tensor, version: int) -> None:
        values = values.detach().clone()
        for j, i in enumerate(ids.tolist()):
            self.rows[i] = (values[j], version)
            self.rows.move_to_end(i)
        while len(self.rows) > self.capacity:
            self.rows.popitem(last=False)


@dataclass
class _Read:
    ids: torch.Tensor  # unique row ids
    rows: torch.Tensor  # their pulled values, a leaf autograd tracks
    versions: list[int]


class ShardedEmbedding(nn.Module):
    """``nn.Embedding`` whose ``num_embeddings x embedding_dim`` table lives on the
    parameter servers, split by row hash; a worker holds only its batch's rows.

    ``init``: how the shards fill the table: ``"normal"`` (mean 0, ``std``),
    ``"uniform"`` (-``std``, ``std``) or ``"zeros"``, from ``seed``.
    ``cache_rows``: keep up to this many rows between steps; a pull then moves
    only the cached rows a step changed since they were read (exact, never stale). The module
    works once a :class:`~paramserver.DistributedOptimizer` over the model that
    holds it has connected; that optimizer's ``step()`` pushes its gradients.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 dtype: torch.dtype = torch.float32, init: str = "normal", std: float = 1.0,
                 seed: int = 0, cache_rows: int = 0) -> None:
        super().__init__()
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.dtype = dtype
        names = {torch.float32: "float32", torch.float64: "float64"}
        if dtype not in names:
            raise ConfigError(f"ShardedEmbedding dtype must be float32 or float64, got {dtype}")
        # (checked here, not at the servers; named once the model's attribute is known)
        self._spec = TableSpec("check", rows=self.num_embeddings, dim=self.embedding_dim,
                               dtype=names[dtype], init=init, std=float(std), seed=int(seed))
        self.pretrained: torch.Tensor | None = None
        self.table_name: str | None = None
        self.client: SparseClient | None = None
        self._reads: list[_Read] = []
        # rows kept between steps, pulled again only when changed (0: no cache)
        self.cache = RowCache(cache_rows) if cache_rows else None

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor) -> ShardedEmbedding:
        """A table seeded from ``embeddings`` (2-D, float32 or float64, dtype kept): the
        worker that seeds the servers streams it to the shards in parts."""
        if embeddings.dim() != 2:
            raise ConfigError("from_pretrained needs a 2-D tensor")
        module = cls(embeddings.shape[0], embeddings.shape[1], dtype=embeddings.dtype,
                     init="pretrained")
        module.pretrained = embeddings.detach().contiguous()
        return module

    def table_spec(self, name: str) -> TableSpec:
        return dataclasses.replace(self._spec, name=name)

    def attach(self, name: str, client: SparseClient) -> None:
        self.table_name, self.client = name, client

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.client is None or self.table_name is None:
            raise ConfigError("ShardedEmbedding has no servers yet: build a "
                              "DistributedOptimizer over the model that holds it first")
        flat = ids.reshape(-1).to(torch.int64)
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows, versions = self.client.pull(self.table_name, unique, self.embedding_dim,
                                          self.dtype, self.cache)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._reads.append(_Read(unique, rows, versions))
        return rows[inverse].reshape(*ids.shape, self.embedding_dim)

    def take_grads(self) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """(unique ids, their summed gradients, the oldest versions read) of every
        forward since the last step; the rows are dropped."""
        out = self.grad_rows()
        self._reads = []
        return out

    def grad_rows(self) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """What :meth:`take_grads` returns, the rows kept (``opt.clip_grad_norm_``
        measures them before the step pushes them)."""
        reads = self._reads
        if not reads:
            return (torch.zeros(0, dtype=torch.int64),
                    torch.zeros(0, self.embedding_dim, dtype=self.dtype), None)
        ids = torch.cat([r.ids for r in reads])
        grads = torch.cat([r.rows.grad if r.rows.grad is not None else torch.zeros_like(r.rows)
                           for r in reads])
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(len(unique), self.embedding_dim, dtype=self.dtype)
        summed.index_add_(0, inverse, grads)
        versions = [min(r.versions[s] for r in reads) for s in range(len(reads[0].versions))]
        return unique, summed, versions

    def scale_grads_(self, factor: float | torch.Tensor) -> None:
        """Multiply the gradients of every row read since the last step by ``factor``
        (a sum of gradients scales as each one does)."""
        for r in self._reads:
            if r.rows.grad is not None:
                r.rows.grad.mul_(factor)

    # ------------------------------------------------------------------ saving

    def table(self) -> torch.Tensor | None:
        """The whole table: as the shards hold it now once a DistributedOptimizer
        connected (read in parts, as a worker reads rows), else the rows it was made
        from (:meth:`from_pretrained`, or loaded); None: the shards draw it from its
        rule and seed, and nothing else holds it."""
        if self.client is None or self.table_name is None:
            return self.pretrained
        out = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.dtype)
        row_bytes = self.embedding_dim * out.element_size()
        step = max(1, min(PART_BYTES // row_bytes, MAX_REQUEST_ROWS))
        for start in range(0, self.num_embeddings, step):
            ids = torch.arange(start, min(self.num_embeddings, start + step))
            out[start:start + len(ids)] = self.client.pull(
                self.table_name, ids, self.embedding_dim, self.dtype)[0]
        return out

    def _adopt(self, weight: torch.Tensor, what: str) -> None:
        """Take ``weight`` as the table the shards are seeded with (init "pretrained")."""
        if self.client is not None:
            raise ConfigError(f"{what}: this ShardedEmbedding's table lives on the servers "
                              f"already; load it before building the DistributedOptimizer")
        if (not isinstance(weight, torch.Tensor) or weight.dtype != self.dtype
                or tuple(weight.shape) != (self.num_embeddings, self.embedding_dim)):
            got = (f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor)
                   else type(weight).__name__)
            raise ConfigError(f"{what}: a ShardedEmbedding of {self.num_embeddings} x "
                              f"{self.embedding_dim} {self.dtype} got {got}")
        self.pretrained = weight.detach().clone().contiguous()
        self._spec = dataclasses.replace(self._spec, init="pretrained")

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        # the table as "weight", as nn.Embedding has it (absent while only the shards'
        # rule and seed make it)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        weight = self.table()
        if weight is not None:
            destination[prefix + "weight"] = weight

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        key = prefix + "weight"
        if key in state_dict:  # the shards will be seeded with it
            try:
                self._adopt(state_dict[key], f"load_state_dict {key!r}")
            except ConfigError as exc:
                error_msgs.append(str(exc))
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def __getstate__(self) -> dict[str, Any]:
        """What ``torch.save(model)`` (or a deep copy) keeps: the table's spec and its
        rows as they are now (the model loaded again seeds new servers with them), not
        the connection to the servers nor the rows read for the step under way."""
        state = dict(self.__dict__)
        weight = self.table()
        state.update(client=None, table_name=None, _reads=[],
                     cache=RowCache(self.cache.capacity) if self.cache is not None else None)
        if weight is not None:
            state.update(pretrained=weight,
                         _spec=dataclasses.replace(self._spec, init="pretrained"))
        return state

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, sharded"


class ShardedEmbeddingBag(ShardedEmbedding):
    """``nn.EmbeddingBag`` over a sharded table: ``forward(ids)`` with ``ids`` of shape
    (bags, length) pools each row of ids by ``mode`` ("sum", "mean" or "max"); the
    rows are pulled and pushed as for :class:`ShardedEmbedding`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mode: str = "mean",
                 **kwargs: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        if mode not in ("sum", "mean", "max"):
            raise ConfigError(f"mode must be sum, mean or max, got {mode!r}")
        self.mode = mode

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2:
            raise ConfigError("ShardedEmbeddingBag takes ids of shape (bags, length)")
        rows = super().forward(ids)
        if self.mode == "sum":
            return rows.sum(1)
        if self.mode == "mean":
            return rows.mean(1)
        return rows.max(1).values


def sparse_grad_refusal(where: str, module: nn.Module | None = None) -> str:
    """The one line a model whose gradients are sparse gets (nn.Embedding(sparse=True))."""
    kind = "EmbeddingBag" if isinstance(module, nn.EmbeddingBag) else "Embedding"
    size = (f"{module.num_embeddings}, {module.embedding_dim}"
            if isinstance(module, nn.Embedding | nn.EmbeddingBag) else "rows, dim")
    return (f"{where}: nn.{kind}(sparse=True) gives sparse gradients, which the shards "
            f"take only as a table's rows: use paramserver.Sharded{kind}({size}) (the "
            f"table lives on the shards, each step pushes the rows it read), or "
            f"sparse=False")


def refuse_sparse_grads(model: nn.Module) -> None:
    """ConfigError (one line naming ShardedEmbedding) for a module of ``model`` whose
    gradients are sparse: a dense push cannot carry them."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse:
            raise ConfigError(sparse_grad_refusal(name or type(model).__name__, m))


def sparse_modules(model: nn.Module) -> list[tuple[str, ShardedEmbedding]]:
    """The model's ShardedEmbedding modules with their names (the table names)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ShardedEmbedding)]


def pull_tables(client: PSClient, specs: Sequence[TableSpec], part_bytes: int = PART_BYTES
                ) -> dict[str, torch.Tensor]:
    """Whole tables {``<name>.weight``: tensor} read from the shards as an observer
    (never gated, registers nothing), about ``part_bytes`` of rows per shard per request:
    memory per request stays bounded however large the table."""
    sparse = SparseClient(client)
    out = {}
    for spec in specs:
        table = torch.empty(spec.rows, spec.dim, dtype=spec.torch_dtype)
        owned = [owned_rows(spec.rows, sparse.num_shards, s) for s in range(sparse.num_shards)]
        step = max(1, min(part_bytes // (spec.dim * table.element_size()), MAX_REQUEST_ROWS))
        for start in range(0, max(len(o) for o in owned), step):
            parts = [o[start:start + step] for o in owned]
            msgs = [Message(Op.SPULL, 0, {"worker": client.worker, "observer": True},
                            {f"ids:{spec.name}": p.contiguous()}) for p in parts]
            replies = sparse._ask(msgs, range(sparse.num_shards), "SPULL")
            for ids, rep in zip(parts, replies, strict=True):
                table[ids] = rep.tensors[f"val:{spec.name}"]
        out[f"{spec.name}.weight"] = table
    return out
