"""Bounds on a shard plan from a peer (:class:`PlanLimits`), what a shard's optimizer
multiplies them by (:func:`estimate_copies`) and the default chunk size. Apart from
sharding.py because these load no torch: ``ServerConfig`` and ``WorkerConfig`` declare
their defaults from them. Importable from ``paramserver.core.sharding`` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paramserver.errors import ConfigError

if TYPE_CHECKING:
    from paramserver.sparse.shard import TableSpec

__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_PLAN_SERVERS", "PlanLimits", "estimate_copies"]

#: tensors larger than this are split across shards (ShardPlan's chunk_bytes)
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class PlanLimits:
    """Bounds on a plan that came from a peer, checked before anything is built from it.

    A plan description of a few hundred bytes can declare terabytes or millions
    of chunks; :meth:`ShardPlan.checked_plan` looks only at what the message holds
    (the arithmetic of its declared sizes), so checking costs time in
    proportion to the message, and a plan within these bounds costs at most
    ``max_chunks`` slices and ``max_model_bytes`` to hold (:meth:`cost`: every
    byte its shards will keep for it, not only its weights).
    """

    max_model_bytes: int = 4 << 30  # what the plan costs its shards in all (see cost())
    max_params: int = 65536
    max_chunks: int = 65536  # slices over all shards (a PUSH carries at most 65,536 tensors)
    min_chunk_bytes: int = 64  # when split: smaller chunks only multiply the slices
    max_ndim: int = 8
    #: weight-sized buffers a shard keeps per dense byte: the weights, the optimizer's
    #: state, a sync round's sum (estimate_copies)
    dense_copies: int = 1
    #: the same per byte of a sparse table's rows: the rows and their optimizer state
    sparse_copies: int = 1

    def __post_init__(self) -> None:
        for name in ("max_model_bytes", "max_params", "max_chunks", "min_chunk_bytes",
                     "max_ndim", "dense_copies", "sparse_copies"):
            if getattr(self, name) < 1:
                raise ConfigError(f"plan limit {name} must be >= 1, got {getattr(self, name)}")

    def cost(self, dense_bytes: int, tables: Sequence[TableSpec]) -> int:
        """Bytes a plan of ``dense_bytes`` of weights and ``tables`` costs its shards in
        all: each copy of the weights, and per table row its values and their
        optimizer state, its id and the version of its last step (ROW_OVERHEAD)."""
        return dense_bytes * self.dense_copies + sum(
            t.held_bytes(self.sparse_copies) for t in tables)


#: optimizer state per weight, in weights (torch.optim's; an unknown optimizer: 2)
_STATE = {"sgd": 0, "adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "radam": 2,
          "adadelta": 2, "adagrad": 1, "rmsprop": 1, "asgd": 1, "sparseadam": 2}


def estimate_copies(optimizer: str, args: Mapping[str, Any], sync: bool) -> tuple[int, int]:
    """(dense_copies, sparse_copies) of :class:`PlanLimits` for a shard that trains with
    ``optimizer`` and ``args``: the weights, the optimizer's state (momentum adds
    one), and in sync mode the round's sum of the dense gradients."""
    name = optimizer.lower()
    state = _STATE.get(name, 2)
    if name in ("sgd", "rmsprop") and args.get("momentum"):
        state += 1
    if name == "rmsprop" and args.get("centered"):
        state += 1
    if name == "adam" and args.get("amsgrad"):
        state += 1
    return 1 + state + (1 if sync else 0), 1 + state


#: the most shards a run's plan may have: what a live move's plan names at the wire
#: (wire/messages.py), what launch starts (--num-servers, --reshard-at)
MAX_PLAN_SERVERS = 1024
