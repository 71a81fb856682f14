"""A shard core's snapshot: what a checkpoint holds to resume it, and back.

:func:`save` turns a :class:`~paramserver.core.ShardCore` into (tensors,
JSON-able metadata); :func:`load` puts them back. The format is the one
checkpoints have always held (paramserver/checkpoint.py writes and reads it):

* tensors: weights (``param/<key>``), optimizer state
  (``optim/<index>/<name>``), an open sync round's sums (``agg/<key>``) and the
  weights each worker read, for policies that need them (``read/<worker>/<key>``);
* metadata: versions, clocks, counters, each worker's record
  (:meth:`~paramserver.core.WorkerState.record`), the optimizer's and
  scheduler's non-tensor state and the policy's state.

A push still arriving in parts is not saved: its parts in the round's buffer
make the saved round void.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError
from .probe import all_finite
from .records import check_tensors

if TYPE_CHECKING:  # core imports this module to save and load itself
    from .core import ShardCore

__all__ = ["load", "save"]


def save(core: ShardCore) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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
    for key, buf in sync.agg.items():
        tensors[f"agg/{key}"] = buf
    for worker, snap in core.read_weights.items():
        for key, t in snap.items():
            tensors[f"read/{worker}/{key}"] = t
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
        "optimizer": opt_meta,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "policy": {"name": core.policy.name, "state": core.policy.state_dict()},
        "momentum": momentum.state_dict() if momentum is not None else None,
    }
    return tensors, meta


def check(core: ShardCore, tensors: Mapping[str, torch.Tensor],
          meta: Mapping[str, Any]) -> None:
    """Refuse a snapshot whose weights do not fit ``core``'s slices or are not finite,
    or whose version is not an integer >= 0 (:class:`ConfigError`, or the
    :class:`~paramserver.errors.ProtocolError` of a tensor that does not fit)."""
    weights = {k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")}
    check_tensors(core.specs, weights, "checkpoint")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"version must be an integer >= 0, got {version!r}")
    for key, value in weights.items():
        if value.is_floating_point() and not all_finite(value):
            raise ConfigError(f"weights {key!r} hold NaN or Inf")


def load(core: ShardCore, tensors: Mapping[str, torch.Tensor],
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
    core.started = bool(meta["started"])
    core.max_answered_gap = int(meta.get("max_answered_gap", 0))
    sync = core.round
    sync.dropped = int(meta.get("rounds_dropped", 0))
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
