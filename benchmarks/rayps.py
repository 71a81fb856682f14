"""Ray's actor parameter server: what a Python user would pick instead of this project.

The pattern of Ray's parameter-server example: one actor holds the weights as
numpy arrays and runs ``w -= lr * g``; a worker calls
``ray.get(ps.push_pull.remote(*grads))`` and copies the returned weights into
its own (they come back read-only from Ray's shared-memory object store; every
other system here also ends with the worker's own copy). With N workers in the
sweep the actor is threaded (``max_concurrency=N``) and waits for all N
gradients before one step, like a sync round; in the async measurement it runs
one call at a time and steps on every push.

A Ray cluster is started on this host by one agent (:func:`serve`: the head,
its own processes, the actor) and workers connect to it as drivers. Ray does
not shard, so like torch RPC and gloo it is measured once per (workers,
payload). Ray is an optional extra (``pip install paramserver[bench]``); the
module imports it only when a Ray op runs.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from paramserver.util.jsontypes import JSONObject

from .common import Announce, integer, number, rounds_until_stopped, text

__all__ = ["ParameterServer", "RaySession", "async_run", "available", "serve", "stop",
           "version"]

log = logging.getLogger(__name__)

NAMESPACE = "paramserver-bench"
_ACTOR = "ps"
_F32 = np.dtype(np.float32)


@dataclass
class _Head:
    """The head agent's Ray session: its temp dir and the actor handle (None: none)."""

    temp_dir: str | None = None
    actor: Any = None  # a Ray actor handle (Ray is typed loosely: it may be absent)


_HEAD = _Head()


def _ray() -> Any:
    """Ray, imported on first use (typed loosely: the extra may be absent where mypy runs)."""
    import importlib

    return importlib.import_module("ray")


def available() -> bool:
    """Ray is installed (the ``bench`` extra), without importing it."""
    import importlib.util

    return importlib.util.find_spec("ray") is not None


class ParameterServer:
    """The actor's class: weights per payload shape, created on the first push of it."""

    def __init__(self, workers: int, lr: float) -> None:
        self.workers, self.lr = workers, np.float32(lr)
        self.weights: dict[tuple[tuple[int, ...], ...], list[np.ndarray]] = {}
        self.agg: list[np.ndarray] = []
        self.arrived = 0
        self.generation = 0
        self.version = 0  # steps taken, over every payload
        self.cond = threading.Condition()

    def ready(self) -> bool:
        return True

    def steps(self) -> int:
        return self.version

    def push_pull(self, *grads: np.ndarray) -> list[np.ndarray]:
        key = tuple(g.shape for g in grads)
        w = self.weights.get(key)
        if w is None:  # one payload alive at a time: drop the last one's arrays
            self.weights = {key: [np.zeros(g.shape, dtype=g.dtype) for g in grads]}
            w = self.weights[key]
        if self.workers == 1:
            for p, g in zip(w, grads, strict=True):
                p -= self.lr * g
            self.version += 1
            return w
        with self.cond:
            if self.arrived == 0:
                self.agg = [g.copy() for g in grads]
            else:
                for a, g in zip(self.agg, grads, strict=True):
                    a += g
            self.arrived += 1
            gen = self.generation
            if self.arrived == self.workers:  # the last gradient of the round: one step
                for p, a in zip(w, self.agg, strict=True):
                    p -= (self.lr / self.workers) * a
                self.arrived = 0
                self.generation += 1
                self.version += 1
                self.cond.notify_all()
            else:
                while self.generation == gen:
                    self.cond.wait()
        # nobody writes w until every worker has this reply and pushed again
        return w


def _init_head(cpus: int) -> tuple[str, str]:
    ray = _ray()

    # a short path of its own: Ray's unix sockets live under it (107-byte limit), and
    # every process of this cluster names it, which is how a leak would be found
    temp_dir = tempfile.mkdtemp(prefix="rayps", dir="/tmp")
    ctx = ray.init(num_cpus=cpus, include_dashboard=False, namespace=NAMESPACE,
                   _temp_dir=temp_dir, _node_ip_address="127.0.0.1", log_to_driver=False,
                   configure_logging=False)
    atexit.register(_shutdown)
    return str(ctx.address_info["gcs_address"]), temp_dir


def _shutdown() -> None:
    if _HEAD.temp_dir is None:
        return
    ray = _ray()

    ray.shutdown()
    shutil.rmtree(_HEAD.temp_dir, ignore_errors=True)
    _HEAD.temp_dir = _HEAD.actor = None


def serve(args: JSONObject, announce: Announce) -> JSONObject:
    """Start a Ray head in this agent and the parameter-server actor; return at once.

    ``args``: workers (the round's size; 1 steps on every push), lr, cpus. The
    cluster lives until :func:`stop` or the agent's exit.
    """
    ray = _ray()

    _shutdown()
    address, temp_dir = _init_head(integer(args, "cpus", 2))
    _HEAD.temp_dir = temp_dir
    workers = integer(args, "workers")
    actor = ray.remote(ParameterServer).options(
        name=_ACTOR, max_concurrency=max(1, workers)).remote(workers, number(args, "lr"))
    ray.get(actor.ready.remote())
    _HEAD.actor = actor
    return {"address": address, "temp_dir": temp_dir}


def version(args: JSONObject, announce: Announce) -> JSONObject:
    """The actor's step count (asked of the head agent)."""
    ray = _ray()

    return {"version": int(ray.get(_HEAD.actor.steps.remote()))}


def stop(args: JSONObject, announce: Announce) -> JSONObject:
    _shutdown()
    return {"stopped": True}


def _connect(address: str) -> Any:
    import os

    # a head started with Ray's defaults wants its token (kept in ~/.ray), which a driver
    # given an explicit address does not send unless told to (read when Ray is imported);
    # an environment that turned auth off for the head turns it off here too
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    ray = _ray()

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                 configure_logging=False, _node_ip_address="127.0.0.1")
    return ray.get_actor(_ACTOR)


class RaySession:
    """One worker, a driver of the head's cluster. ``args``: address, pieces (arrays per
    push; 1: the payload as one array)."""

    def __init__(self, args: JSONObject) -> None:
        self.actor = _connect(text(args, "address"))
        self.pieces = integer(args, "pieces", 1)
        self.numel = -1
        self.grads: list[np.ndarray] = []
        self.weights: list[np.ndarray] = []

    def _payload(self, numel: int) -> None:
        if numel == self.numel:
            return
        from .common import split_range

        self.numel = numel
        sizes = [b - a for a, b in split_range(numel, self.pieces)]
        self.grads = [np.full(n, 1e-3, dtype=_F32) for n in sizes]
        self.weights = [np.zeros(n, dtype=_F32) for n in sizes]

    def one_round(self) -> None:
        ray = _ray()

        out = ray.get(self.actor.push_pull.remote(*self.grads))
        for mine, theirs in zip(self.weights, out, strict=True):
            np.copyto(mine, theirs)

    def measure(self, numel: int, iters: int) -> float:
        self._payload(numel)
        t0 = time.perf_counter()
        for _ in range(iters):
            self.one_round()
        return (time.perf_counter() - t0) / iters

    def close(self) -> JSONObject:
        ray = _ray()

        first = self.weights[0] if self.weights else np.zeros(0, dtype=_F32)
        ray.shutdown()  # a driver only: the cluster is the head agent's
        return {"checksum": float(first[:16].sum())}


def async_run(args: JSONObject, announce: Announce) -> JSONObject:
    """Push + pull as fast as possible until ``stop_file`` exists (as ``ps_async``).

    ``args``: address, numel, pieces, warmup, stop_file."""
    session = RaySession(args)
    session._payload(integer(args, "numel"))
    try:
        rounds, seconds = rounds_until_stopped(session.one_round, args, announce, batch=20)
        return {"pushes": rounds, "seconds": seconds}
    finally:
        with contextlib.suppress(Exception):
            session.close()
