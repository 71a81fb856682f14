"""Replay a traced run on the real shard core: ``paramserver simulate --replay TRACE``.

A trace (paramserver/observe/trace.py) says, for every shard, in the order the shard
saw them, which push arrived (worker, clock) and which pull was answered. The replay
builds each shard's core as the shard built it (``ServerConfig.new_core``: the same
optimizer, policy, mode), each worker's task as the worker built it (its rank, seed
and batches), and walks the shards' records in their order:

* a pull answered: the worker's copy of the shard's weights *now* (with
  ``--pull-compression``, its reconstruction, moved on by the compressed change the
  shard's answer carried: core/pullsqueeze.py);
* a push arrived: the worker's gradient, recomputed on the weights it read (every
  shard's copy from its pull before that push) from its next batches, exactly as
  workers/worker.py computes it, and pushed into the core at the recorded time.

With the recorded configuration every decision, weight and version comes out as
recorded and the final weights are the real run's bit for bit. What that needs:
the same task, seed and batch order (each rank draws its own batches in clock order);
the same initial weights (rank 0's model seeds the shards, as INIT did); the same
torch thread count as the worker had for the gradients (the trace's header records
it; launched workers run with one) and as the shard had for its steps; pushes taken
whole (a sync push in parts is added part by part at the shard, whose order a trace
does not keep).

With another policy, optimizer, staleness bound or compressor (the *counterfactual*)
the arrivals and pulls keep their recorded order and times; a worker then reads
whatever the counterfactual shard holds at that moment, which may be another version
than recorded: the replay follows the recorded timing, not the recorded versions, and
its result says how many reads and decisions differ. A pull the new bound would have
held is answered anyway (counted as ``gates_overridden``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paramserver.compress import Encoder, parse_compression
from paramserver.compress.registry import compressor_name
from paramserver.core.shard import ShardCore
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, ProtocolError
from paramserver.observe import trace as tr
from paramserver.server.config import ServerConfig
from paramserver.util.plugins import names_from
from paramserver.wire.compressed import expand
from paramserver.workers.config import WorkerConfig
from paramserver.workers.launch.virtual import SimulationError
from paramserver.workers.tasks import Task, evaluate
from paramserver.workers.worker import build_task, cycle_batches

__all__ = ["Changes", "ReplayResult", "replay", "replay_dir"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Changes:
    """What a counterfactual replay changes (None: as recorded)."""

    policy: str | None = None
    policy_args: Mapping[str, Any] | None = None
    optimizer: str | None = None
    optimizer_args: Mapping[str, Any] | None = None
    staleness_bound: int | None = None
    compression: str | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))

    def describe(self) -> str:
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return ", ".join(f"{k}={v}" for k, v in given.items()) or "as recorded"


@dataclass
class ReplayResult:
    """What a replay gives: the final weights and how it went against the record."""

    weights: dict[str, torch.Tensor]  # the model's parameters, by name
    changes: str
    pushes: int = 0
    accepted: int = 0
    decisions_differ: int = 0  # accept, weight or version unlike the record's
    reads_differ: int = 0  # pulls that read another version than recorded
    gates_overridden: int = 0  # pulls the core would have held, answered as recorded
    eval: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def reproduced(self) -> bool:
        return self.decisions_differ == 0 and self.reads_differ == 0

    def to_json(self) -> dict[str, Any]:
        return {"changes": self.changes, "pushes": self.pushes, "accepted": self.accepted,
                "decisions_differ": self.decisions_differ, "reads_differ": self.reads_differ,
                "gates_overridden": self.gates_overridden, "reproduced": self.reproduced,
                "eval": self.eval, "note": self.note}


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    if n > 0 and n != saved:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != saved:
            torch.set_num_threads(saved)


@dataclass
class _Rank:
    """One worker as the replay recomputes it."""

    config: WorkerConfig
    task: Task
    params: dict[str, torch.Tensor]
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    threads: int
    encoder: Encoder | None
    last_clock: int = -1


def _check(trace: tr.Trace) -> None:
    capped = [f"shard{k}" for k, s in trace.shards.items() if s.capped]
    capped += [f"worker{r}" for r, w in trace.workers.items() if w.capped]
    if capped:
        raise ConfigError(f"the trace of {', '.join(capped)} reached its cap and stopped "
                          f"recording: a replay needs the whole run")
    if 0 not in trace.shards:
        raise ConfigError(f"the trace in {trace.directory} has no file of shard 0")
    num = ServerConfig.from_dict(trace.server_config).num_shards
    missing = sorted(set(range(num)) - set(trace.shards))
    if missing:
        raise ConfigError(f"the trace has no file of shard(s) {missing} (of {num})")
    if not trace.workers:
        raise ConfigError(f"the trace in {trace.directory} has no worker<r>.pstrace: the "
                          f"replay needs each worker's task and seed")
    torn = [f"shard{k}" for k, s in trace.shards.items() if not s.whole]
    if torn:
        log.warning("the trace of %s has no end record (the process did not close it): "
                    "replaying what it holds", ", ".join(torn))


class _Replay:
    def __init__(self, trace: tr.Trace, changes: Changes) -> None:
        _check(trace)
        self.trace, self.changes = trace, changes
        self.servers = [self._server(ServerConfig.from_dict(trace.shards[k].header.config))
                        for k in range(len(trace.shards))]
        self.ranks = {r: self._rank(w) for r, w in sorted(trace.workers.items())}
        first = self.ranks[min(self.ranks)]
        self.plan = ShardPlan.from_module(first.task.model, len(self.servers),
                                          first.config.chunk_bytes)
        self.cores: list[ShardCore] = []
        t0 = min((e.t for s in trace.shards.values() for e in s.events
                  if isinstance(e, (tr.Arrival, tr.Served))), default=0.0)
        init = self.plan.split_tensors({k: p.detach() for k, p in first.params.items()})
        for k, server in enumerate(self.servers):
            with _threads(trace.shards[k].header.threads or server.threads):
                core = server.new_core(self.plan)
            for r in self.ranks:
                core.register(r, f"replay-{r}", t0)
            core.initialize({key: t.clone() for key, t in init[k].items()})
            self.cores.append(core)
        self.result = ReplayResult({}, changes.describe())
        # (shard, worker, clock) -> (version, weights) read there; weights shared per version
        self.reads: dict[tuple[int, int, int], tuple[int, dict[str, torch.Tensor]]] = {}
        self._copies: list[tuple[int, dict[str, torch.Tensor]] | None] = [None] * len(self.cores)
        # (worker, clock) -> the gradients still to push (by shard), samples, versions read
        self.grads: dict[tuple[int, int],
                         tuple[dict[int, dict[str, torch.Tensor]], int, list[int]]] = {}

    def _server(self, config: ServerConfig) -> ServerConfig:
        c = self.changes
        mode = config.mode
        if c.staleness_bound is not None and mode != "ssp":
            raise ConfigError(f"--staleness-bound changes an ssp run's bound; this run is "
                              f"{mode}")
        return dataclasses.replace(
            config, trace=None, event_log=None,
            policy=config.policy if c.policy is None else c.policy,
            policy_args=dict(config.policy_args if c.policy_args is None and c.policy is None
                             else c.policy_args or {}),
            optimizer=config.optimizer if c.optimizer is None else c.optimizer,
            optimizer_args=dict(config.optimizer_args if c.optimizer_args is None
                                else {**config.optimizer_args, **c.optimizer_args}),
            staleness_bound=(config.staleness_bound if c.staleness_bound is None
                             else c.staleness_bound))

    def _rank(self, w: tr.WorkerTrace) -> _Rank:
        config = WorkerConfig.from_dict(w.header.config)
        if config.local_optimizer is not None:
            raise ConfigError("the replay recomputes one gradient per push of the built-in "
                              "loop: a run with local SGD cannot be replayed")
        task = build_task(config)
        model = task.model.cpu()
        compression = (config.compression if self.changes.compression is None
                       else self.changes.compression)
        encoder = (None if compression in (None, "none")
                   else Encoder(parse_compression(compression), seed=config.rank))
        return _Rank(config, task, dict(model.named_parameters()), cycle_batches(task),
                     w.header.threads, encoder)

    # ------------------------------------------------------------------ the walk

    def run(self) -> ReplayResult:
        cursors = [0] * len(self.cores)
        events = [self.trace.shards[k].events for k in range(len(self.cores))]
        while True:
            moved = False
            for k, core in enumerate(self.cores):
                while cursors[k] < len(events[k]):
                    if not self._handle(k, core, events[k][cursors[k]]):
                        break
                    cursors[k] += 1
                    moved = True
            if all(c == len(e) for c, e in zip(cursors, events, strict=True)):
                break
            if not moved:
                k = next(i for i, c in enumerate(cursors) if c < len(events[i]))
                e = events[k][cursors[k]]
                raise SimulationError(
                    f"the trace is inconsistent: shard {k}'s record {cursors[k]} is a push "
                    f"of worker {getattr(e, 'worker', '?')} at clock {getattr(e, 'clock', '?')}"
                    f" whose pulls are not in every shard's trace before it")
        return self._finish()

    def _handle(self, k: int, core: ShardCore, e: object) -> bool:
        if isinstance(e, tr.Served):
            self._served(k, core, e)
        elif isinstance(e, tr.Arrival):
            return self._arrival(k, core, e)
        elif isinstance(e, tr.Left):
            with _threads(self.trace.shards[k].header.threads):
                core.leave(e.worker, e.t)
        return True

    def _served(self, k: int, core: ShardCore, e: tr.Served) -> None:
        if e.worker not in self.ranks:
            return  # (an observer, or a worker without a trace: reads nothing we recompute)
        core.request_pull(e.worker, e.clock, ("replay", e.worker), e.t)
        answered = {r.worker for r in core.ready_pulls(e.t)}
        if e.worker not in answered:
            self.result.gates_overridden += 1
        if core.squeeze is not None:  # compressed pulls: it reads its reconstruction,
            # moved on as the shard's answer moved it (core/pullsqueeze.py; no answer is
            # lost in a replay, so it names the count it holds)
            core.squeeze.ask(e.worker, core.squeeze.counts.get(e.worker, -1))
            core.answer_squeezed(e.worker, core.version)
            held = core.squeeze.held[e.worker]
            if core.version != e.version:
                self.result.reads_differ += 1
            self.reads[(k, e.worker, e.clock)] = (
                core.version, {key: t.clone() for key, t in held.items()})
            return
        copy = self._copies[k]
        if copy is None or copy[0] != core.version:
            copy = (core.version, {key: p.detach().clone() for key, p in core.params.items()})
            self._copies[k] = copy
        if copy[0] != e.version:
            self.result.reads_differ += 1
        self.reads[(k, e.worker, e.clock)] = copy

    def _arrival(self, k: int, core: ShardCore, e: tr.Arrival) -> bool:
        key = (e.worker, e.clock)
        if key not in self.grads:
            if not all((j, e.worker, e.clock) in self.reads for j in range(len(self.cores))):
                return False  # another shard's pull first
            self._compute(e.worker, e.clock)
        per_shard, samples, versions = self.grads[key]
        version = versions[k]
        with _threads(self.trace.shards[k].header.threads):
            try:
                out = core.push(e.worker, e.push_id, e.clock, version, samples,
                                per_shard.pop(k), e.t)
            except ProtocolError as exc:
                raise SimulationError(f"shard {k} refused worker {e.worker}'s push at clock "
                                      f"{e.clock} in the replay: {exc}") from exc
        assert out is not None
        if not per_shard:
            del self.grads[key]
        if k == 0:
            self.result.pushes += 1
            self.result.accepted += out.accepted
        if (out.accepted, out.weight, out.version) != (e.accepted, e.weight, e.version):
            self.result.decisions_differ += 1
        return True

    def _compute(self, worker: int, clock: int) -> None:
        """The worker's gradient at ``clock``, as workers/worker.py's _compute makes it."""
        rank = self.ranks[worker]
        if clock <= rank.last_clock:
            raise SimulationError(f"worker {worker} pushed clock {clock} after {rank.last_clock}"
                                  f": a trace of a restarted worker cannot be replayed")
        rank.last_clock = clock
        merged: dict[str, torch.Tensor] = {}
        versions = []
        for j in range(len(self.cores)):
            version, weights = self.reads.pop((j, worker, clock))
            versions.append(version)
            merged.update(weights)
        model = rank.task.model
        with torch.no_grad():
            self.plan.assemble_into(rank.params, merged)
        micro = rank.config.push_every
        with _threads(rank.threads):
            model.train()
            model.zero_grad(set_to_none=True)
            drawn = [next(rank.batches) for _ in range(micro)]
            sizes = [int(t.shape[0]) for _, t in drawn]
            total = sum(sizes)
            for (inputs, targets), n in zip(drawn, sizes, strict=True):
                loss = rank.task.loss_fn(model(inputs), targets)
                (loss * (n / total)).backward()
        grads = {name: p.grad if p.grad is not None else torch.zeros_like(p)
                 for name, p in rank.params.items()}
        model.zero_grad(set_to_none=True)
        per_shard = self.plan.split_tensors(grads)
        if rank.encoder is not None:  # encoded as the worker's client does, decoded as the
            per_shard = {j: expand(rank.encoder.encode(t), self.cores[j].specs)  # shard does
                         for j, t in per_shard.items()}
        self.grads[(worker, clock)] = ({j: dict(t) for j, t in per_shard.items()}, total,
                                       versions)

    def _finish(self) -> ReplayResult:
        merged: dict[str, torch.Tensor] = {}
        for core in self.cores:
            merged.update({key: p.detach() for key, p in core.params.items()})
        evaluator = self.ranks[min(self.ranks)]
        with torch.no_grad():
            self.plan.assemble_into(evaluator.params, merged)
        result = self.result
        result.weights = {n: p.detach().clone() for n, p in evaluator.params.items()}
        result.eval = evaluate(evaluator.task, evaluator.task.model)
        if self.changes.any:
            result.note = (f"counterfactual ({self.changes.describe()}): the recorded timing "
                           f"was followed, not the recorded versions; {result.reads_differ} "
                           f"pulls read another version than recorded, "
                           f"{result.decisions_differ} decisions differ"
                           + (f", {result.gates_overridden} pulls answered that the new "
                              f"bound would have held" if result.gates_overridden else ""))
        elif result.reproduced:
            result.note = "reproduced: every read, decision and version as recorded"
        else:
            result.note = (f"NOT reproduced: {result.reads_differ} reads and "
                           f"{result.decisions_differ} decisions differ from the record")
        return result


def replay(trace: tr.Trace, changes: Changes | None = None, *,
           trust_plugins: bool = False) -> ReplayResult:
    """Re-run ``trace``'s schedule on the real core (see the module's docstring).

    The trace names the run's task, policy, optimizer and compressor. A plug-in among
    them (``module:name``) is code the replay would import and run, so it is refused
    unless ``trust_plugins`` (the trace is a file anyone may have written), or unless
    ``changes`` names it (the user did)."""
    changes = changes or Changes()
    allow = [changes.policy, changes.optimizer,
             None if changes.compression is None else compressor_name(changes.compression)]
    with names_from(f"the trace in {trace.directory}", trusted=trust_plugins, allow=allow):
        return _Replay(trace, changes).run()


def replay_dir(directory: str | Path, changes: Changes | None = None, *,
               trust_plugins: bool = False) -> ReplayResult:
    """:func:`replay` of a run directory's ``trace/`` (or a trace directory)."""
    return replay(tr.read_trace_dir(directory), changes, trust_plugins=trust_plugins)


def final_weights(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """A real run's final parameters (``final_model.safetensors``)."""
    from safetensors.torch import load_file

    path = Path(run_dir) / "final_model.safetensors"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: the run saved no final weights")
    return load_file(str(path))


def compare(weights: Mapping[str, torch.Tensor], real: Mapping[str, torch.Tensor]
            ) -> tuple[bool, float]:
    """(bit for bit equal, the largest absolute difference) over ``weights``' tensors."""
    equal, worst = True, 0.0
    for name, w in weights.items():
        r = real.get(name)
        if r is None or r.shape != w.shape:
            return False, math.inf
        if not torch.equal(w, r):
            equal = False
            worst = max(worst, float((w.double() - r.double()).abs().max()))
    return equal, worst
