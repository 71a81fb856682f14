"""Resharding: the checkpoints of a run planned on S shards as those of the same run
planned on S' shards. Pure: no files, no clock (paramserver/persist/reshard.py reads
and writes the checkpoints).

Why it can be exact: a plan's slices do not depend on the number of shards (a
parameter is cut by ``chunk_bytes`` alone, sharding.py), only which shard holds each
one; a sparse table's rows are spread by a hash of their id. So a slice moves whole,
with everything a shard keeps of it: its weights, its optimizer's state (each entry
of a slice's ``optimizer.state``, renumbered as the slice's index on its new shard),
its sum in an open sync round, the weights each worker read of it, each worker's
reconstruction of it under compressed pulls. A table's rows
move one by one with their momentum, optimizer state and the version they last
changed at. A sync round is summed by worker id element by element, and the
optimizers that may be resharded update element by element, so a resumed run on S'
shards ends bit-identical to the same run kept on S.

What every shard holds once (the version, the open round, each worker's clock and
push-id window, the scheduler, the learning rate, the policy's and the asynchrony-aware
momentum's state, the tables' version) must be the same on every shard: a push that
reached one shard and not another could then be neither counted once nor dropped on
the shards that take their slices together. :func:`reshard` checks it and refuses
(:class:`ReshardError`, one line naming the field and the shards); and refuses an
optimizer whose step may join its slices (a plug-in: a norm, a shape), whose result
would then depend on which slices share a shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from paramserver.core.optim import OPTIMIZERS, resolve_optimizer
from paramserver.core.outer import DelayedNesterov
from paramserver.core.probe import all_finite
from paramserver.core.sharding import DTYPES, ShardPlan, Slice
from paramserver.errors import ConfigError
from paramserver.sparse.shard import owned_rows
from paramserver.util.flat import ELEMENTWISE
from paramserver.util.plugins import names_from

__all__ = ["FILE_FIELDS", "ReshardError", "ShardState", "reshard"]

#: one shard's checkpoint: (tensors, manifest)
ShardState = tuple[dict[str, torch.Tensor], dict[str, Any]]

#: manifest fields a checkpoint file adds (persist/checkpoint.py): written anew
FILE_FIELDS = ("format", "created", "tensors_file", "tensors_bytes")
#: a replica's position in its primary's inputs: meaningless under another plan
_DROPPED = (*FILE_FIELDS, "replica_input")
#: what every shard holds once, so every shard must hold alike
_AGREE = ("version", "initialized", "started", "mode", "rounds_closed", "round",
          "round_samples", "round_accepted", "round_void", "between_rounds", "scheduler",
          "momentum", "policy", "optimizer_name", "script_optimizer")
#: what each worker's record holds for exactly-once and the clocks
_WORKER_AGREE = ("incarnation", "clock", "last_push_id", "live", "finished")
#: counters of what happened to each shard: the merged shard keeps the largest
_COUNTERS = ("rounds_voided", "rounds_dropped", "max_answered_gap")
#: optimizers whose step on a slice reads that slice alone (element by element)
_PER_ELEMENT: frozenset[type] = frozenset(
    {getattr(torch.optim, OPTIMIZERS[n]) for n in ELEMENTWISE if n in OPTIMIZERS}
    | {torch.optim.ASGD, torch.optim.Adadelta, DelayedNesterov})


class ReshardError(ConfigError):
    """A checkpoint that cannot move to another shard count; the message says why."""


def _fail(why: str) -> ReshardError:
    return ReshardError(f"cannot reshard: {why}")


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _agree(values: Sequence[Any], field: str) -> Any:
    """The value every shard holds for ``field`` (else refused, naming two shards)."""
    first = values[0]
    for s, value in enumerate(values):
        if value != first:
            raise _fail(f"field {field!r} differs between the shards (shard 0: {_short(first)}, "
                        f"shard {s}: {_short(value)}); a push reached one and not the other: "
                        "resume on the old shard count until they agree, then checkpoint")
    return first


def _policy_alike(values: Sequence[Any]) -> None:
    """A policy whose state differs from shard to shard by design (statistics of each
    shard's slices, a bound each shard sets itself) cannot be resharded: said as such,
    not as a push that reached one shard and not another."""
    first = values[0]
    if not isinstance(first, Mapping) or all(v == first for v in values):
        return
    names = {v.get("name") if isinstance(v, Mapping) else None for v in values}
    if len(names) == 1 and all(isinstance(v, Mapping) and v.get("state") for v in values):
        raise _fail(f"the policy {first.get('name')!r} keeps state of each shard's own "
                    f"(its {', '.join(sorted(map(str, first['state'])))[:80]}), which a "
                    "reshard cannot split or merge: resume on the shard count it was "
                    "checkpointed on")


def _check_optimizer(metas: Sequence[Mapping[str, Any]]) -> str:
    name = _agree([m.get("optimizer_name") for m in metas], "optimizer_name")
    if not isinstance(name, str):
        raise _fail("the checkpoint names no optimizer (field 'optimizer_name')")
    try:
        # a manifest is a file: a module:name in it is not imported (a plug-in optimizer
        # would be refused below anyway, as not one of the per-element ones)
        with names_from("the checkpoint's manifest",
                        hint="only built-in optimizers reshard"):
            cls = resolve_optimizer(name)
    except ConfigError as exc:
        raise _fail(f"its optimizer {name!r} is unknown here: {exc}") from exc
    if cls not in _PER_ELEMENT:
        raise _fail(f"the optimizer {name!r} is not one whose step reads each slice alone "
                    f"({', '.join(sorted(c.__name__ for c in _PER_ELEMENT))}): its result "
                    "would depend on which slices share a shard")
    return name.strip().lower()


def _plan(metas: Sequence[Mapping[str, Any]]) -> ShardPlan:
    _agree([m.get("plan_hash") for m in metas], "plan_hash")
    try:
        plan = ShardPlan.from_description(metas[0]["plan"])
    except (ConfigError, KeyError, TypeError) as exc:
        raise _fail(f"the checkpoint holds no usable plan: {exc}") from exc
    if plan.num_shards != len(metas):
        raise _fail(f"the plan has {plan.num_shards} shards, the checkpoint {len(metas)}")
    for s, m in enumerate(metas):
        if m.get("shard", s) != s:
            raise _fail(f"the checkpoint of shard {s} says it is shard {m.get('shard')!r}")
    return plan


def _slice_tensor(t: torch.Tensor, sl: Slice, what: str) -> torch.Tensor:
    if t.dtype != DTYPES[sl.dtype] or t.numel() != sl.numel or t.dim() != 1:
        raise _fail(f"tensor {what} is {t.dtype} {list(t.shape)}, its slice "
                    f"{sl.dtype} [{sl.numel}]")
    if not all_finite(t):
        raise _fail(f"tensor {what} holds NaN or Inf")
    return t


def _scalar(value: Any) -> Any:
    """A per-slice entry that is not per element (a step count), comparable."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


def _dense(plan: ShardPlan, new: ShardPlan, shards: Sequence[ShardState], flat: bool
           ) -> list[tuple[dict[str, torch.Tensor], dict[int, dict[str, Any]]]]:
    """Per new shard: its dense tensors and its optimizer state's plain entries."""
    where = {s.key: (s.shard, i) for k in range(new.num_shards)
             for i, s in enumerate(new.shard_slices(k))}
    out: list[tuple[dict[str, torch.Tensor], dict[int, dict[str, Any]]]] = [
        ({}, {}) for _ in range(new.num_shards)]
    state: list[dict[int, dict[str, Any]]] = [{} for _ in range(new.num_shards)]
    for old, (tensors, meta) in enumerate(shards):
        slices = plan.shard_slices(old)

        def slice_at(index: str, field: str, slices: tuple[Slice, ...] = slices,
                     old: int = old) -> Slice:
            if not index.isdigit() or int(index) >= len(slices):
                raise _fail(f"shard {old}'s {field} names slice {index[:12]!r}; it holds "
                            f"{len(slices)}")
            return slices[int(index)]

        for name, t in tensors.items():
            if name.startswith(("sparse/", "sparse_optim/", "sparse_momentum/")):
                continue
            kind, _, rest = name.partition("/")
            if kind in ("param", "agg", "read", "pull"):
                key = rest.partition("/")[2] if kind in ("read", "pull") else rest
                try:
                    sl = plan.slice_for(key)
                except Exception as exc:
                    raise _fail(f"shard {old}'s tensor {name[:80]!r} is no slice of the "
                                "plan") from exc
                if sl.shard != old:
                    raise _fail(f"shard {old} holds {name[:80]!r}, which the plan gives to "
                                f"shard {sl.shard}")
                out[where[key][0]][0][name] = _slice_tensor(t, sl, f"{name[:80]!r}")
            elif kind == "optim":
                index, _, entry = rest.partition("/")
                sl = slice_at(index, f"tensor {name[:60]!r}")
                if t.dim() != 0:  # per element, else a count kept as a 0-d tensor
                    _slice_tensor(t, sl, f"{name[:80]!r}")
                target, at = where[sl.key]
                state[target].setdefault(at, {})[entry] = t
            else:
                raise _fail(f"shard {old}'s tensor {name[:80]!r} is not one a checkpoint "
                            "holds")
        saved = meta.get("optimizer", {}).get("state", {})
        if not isinstance(saved, dict):
            raise _fail(f"shard {old}'s field 'optimizer.state' is not a map")
        for index, entries in saved.items():
            if not entries:
                continue
            sl = slice_at(str(index), "field 'optimizer.state'")
            if not isinstance(entries, dict):
                raise _fail(f"shard {old}'s field 'optimizer.state[{index}]' is not a map")
            target, at = where[sl.key]
            for entry, value in entries.items():
                state[target].setdefault(at, {})[entry] = value
    for k in range(new.num_shards):
        slices = new.shard_slices(k)
        for i, entries in state[k].items():
            plain = out[k][1].setdefault(i, {})  # (a slice's entry, even if empty)
            for entry, value in entries.items():
                if isinstance(value, torch.Tensor):
                    out[k][0][f"optim/{i}/{entry}"] = value
                else:
                    plain[entry] = value
        if flat:
            _steps_alike(k, slices, state[k])
    return out


def _steps_alike(shard: int, slices: Sequence[Slice], state: Mapping[int, Mapping[str, Any]]
                 ) -> None:
    """A shard steps the slices of one dtype as one tensor (flat.py) with one step
    count: the slices it takes must have stepped alike."""
    by_dtype: dict[str, list[int]] = {}
    for i, s in enumerate(slices):
        by_dtype.setdefault(s.dtype, []).append(i)
    for indices in by_dtype.values():
        seen = {_key(state.get(i, {})) for i in indices}
        if len(seen) > 1:
            raise _fail(f"the slices new shard {shard} would step together kept different "
                        f"optimizer counts ({'; '.join(sorted(map(str, seen)))[:120]}): "
                        "one of the old shards refused a step the others took")


def _key(entries: Mapping[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    if not entries:
        return None  # never stepped
    return tuple(sorted((k, str(_scalar(v))) for k, v in entries.items()
                        if not isinstance(v, torch.Tensor) or v.dim() == 0))


def _sparse(plan: ShardPlan, new: ShardPlan, shards: Sequence[ShardState],
            optimizer: str) -> list[dict[str, torch.Tensor]]:
    """Per new shard: its tables' rows, their momentum and optimizer state, moved row
    by row (rows go to shards by a hash of their id: sparse/shard.py)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(new.num_shards)]
    old_ids = [{t.name: owned_rows(t.rows, plan.num_shards, s) for t in plan.sparse}
               for s in range(plan.num_shards)]
    new_ids = [{t.name: owned_rows(t.rows, new.num_shards, s) for t in new.sparse}
               for s in range(new.num_shards)]
    lr_decay = [(m.get("sparse") or {}).get("param_groups", [{}])[0].get("lr_decay", 0.0)
                for _, m in shards]
    for index, table in enumerate(plan.sparse):
        names = {f"sparse/{table.name}/weight", f"sparse/{table.name}/updated",
                 f"sparse_momentum/{index}"}
        names |= {n for tensors, _ in shards for n in tensors
                  if n.startswith(f"sparse_optim/{index}/")}
        for name in sorted(names):
            held = [tensors.get(name) for tensors, _ in shards]
            if all(h is None for h in held):
                continue
            rows = [h for h in held if h is not None and h.dim() > 0]
            if name.startswith("sparse_optim/") and len(rows) < len(held) and rows:
                # a count (0-d) on some shards, rows on others: not one table's state
                raise _fail(f"{name!r} is per row on some shards and a count on others")
            if not rows:  # a count: one per table, the same on every shard
                counts = [h for h in held if h is not None]
                if len(counts) != len(held):
                    raise _fail(f"{name!r} is kept by some shards only: the table "
                                "stepped on some shards and not on others")
                if (name.endswith("/step") and optimizer == "adagrad"
                        and all(d == 0 for d in lr_decay)):
                    value = max(counts, key=lambda c: float(c))  # (unread without lr_decay)
                else:
                    _agree([c.tolist() for c in counts], name)
                    value = counts[0]
                for k in range(new.num_shards):
                    out[k][name] = value.clone()
                continue
            if any(h is None for h in held):
                if not name.startswith("sparse_momentum/"):
                    raise _fail(f"{name!r} is kept by some shards only: the table "
                                "stepped on some shards and not on others")
                # momentum is made on a shard's first step of the table: zeros before
                like = rows[0]
                held = [h if h is not None else
                        torch.zeros((len(old_ids[s][table.name]), *like.shape[1:]),
                                    dtype=like.dtype) for s, h in enumerate(held)]
            first = rows[0]
            full = torch.empty((table.rows, *first.shape[1:]), dtype=first.dtype)
            for s, h in enumerate(held):
                assert h is not None
                ids = old_ids[s][table.name]
                if h.shape[0] != len(ids) or h.shape[1:] != first.shape[1:] \
                        or h.dtype != first.dtype:
                    raise _fail(f"shard {s}'s {name!r} is {h.dtype} {list(h.shape)}; it "
                                f"holds {len(ids)} rows of the table")
                if h.is_floating_point() and not all_finite(h):
                    raise _fail(f"shard {s}'s {name!r} holds NaN or Inf")
                full[ids] = h
            for k in range(new.num_shards):
                out[k][name] = full[new_ids[k][table.name]]
    return out


def reshard(shards: Sequence[ShardState], to: int, only: int | None = None
            ) -> list[ShardState]:
    """The checkpoints of shards ``0..S-1`` of one run (each ``(tensors, manifest)``, as
    persist/checkpoint.py loads them at one resume point) as those of the same run
    planned on ``to`` shards, in order (``only``: that new shard's alone, as a list of
    one); refused (:class:`ReshardError`) with the reason when they cannot move (see
    the module's docstring). The inputs are not changed."""
    if isinstance(to, bool) or not isinstance(to, int) or to < 1:
        raise _fail(f"the new shard count must be an integer >= 1, got {to!r}")
    if not shards:
        raise _fail("no shard checkpoints given")
    metas = [m for _, m in shards]
    plan = _plan(metas)
    optimizer = _check_optimizer(metas)
    _policy_alike([m.get("policy") for m in metas])
    agreed = {f: _agree([m.get(f) for m in metas], f) for f in _AGREE}
    workers = _workers(metas)
    groups = _agree([_groups(m) for m in metas], "optimizer.param_groups")
    sparse_meta = _sparse_meta(metas) if plan.sparse else None
    new = ShardPlan(plan.params, to, plan.chunk_bytes, plan.split, plan.sparse)
    # a shard may step one dtype's slices as one tensor (ShardCore._flat_step)
    flat = optimizer in ELEMENTWISE
    dense = _dense(plan, new, shards, flat)
    rows = _sparse(plan, new, shards, optimizer) if plan.sparse else [{}] * to
    if only is not None and not 0 <= only < to:
        raise _fail(f"shard {only} is not one of the {to} new shards")
    pulls = _pull_counts(metas)
    out: list[ShardState] = []
    for k in range(to) if only is None else [only]:
        tensors, plain = dense[k]
        tensors.update(rows[k])
        for name in [n for n in tensors if n.startswith("pull/")
                     and n.split("/", 2)[1] not in pulls]:
            del tensors[name]  # (that worker's next pull is dense)
        meta = {f: v for f, v in metas[0].items() if f not in _DROPPED}
        meta.pop("pull_counts", None)
        if pulls:
            meta["pull_counts"] = pulls
        meta.update(agreed)
        meta.update({c: max(int(m.get(c, 0) or 0) for m in metas) for c in _COUNTERS})
        n = len(new.shard_slices(k))
        meta.update(
            shard=k, plan=new.describe(), plan_hash=new.hash, workers=workers,
            # an empty shard's optimizer runs over one placeholder (stepper.py)
            optimizer={"param_groups": [{**g, "params": list(range(max(1, n)))}
                                        for g in groups],
                       "state": {str(i): dict(e) for i, e in sorted(plain.items())}})
        if sparse_meta is not None:
            meta["sparse"] = sparse_meta
        if isinstance(meta.get("server"), dict):  # (what the shard was started with)
            meta["server"] = {**meta["server"], "shard": k, "num_shards": to}
        out.append(({name: t.clone() for name, t in tensors.items()}, meta))
    return out


def _pull_counts(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Compressed pulls (core/pullsqueeze.py): a worker's reconstruction moves per
    element with its slices, and keeps its count where every old shard counted alike
    (else it is dropped, and the worker's next pull is dense)."""
    counts = [m.get("pull_counts") or {} for m in metas]
    if not all(isinstance(c, dict) for c in counts):
        raise _fail("field 'pull_counts' must be a map on every shard")
    return {w: c for w, c in counts[0].items() if all(cs.get(w) == c for cs in counts)}


def _groups(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    groups = (meta.get("optimizer") or {}).get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise _fail("field 'optimizer.param_groups' must be a list of maps")
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _workers(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each worker's record: clocks and push-id windows alike on every shard."""
    records = [m.get("workers") for m in metas]
    if not all(isinstance(r, dict) for r in records):
        raise _fail("field 'workers' must be a map on every shard")
    _agree([sorted(r) for r in records], "workers")  # type: ignore[arg-type]
    for worker in records[0]:  # type: ignore[union-attr]
        for field in _WORKER_AGREE:
            _agree([(r[worker] or {}).get(field) for r in records],  # type: ignore[index]
                   f"workers.{worker}.{field}")
    return dict(records[0])  # type: ignore[arg-type]


def _sparse_meta(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    sparse = [m.get("sparse") for m in metas]
    if not all(isinstance(s, dict) for s in sparse):
        raise _fail("the plan has sparse tables, a shard's checkpoint lacks field 'sparse'")
    out = dict(sparse[0])  # type: ignore[arg-type]
    for field in ("version", "rounds", "initialized", "tables", "param_groups"):
        _agree([s.get(field) for s in sparse], f"sparse.{field}")  # type: ignore[union-attr]
    if not all(isinstance(out.get(f), int) and not isinstance(out.get(f), bool)
               and out[f] >= 0 for f in ("version", "rounds")):
        raise _fail("fields 'sparse.version' and 'sparse.rounds' must be integers >= 0")
    return out
