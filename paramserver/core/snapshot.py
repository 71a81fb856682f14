"""A shard core's snapshot: what a checkpoint holds to resume it, and back.

:func:`save` turns a :class:`~paramserver.core.shard.ShardCore` into (tensors,
JSON-able metadata); :func:`load` puts them back. The format is the one
checkpoints have always held (paramserver/persist/checkpoint.py writes and reads it):

* tensors: weights (``param/<key>``), optimizer state
  (``optim/<index>/<name>``), an open sync round's sums (``agg/<key>``) and the
  weights each worker read, for policies that need them (``read/<worker>/<key>``)
  and each worker's reconstruction under compressed pulls (``pull/<worker>/<key>``,
  their counts and versions in ``pull_counts``: core/pullsqueeze.py);
* metadata: versions, clocks, counters (``rounds_closed``, and ``between_rounds``:
  nothing in the open round, which makes the checkpoint one that shards resume
  together from, see paramserver/persist/checkpoint.py), each worker's record
  (:meth:`~paramserver.core.shard.WorkerState.record`), the optimizer's and
  scheduler's non-tensor state and the policy's state.

A push still arriving in parts is not saved: its parts in the round's buffer
make the saved round void.

:func:`check` trusts nothing a checkpoint holds (issue 29): every tensor must be
one this core would save, with its shape and dtype, and finite; the optimizer's
state per slice exactly what the optimizer keeps (learned from a step of the
same optimizer on a two-element tensor); every hyperparameter finite and within
the bounds the optimizer's own constructor enforces; counters integers >= 0.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from paramserver.core.probe import all_finite
from paramserver.core.pullsqueeze import check_counts
from paramserver.core.records import DTYPES, check_tensors
from paramserver.errors import ConfigError, ProtocolError

if TYPE_CHECKING:  # core imports this module to save and load itself
    from paramserver.core.corestate import CoreState

__all__ = ["load", "save"]


def save(core: CoreState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Everything needed to resume ``core``: (tensors, JSON-able metadata)."""
    tensors = {f"param/{k}": p.detach() for k, p in core.params.items()}
    scheduler, momentum = core.stepper.scheduler, core.stepper.momentum
    opt = core.stepper.state_dict()
    opt_meta: dict[str, Any] = {"param_groups": opt["param_groups"], "state": {}}
    for index, entries in opt["state"].items():
        opt_meta["state"][str(index)] = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{name}"] = value
            else:
                opt_meta["state"][str(index)][name] = value
    sync = core.round
    for key, buf in sync.saved_sums().items():
        tensors[f"agg/{key}"] = buf
    for worker, snap in core.read_weights.items():
        for key, t in snap.items():
            tensors[f"read/{worker}/{key}"] = t
    pull_counts: dict[str, list[int]] = {}
    if core.squeeze is not None:  # each worker's reconstruction, for compressed pulls
        held, pull_counts = core.squeeze.state()
        tensors.update(held)
    meta = {
        "shard": core.config.shard,
        "version": core.version,
        "initialized": core.initialized,
        "started": core.started,
        "mode": core.mode.describe(),
        "workers": {str(w.worker): w.record() for w in core.workers.values()},
        "round": sorted(sync.members),
        "round_samples": sync.samples,
        "round_accepted": sync.accepted,
        # a push in the making is not saved: its parts in the buffer void the round
        "round_void": sync.void or sync.in_flight(),
        "rounds_voided": sync.voided,
        "max_answered_gap": core.max_answered_gap,
        "rounds_dropped": sync.dropped,
        # which sync round the shard stands at: checkpoints of several shards resume
        # together only at the same closed round, none open (persist/checkpoint.py)
        "rounds_closed": sync.closed,
        "between_rounds": core.between_rounds,
        "optimizer": opt_meta,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "policy": {"name": core.policy.name, "state": core.policy.state_dict()},
        "momentum": momentum.state_dict() if momentum is not None else None,
    }
    if pull_counts:
        meta["pull_counts"] = pull_counts
    return tensors, meta


_TENSOR = re.compile(r"^(param|agg)/(.+)$|^optim/(\d{1,9})/(\w+)$|^(?:read|pull)/(\d{1,9})/(.+)$")
_Kept = tuple[tuple[int, ...] | None, torch.dtype]  # a state entry's shape (None: a number)
_SPARSE = ("sparse/", "sparse_optim/", "sparse_momentum/")
_COUNTERS = ("version", "round_samples", "round_accepted", "rounds_voided",
             "rounds_dropped", "max_answered_gap", "rounds_closed")


def check(core: CoreState, tensors: Mapping[str, torch.Tensor],
          meta: Mapping[str, Any]) -> None:
    """Refuse a snapshot that ``core`` would not have saved (:class:`ConfigError`, one
    line naming the field): a tensor missing, extra, of another shape or dtype, or not
    finite; optimizer state other than the optimizer keeps; a hyperparameter not
    finite or outside its optimizer's bounds; a counter not an integer >= 0."""
    groups: dict[str, dict[str, torch.Tensor]] = {"param": {}, "agg": {}}
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith(_SPARSE):
            continue  # the sparse tables' (SparseShard.load_state_dict checks them)
        m = _TENSOR.match(name)
        if m is None:
            raise ConfigError(f"tensor {name!r} is not one a checkpoint holds")
        if not value.is_floating_point() or not all_finite(value):
            raise ConfigError(f"tensor {name!r} holds NaN or Inf, or is not floating point")
        if m.group(1):
            groups[m.group(1)][m.group(2)] = value
        elif m.group(3):
            state.setdefault(int(m.group(3)), {})[m.group(4)] = value
        else:
            _fits(core, {m.group(6): value}, name, whole=False)
    _fits(core, groups["param"], "weights (param/*)", whole=True)
    _fits(core, groups["agg"], "round sums (agg/*)", whole=False)
    try:
        check_counts(meta.get("pull_counts", {}))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for field in _COUNTERS:
        value = meta.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"field {field!r} must be an integer >= 0, got {value!r}")
    for field in ("initialized", "started", "round_void", "between_rounds"):
        if not isinstance(meta.get(field, False), bool):
            raise ConfigError(f"field {field!r} must be true or false")
    members = meta.get("round", [])
    if not isinstance(members, list) or not all(
            isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in members):
        raise ConfigError("field 'round' must be a list of worker ids")
    _check_optimizer(core, meta.get("optimizer"), state)
    scheduler = core.stepper.scheduler
    if scheduler is not None and meta.get("scheduler") is not None:
        _like(meta["scheduler"], scheduler.state_dict(), "scheduler", top=True)
    momentum = core.stepper.momentum
    if momentum is not None and meta.get("momentum"):
        _like(meta["momentum"], momentum.state_dict(), "momentum", top=True)


def _fits(core: CoreState, tensors: Mapping[str, torch.Tensor], what: str,
          whole: bool) -> None:
    try:
        check_tensors(core.specs, tensors, what, whole=whole)
    except ProtocolError as exc:
        raise ConfigError(exc.reason) from exc


def _check_optimizer(core: CoreState, saved: Any,
                     tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
    """The optimizer's saved state and hyperparameters, against what it keeps."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise ConfigError("field 'optimizer' must hold 'state' and 'param_groups'")
    live = core.stepper.state_dict()["param_groups"]
    if len(saved["param_groups"]) != len(live):
        raise ConfigError(f"field 'optimizer.param_groups' has {len(saved['param_groups'])} "
                          f"groups, the optimizer {len(live)}")
    cls = type(core.stepper.optimizer)
    takes = _arguments(cls, live[0])
    for i, (group, ours) in enumerate(zip(saved["param_groups"], live, strict=True)):
        where = f"optimizer.param_groups[{i}]"
        # a scheduler adds initial_lr: a checkpoint with or without one may be resumed
        # with or without a scheduler
        if not isinstance(group, dict) or not set(ours) - {"initial_lr"} <= set(group) \
                <= set(ours) | {"initial_lr"}:
            raise ConfigError(f"field {where!r} must have the keys {sorted(ours)}")
        if group["params"] != ours["params"]:
            raise ConfigError(f"field '{where}.params' is {str(group['params'])[:60]}, "
                              f"want {str(ours['params'])[:60]}")
        for key, value in group.items():
            if key != "params":
                _like(value, ours.get(key, 0.0), f"{where}.{key}")
        try:  # the bounds the optimizer's constructor enforces (lr >= 0, betas in [0, 1))
            cls([torch.zeros(1)], **{k: v for k, v in group.items() if k in takes})
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConfigError(f"field {where!r}: {exc}") from exc
    expected = _state_kept(cls, saved["param_groups"][0], takes,
                           {DTYPES[s.dtype] for s in core.specs.values()})
    slices = list(core.specs.values())
    indices = set(tensors) | {_index(k) for k in saved["state"]}
    for index in sorted(indices):
        where = f"optimizer.state[{index}]"
        if index >= len(slices):
            raise ConfigError(f"field {where!r}: the shard has {len(slices)} slices")
        spec = slices[index]
        values: dict[str, Any] = dict(tensors.get(index, {}))
        plain = saved["state"].get(str(index), {})
        if not isinstance(plain, dict) or set(plain) & set(values):
            raise ConfigError(f"field {where!r} must be an object, apart from its tensors")
        values.update(plain)
        want = expected[DTYPES[spec.dtype]]
        if set(values) != set(want):
            raise ConfigError(f"field {where!r} holds {sorted(values)}, the optimizer keeps "
                              f"{sorted(want)}")
        for name, value in values.items():
            shape, dtype = want[name]
            if shape is None:  # not a tensor (a step count kept as a number)
                _like(value, 0.0, f"{where}.{name}")
                continue
            shape = (spec.numel,) if shape == (2,) else shape
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape \
                    or value.dtype != dtype:
                got = (f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ConfigError(f"field {where}.{name} is {got}, the optimizer keeps "
                                  f"{dtype} {list(shape)}")


def _arguments(cls: type, group: Mapping[str, Any]) -> set[str]:
    """The hyperparameters of a group that ``cls``'s constructor takes."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return set(group) - {"params", "initial_lr"}
    return {p.name for p in params} - {"params"}


def _index(key: Any) -> int:
    if not isinstance(key, str) or not key.isdigit() or len(key) > 9:
        raise ConfigError(f"field 'optimizer.state' has the key {str(key)[:20]!r}, not an index")
    return int(key)


def _state_kept(cls: type[torch.optim.Optimizer], group: Mapping[str, Any], takes: set[str],
                dtypes: set[torch.dtype]
                ) -> dict[torch.dtype, dict[str, _Kept]]:
    """What ``cls`` keeps per parameter of each dtype once it stepped, learned from one
    step on two elements: name -> (shape, (2,) meaning the parameter's; dtype)."""
    kept: dict[torch.dtype, dict[str, _Kept]] = {}
    for dtype in dtypes:
        p = torch.zeros(2, dtype=dtype)
        opt = cls([p], **{k: v for k, v in group.items() if k in takes})
        p.grad = torch.zeros(2, dtype=dtype)
        opt.step()
        entries: dict[str, _Kept] = {}
        for name, v in opt.state[p].items():
            entries[str(name)] = ((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                                  else (None, dtype))
        kept[dtype] = entries
    return kept


def _like(value: Any, ours: Any, field: str, top: bool = False) -> None:
    """``value`` has the form of ``ours`` (a live value of the same field); numbers
    finite. ``top``: a dict whose keys must be ``ours``' (state a load sets as is)."""
    if isinstance(ours, bool) or ours is None:
        ok = isinstance(value, bool) if isinstance(ours, bool) else (
            value is None or isinstance(value, bool | str) or _finite_number(value))
    elif isinstance(ours, int | float):
        ok = _finite_number(value)
    elif isinstance(ours, str):
        ok = isinstance(value, str)
    elif isinstance(ours, list | tuple):
        ok = isinstance(value, list | tuple) and len(value) == len(ours)
        if ok:
            for i, (v, o) in enumerate(zip(value, ours, strict=True)):
                _like(v, o, f"{field}[{i}]")
    elif isinstance(ours, dict):
        ok = isinstance(value, dict) and (set(value) == set(ours) if top
                                          else set(value) <= set(ours))
        if ok:
            for k, v in value.items():
                _like(v, ours[k], f"{field}.{k}")
    else:  # a tensor or another object: a checkpoint's JSON cannot hold one
        ok = False
    if not ok:
        raise ConfigError(f"field {field!r} is {str(value)[:60]}, want a value like "
                          f"{str(ours)[:60]} (finite)")


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


def load(core: CoreState, tensors: Mapping[str, torch.Tensor],
         meta: Mapping[str, Any]) -> None:
    """Put :func:`save`'s output back into ``core``, all but its workers (their
    records are ``meta["workers"]``). Nothing changes unless :func:`check` passes."""
    check(core, tensors, meta)
    with torch.no_grad():
        for key, p in core.params.items():
            p.copy_(tensors[f"param/{key}"])
    opt_state: dict[int, dict[str, Any]] = {}
    for index, entries in meta["optimizer"]["state"].items():
        opt_state[int(index)] = dict(entries)
    for name, value in tensors.items():
        if name.startswith("optim/"):
            _, index, field_name = name.split("/", 2)
            opt_state.setdefault(int(index), {})[field_name] = value.clone()
    core.stepper.load_state_dict(
        {"state": opt_state, "param_groups": meta["optimizer"]["param_groups"]}
    )
    if core.stepper.scheduler is not None and meta.get("scheduler") is not None:
        core.stepper.scheduler.load_state_dict(meta["scheduler"])
    core.policy.load_state_dict(meta.get("policy", {}).get("state", {}))
    core.version = int(meta["version"])
    core.initialized = bool(meta["initialized"])
    core.members.started = bool(meta["started"])
    core.max_answered_gap = int(meta.get("max_answered_gap", 0))
    sync = core.round
    sync.dropped = int(meta.get("rounds_dropped", 0))
    sync.closed = int(meta.get("rounds_closed", 0))
    sync.members = set(meta.get("round", []))
    sync.samples = int(meta.get("round_samples", 0))
    # older snapshots: every member with samples counted as one contributor
    sync.accepted = int(meta.get("round_accepted", len(sync.members) if sync.samples else 0))
    if core.stepper.momentum is not None and meta.get("momentum"):
        core.stepper.momentum.load_state_dict(meta["momentum"])
    sync.agg = {k[len("agg/"):]: v.clone() for k, v in tensors.items()
                if k.startswith("agg/")}
    sync.void = bool(meta.get("round_void", False))
    sync.voided = int(meta.get("rounds_voided", 0))
    sync.written = set(sync.agg) if sync.samples > 0 else set()
    sync.streams = {}
    core.read_weights = {}
    for name, value in tensors.items():
        if name.startswith("read/"):
            _, worker, key = name.split("/", 2)
            core.read_weights.setdefault(int(worker), {})[key] = value.clone()
    if core.squeeze is not None:  # (a run resumed without --pull-compression: dropped)
        core.squeeze.load(tensors, meta.get("pull_counts", {}))
