"""Virtual-time simulator: many workers, one process, the real shard core.

``run_simulation(spec, out_dir)`` runs the configuration a
:class:`~paramserver.workers.launch.cluster.ClusterSpec` describes, as
:func:`~paramserver.workers.launch.cluster.run_cluster` would, but with no sockets and
no processes: one :class:`~paramserver.core.shard.ShardCore` per shard (split by the same
:class:`~paramserver.core.sharding.ShardPlan`), the same torch optimizer, staleness policy
and task, and M *virtual* workers whose steps take virtual time. So 64 or 256
workers fit on a laptop, and a run is exactly reproducible from its seed.

The model of time (all in virtual seconds):

* a worker's step takes ``Straggler(spec, seed=(seed, rank)).step_time(compute_time)``:
  the same :class:`~paramserver.workers.stragglers.StragglerSpec` and seeding a real worker
  uses, applied to a fixed bare compute time. That gives the distributions
  an experiment needs: constant (no straggler), persistent stragglers
  (``slowdown``), transient slow steps (``slow_prob``/``slow_factor``) and a
  shifted exponential or other heavy tail (``delay="exp:MEAN"``, ``pareto:...``).
* every message (pull, push, reply, bye) takes ``latency`` one way; shards
  answer instantly (no queueing at a shard).
* with a measured :class:`~paramserver.workers.launch.simtiming.Timing` instead
  (``paramserver plan``), compute is drawn from each worker's measured steps,
  messages pass the NICs' token buckets, and a shard decides one push at a time.
* the gradient itself is computed for real, on the weights the worker read,
  at the moment its pull completes; it is pushed when the step's time is up.
* with local SGD (``local_optimizer``, ``sync_every`` H) a worker's H inner steps
  run at once when its pull completes, with its own inner optimizer (its state
  kept across rounds, as a real worker keeps it); the pseudo-gradient is pushed
  after H step times, each drawn from the straggler scenario.

Events are processed in time order; ties in the order they were scheduled, so
a run is deterministic. The run directory has the layout of a real run
(``events/server<k>.jsonl``, ``events/worker<r>.jsonl``, ``results/worker<r>.json``,
``result.json``, ``final_model.safetensors``) with the same event kinds and
fields; ``t`` is virtual time, starting at 0. Report tools read either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from paramserver.compress import Encoder, parse_compression
from paramserver.core.optim import build_optimizer
from paramserver.core.records import PushOutcome
from paramserver.core.shard import GradStats, ShardCore, StepStats
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, ParamServerError, ProtocolError
from paramserver.observe import records as ev
from paramserver.observe.events import EventLog, write_json
from paramserver.util.jsontypes import JSONObject
from paramserver.wire.compressed import expand
from paramserver.workers.launch.clusterspec import ClusterSpec, Progress
from paramserver.workers.launch.results import (
    FINAL_WEIGHTS,
    ClusterResult,
    SimSummary,
    WorkerResult,
    shard_figures,
)
from paramserver.workers.launch.simtiming import Compute, Links, Timing
from paramserver.workers.stragglers import Straggler
from paramserver.workers.tasks import Task, evaluate
from paramserver.workers.worker import (
    UNCAPPED,
    WorkerConfig,
    build_task,
    cycle_batches,
    num_steps,
)

if TYPE_CHECKING:
    pass

__all__ = [
    "SimSpec",
    "SimulationError",
    "Simulator",
    "VirtualEventLog",
    "run_simulation",
]

log = logging.getLogger(__name__)

SIM_ADDRESS = "sim://shard{}"


class SimulationError(ParamServerError):
    """The simulated run could not finish (e.g. every worker is blocked forever)."""



def refuse_sparse(model: torch.nn.Module, task: str) -> None:
    """The simulator's shards are dense cores: a model with row-sparse tables
    (ShardedEmbedding) is refused by name instead of failing at its first lookup."""
    from paramserver.workers.embedding import sparse_modules

    tables = [name for name, _ in sparse_modules(model)]
    if tables:
        raise ConfigError(f"task {task!r} has row-sparse tables ({', '.join(tables)}); the "
                          "simulator holds dense parameters only: run it with "
                          "paramserver experiment")


def check_simulable(cluster: ClusterSpec) -> None:
    """Refuse up front, before any run, what the simulator cannot run."""
    config = dataclasses.replace(cluster.worker, rank=0, world_size=cluster.num_workers)
    refuse_sparse(build_task(config).model, config.task)

@dataclass(frozen=True)
class SimSpec:
    """How virtual time passes; the rest of a run is the ClusterSpec's."""

    compute_time: float = 0.01  # bare compute of one step, before straggler effects, seconds
    latency: float = 0.0  # one-way message time, seconds
    threads: int = 1  # torch intra-op threads while simulating (tiny models: 1 is fastest)
    progress_every: int = 200  # steps between on_progress calls

    def __post_init__(self) -> None:
        if not self.compute_time >= 0:
            raise ConfigError(f"compute_time must be >= 0 seconds, got {self.compute_time}")
        if not self.latency >= 0:
            raise ConfigError(f"latency must be >= 0 seconds, got {self.latency}")
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.progress_every < 1:
            raise ConfigError(f"progress_every must be >= 1, got {self.progress_every}")


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class VirtualEventLog(EventLog):
    """An :class:`~paramserver.observe.events.EventLog` stamped with virtual time, whose
    file is written afresh."""

    def __init__(self, path: str | Path | None, clock: Callable[[], float]) -> None:
        super().__init__(path, clock=clock, fresh=True)


@dataclass
class _VWorker:
    """One virtual worker: what a real worker process keeps between messages."""

    rank: int
    steps: int
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    straggler: Straggler
    events: VirtualEventLog
    #: local SGD: this worker's inner optimizer (over the shared model's parameters; its
    #: state is its own) and the inner steps per push; None and 1 push every step
    inner: torch.optim.Optimizer | None = None
    sync_every: int = 1
    #: --compression: the worker's encoder (its error-feedback residuals), None: none
    encoder: Encoder | None = None
    push_bytes: int = 0  # what the push in flight sends, all shards together
    #: per shard, what its last pull answer took (--pull-compression: compressed)
    pull_bytes: dict[int, int] = field(default_factory=dict)
    shard_bytes: dict[int, int] = field(default_factory=dict)  # ... and to each shard
    #: with a Timing: this worker's draws of measured compute times
    compute: Compute | None = None
    clock: int = 0
    push_id: int = 0
    final: bool = False  # the pull in flight is the one after the last step
    # the pull in flight
    pull_started: float = 0.0
    replies: dict[int, tuple[int, int, float, dict[str, torch.Tensor]]] = field(
        default_factory=dict)  # shard -> (version, clock, waited, weights)
    read_versions: list[int] = field(default_factory=list)
    pull_s: float = 0.0
    wait_s: float = 0.0
    # the step in flight
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    loss: float = 0.0
    num_samples: int = 0
    compute_s: float = 0.0
    sleep_s: float = 0.0
    push_started: float = 0.0
    outcomes: dict[int, PushOutcome] = field(default_factory=dict)
    # totals for the result file
    pushes: int = 0
    accepted: int = 0
    rejected: int = 0
    waited: float = 0.0
    losses: list[float] = field(default_factory=list)
    started: float = 0.0
    budget_spent: bool = False
    result: WorkerResult | None = None


class Simulator:
    """Runs one ClusterSpec in virtual time. Use :func:`run_simulation` unless you
    need the live objects (``cores``, ``workers``, ``model``) afterwards."""

    def __init__(self, spec: ClusterSpec, sim: SimSpec | None = None,
                 out_dir: str | Path | None = None, timing: Timing | None = None) -> None:
        self.spec = spec
        self.sim = sim or SimSpec()
        # a measured model of time (paramserver plan): compute drawn per worker, NICs
        # that queue, shards that take time per push; None: SimSpec's fixed times
        self.timing = timing
        self._links = Links(timing) if timing is not None else None
        self._busy = [0.0] * spec.num_servers  # with a Timing: when each shard is next free
        self.out = Path(out_dir) if out_dir is not None else None
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._steps_done = 0
        self._end = 0.0  # when the last worker finished
        # the evaluator, once done: as opt.final() in a real run, it evaluates the final
        # weights once every worker is done (_finish), and ends then
        self._evaluator: _VWorker | None = None
        self._last_loss: dict[int, float] = {}
        self._on_progress: Callable[[Progress], None] | None = None
        with _torch_threads(self.sim.threads):
            self._build()

    def _build(self) -> None:
        spec = self.spec
        # the task: rank 0's model computes every worker's gradient (all ranks start
        # from the same weights, by the task contract); each rank keeps its own data
        config0 = self._worker_config(0)
        self.task: Task = build_task(config0)
        self.model = self.task.model.cpu()
        refuse_sparse(self.model, config0.task)
        self.params = dict(self.model.named_parameters())
        self.plan = ShardPlan.from_module(self.model, spec.num_servers, config0.chunk_bytes)
        self._nbytes = self.plan.shard_bytes  # per shard, for the step events' byte counts

        self.server_events = [self._log(f"server{k}") for k in range(spec.num_servers)]
        self.cores: list[ShardCore] = []
        # the figures a real shard's observer logs with each push (gradient norm, cosine)
        self._grad: list[GradStats | None] = [None] * spec.num_servers
        for k in range(spec.num_servers):
            server = dataclasses.replace(spec.server, shard=k, num_shards=spec.num_servers,
                                         expected_workers=spec.num_workers)
            core = server.new_core(self.plan)  # as a shard server makes it (a policy each)
            watchdog = server.watchdog_config()  # measured as a real shard measures them
            cosine = watchdog.enabled and "gradient_disagrees" not in watchdog.disable
            core.observe(self._observer(k), cosine_decay=0.97 if cosine else None,
                         every=watchdog.observe_every)
            self.cores.append(core)
            described = server.to_dict()
            described["event_log"] = str(self._path(f"server{k}")) if self.out else None
            self.server_events[k].write(ev.ServerStart(shard=k, address=SIM_ADDRESS.format(k),
                                                       config=described))

        self.workers: list[_VWorker] = []
        for rank in range(spec.num_workers):
            config = self._worker_config(rank)
            # other ranks' models are dropped: only their data and loss are used
            task = self.task if rank == 0 else build_task(config)
            straggler = Straggler(config.straggler, seed=(config.seed, rank))
            steps = num_steps(config, task)
            inner = None
            if config.local_optimizer is not None:  # steps count gradients, the clock pushes
                inner = build_optimizer(config.local_optimizer, self.model.parameters(),
                                        config.local_args)
                steps = steps if steps == UNCAPPED else math.ceil(steps / config.sync_every)
            self.workers.append(_VWorker(
                rank=rank, steps=steps, batches=cycle_batches(task),
                loss_fn=task.loss_fn, straggler=straggler, events=self._log(f"worker{rank}"),
                inner=inner, sync_every=config.sync_every if inner is not None else 1,
                encoder=None if config.compression in (None, "none")
                else Encoder(parse_compression(config.compression), seed=rank),
                compute=None if self.timing is None
                else self.timing.sampler(rank, self.spec.worker.seed),
            ))

    # ------------------------------------------------------------------ plumbing

    def _observer(self, shard: int) -> Callable[[GradStats | StepStats], None]:
        def keep(stats: GradStats | StepStats) -> None:
            if isinstance(stats, GradStats):
                self._grad[shard] = stats
        return keep

    def _worker_config(self, rank: int) -> WorkerConfig:
        return dataclasses.replace(
            self.spec.worker, rank=rank, world_size=self.spec.num_workers,
            servers=[SIM_ADDRESS.format(k) for k in range(self.spec.num_servers)],
            straggler=self.spec.stragglers.get(rank, self.spec.worker.straggler),
            device="cpu", event_log=None, result_file=None,
        )

    def _path(self, name: str) -> Path:
        assert self.out is not None
        return self.out / "events" / f"{name}.jsonl"

    def _log(self, name: str) -> VirtualEventLog:
        return VirtualEventLog(self._path(name) if self.out else None, lambda: self.now)

    def _at(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (self.now + delay, next(self._seq), fn, args))

    def _send(self, w: _VWorker, shard: int, to_shard: bool, nbytes: int,
              fn: Callable[..., None], *args: Any) -> None:
        """A message between worker ``w`` and ``shard``: ``fn(*args)`` when it lands."""
        if self._links is None:
            self._at(self.sim.latency, fn, *args)
            return
        hosts = (w.rank, self.spec.num_workers + shard)
        src, dst = hosts if to_shard else hosts[::-1]
        self._at(self._links.arrival(self.now, src, dst, nbytes) - self.now, fn, *args)

    # ------------------------------------------------------------------ running

    def run(self, on_progress: Callable[[Progress], None] | None = None) -> ClusterResult:
        """Simulate to the end; returns (and, with an out_dir, writes) the result."""
        self._on_progress = on_progress
        wall0 = time.perf_counter()
        try:
            with _torch_threads(self.sim.threads):
                self.model.train()
                self.model.zero_grad(set_to_none=True)
                self._start()
                while self._queue:
                    self.now, _, fn, args = heapq.heappop(self._queue)
                    fn(*args)
                unfinished = [w.rank for w in self.workers
                              if w.result is None and w is not self._evaluator]
                if unfinished:
                    raise SimulationError(
                        f"no event left at virtual time {self.now:.3f}s but workers "
                        f"{unfinished[:10]} have not finished: each waits on a gate that "
                        f"nothing will open"
                    )
                return self._finish(time.perf_counter() - wall0)
        finally:
            for events in self.server_events:
                events.close()
            for w in self.workers:
                w.events.close()

    def _start(self) -> None:
        init = self.plan.split_tensors({k: p.detach() for k, p in self.params.items()})
        for k, core in enumerate(self.cores):
            for w in self.workers:
                state = core.register(w.rank, f"sim-{w.rank}", self.now)
                # the same record as a real shard's; a virtual worker has no host or pid
                self.server_events[k].write(ev.WorkerHello(shard=k, worker=w.rank,
                                                           clock=state.clock, host=None, pid=None,
                                                           joined="new", from_clock=None))
            if core.initialize({key: t.clone() for key, t in init[k].items()}):
                self.server_events[k].write(ev.Init(shard=k, worker=0))
        for w in self.workers:
            w.started = self.now
            w.events.write(ev.WorkerStart(worker=w.rank, clock=w.clock, seeded=w.rank == 0,
                                          device="sim", steps=w.steps, plan_hash=self.plan.hash))
            self._start_pull(w)

    def _start_pull(self, w: _VWorker) -> None:
        w.pull_started = self.now
        w.replies = {}
        for k in range(len(self.cores)):
            self._send(w, k, True, 0, self._pull_arrives, w, k)

    def _pull_arrives(self, w: _VWorker, shard: int) -> None:
        self.cores[shard].request_pull(w.rank, w.clock, w.rank, self.now)
        self._answer(shard)

    def _answer(self, shard: int) -> None:
        """Send every pull this shard can answer now, with the weights of this moment."""
        core = self.cores[shard]
        for reply in core.ready_pulls(self.now):
            weights = {key: p.detach().clone() for key, p in core.params.items()}
            w = self.workers[reply.worker]
            squeeze = core.squeeze
            w.pull_bytes[shard] = self._nbytes(shard)
            if squeeze is not None:  # --pull-compression: the worker's copy is the shard's
                squeeze.ask(reply.worker, squeeze.counts.get(reply.worker, -1))  # own
                answer = squeeze.answer(reply.worker, core.params, reply.version)
                assert answer is not None  # (the answer it sends, to the bit: pullsqueeze.py)
                w.pull_bytes[shard] = answer.nbytes
                weights = {k: t.clone() for k, t in squeeze.held[reply.worker].items()}
            self._send(w, shard, False, w.pull_bytes[shard], self._pull_reply, w, shard,
                       (reply.version, reply.clock, reply.waited, weights))

    def _pull_reply(self, w: _VWorker, shard: int,
                    reply: tuple[int, int, float, dict[str, torch.Tensor]]) -> None:
        w.replies[shard] = reply
        if len(w.replies) < len(self.cores):
            return
        shards = range(len(self.cores))
        w.read_versions = [w.replies[k][0] for k in shards]
        w.clock = max([w.clock] + [w.replies[k][1] for k in shards])
        w.wait_s = max(w.replies[k][2] for k in shards)
        w.waited += w.wait_s
        w.pull_s = self.now - w.pull_started
        merged: dict[str, torch.Tensor] = {}
        for k in shards:
            merged.update(w.replies[k][3])
        self.plan.assemble_into(self.params, merged)
        w.replies = {}
        config = self.spec.worker
        # the time budget, checked before each step as a real worker does; every virtual
        # worker starts at 0, so every mode ends within one step of the same virtual time
        if config.budget_seconds and self.now - w.started >= config.budget_seconds:
            w.budget_spent = True
            w.final = True
        if w.final:
            self._finish_worker(w)
            return
        if (w.rank == config.evaluator and config.eval_every
                and w.clock % config.eval_every == 0):
            self._eval(w)
        self._compute(w)
        # a round of local SGD takes its H steps' compute times, each drawn as a real
        # step's is; the overhead (the push's bookkeeping) once, as a real push's
        draws = [(self.sim.compute_time, 0.0) if w.compute is None else w.compute.draw()
                 for _ in range(w.sync_every)]
        step_time = sum(w.straggler.step_time(bare) for bare, _ in draws) + draws[0][1]
        w.compute_s = sum(bare for bare, _ in draws) + draws[0][1]
        if w.inner is not None and w.compute is not None:  # the round's own work
            round_extra = w.compute.draw_round()
            step_time += round_extra
            w.compute_s += round_extra
        w.sleep_s = step_time - w.compute_s
        self._at(step_time, self._push, w)

    def _gradient(self, w: _VWorker) -> tuple[int, float]:
        """One step's mean gradient into the parameters' ``.grad``, exactly as a real
        worker computes it; (samples, their summed loss)."""
        model = self.model  # in train mode; evaluate() restores it; grads are None
        total, loss_sum = 0, 0.0
        for _ in range(self.spec.worker.push_every):
            inputs, targets = next(w.batches)
            n = int(targets.shape[0])
            loss = w.loss_fn(model(inputs), targets)
            (loss * n).backward()
            total += n
            loss_sum += float(loss.detach()) * n
        for p in self.params.values():
            if p.grad is not None:
                p.grad.div_(total)
        return total, loss_sum

    def _compute(self, w: _VWorker) -> None:
        """What the worker pushes, from the weights it read: a gradient, or with local
        SGD the pseudo-gradient ``pulled - local`` after H inner steps."""
        if w.inner is not None:
            self._local_round(w, w.inner)
            return
        total, loss_sum = self._gradient(w)
        grads = {}
        for name, p in self.params.items():
            grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
        self.model.zero_grad(set_to_none=True)  # the tensors now belong to this step's push
        w.grads = self._compressed(w, self.plan.split_tensors(grads))
        w.loss = loss_sum / total
        w.num_samples = total

    def _compressed(self, w: _VWorker, grads: dict[int, dict[str, torch.Tensor]]
                    ) -> dict[int, dict[str, torch.Tensor]]:
        """Each shard's share as its push carries it: encoded by the worker's encoder
        and decoded as the shard's wire decodes it (paramserver/wire/compressed.py)."""
        if w.encoder is None:
            w.shard_bytes = {k: self._nbytes(k) for k in range(len(self.cores))}
            w.push_bytes = sum(w.shard_bytes.values())
            return grads
        out, w.shard_bytes = {}, {}
        for shard, tensors in grads.items():
            sent = w.encoder.encode(tensors)
            w.shard_bytes[shard] = sum(t.numel() * t.element_size() for t in sent.values())
            out[shard] = expand(sent, self.cores[shard].specs)
        w.push_bytes = sum(w.shard_bytes.values())
        return out

    def _local_round(self, w: _VWorker, inner: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            anchor = {n: p.detach().clone() for n, p in self.params.items()}
        total, loss_sum = 0, 0.0
        for _ in range(w.sync_every):
            n, summed = self._gradient(w)
            inner.step()
            self.model.zero_grad(set_to_none=True)
            total, loss_sum = total + n, loss_sum + summed
        with torch.no_grad():
            pseudo = {n: anchor[n] - p for n, p in self.params.items()}
        w.grads = self._compressed(w, self.plan.split_tensors(pseudo))
        w.loss = loss_sum / total
        w.num_samples = total

    def _eval(self, w: _VWorker) -> dict[str, float]:
        metrics = evaluate(self.task, self.model)
        if metrics:
            w.events.write(ev.Eval(worker=w.rank, clock=w.clock, versions=list(w.read_versions),
                                   figures=metrics))
        return metrics

    def _push(self, w: _VWorker) -> None:
        w.push_started = self.now
        w.push_id += 1
        w.outcomes = {}
        for k in range(len(self.cores)):
            self._send(w, k, True, w.shard_bytes.get(k, 0), self._push_arrives, w, k)

    def _push_arrives(self, w: _VWorker, shard: int) -> None:
        if self.timing is None or not self.timing.service:
            self._decide(w, shard)
            return
        # one push at a time per shard: it waits for the ones before it
        self._busy[shard] = max(self.now, self._busy[shard]) + self.timing.service
        self._at(self._busy[shard] - self.now, self._decide, w, shard)

    def _decide(self, w: _VWorker, shard: int) -> None:
        core = self.cores[shard]
        read_version = w.read_versions[shard]
        try:
            out = core.push(w.rank, w.push_id, w.clock, read_version, w.num_samples,
                            w.grads[shard], self.now)
        except ProtocolError as exc:  # a real worker stops on this error reply too
            raise SimulationError(
                f"shard {shard} refused worker {w.rank}'s push at clock {w.clock}, virtual "
                f"time {self.now:.3f}s: {exc}"
            ) from exc
        assert out is not None  # a whole push always has its outcome
        grad, self._grad[shard] = self._grad[shard], None
        if grad is not None and grad.worker != w.rank:
            grad = None
        if not out.duplicate:
            self.server_events[shard].write(ev.Push(shard=shard, worker=w.rank, clock=w.clock,
                                                    read_version=read_version, version=out.version,
                                                    staleness=out.staleness, accepted=out.accepted,
                                                    weight=out.weight, reason=out.reason,
                                                    num_samples=w.num_samples, loss=w.loss,
                                                    grad_norm=grad.norm if grad else None,
                                                    cosine=grad.cosine if grad else None))
        self._send(w, shard, False, 0, self._push_reply, w, shard, out)
        self._answer(shard)

    def _push_reply(self, w: _VWorker, shard: int, outcome: PushOutcome) -> None:
        w.outcomes[shard] = outcome
        if len(w.outcomes) < len(self.cores):
            return
        outcomes = [w.outcomes[k] for k in range(len(self.cores))]
        accepted = all(o.accepted for o in outcomes)
        w.clock += 1
        w.pushes += 1
        w.accepted += accepted
        w.rejected += not accepted
        w.losses.append(w.loss)
        w.events.write(ev.Step(
            worker=w.rank, clock=w.clock, read_versions=list(w.read_versions),
            staleness=max(o.staleness for o in outcomes), accepted=accepted,
            reasons=sorted({o.reason for o in outcomes if not o.accepted}),
            weight=min(o.weight for o in outcomes), loss=w.loss, num_samples=w.num_samples,
            compute_s=w.compute_s, sleep_s=w.sleep_s, pull_s=w.pull_s,
            push_s=self.now - w.push_started, wait_s=w.wait_s,
            bytes=w.push_bytes + sum(w.pull_bytes.values()),
            push_bytes=w.push_bytes, pull_bytes=sum(w.pull_bytes.values()),
            local_steps=w.sync_every if w.inner is not None else ev.UNSET))
        w.grads = {}
        self._steps_done += 1
        self._last_loss[w.rank] = w.loss
        if self._on_progress is not None and self._steps_done % self.sim.progress_every == 0:
            self._on_progress(self._progress())
        if w.clock >= w.steps:
            w.final = True
        self._start_pull(w)

    def _finish_worker(self, w: _VWorker) -> None:
        """After the final pull: say BYE and write the result (the evaluator's once every
        worker is done, with the final weights' figures: :meth:`_finish`)."""
        for k in range(len(self.cores)):
            self._send(w, k, True, 0, self._bye_arrives, w, k)
        self._end = max(self._end, self.now)
        if w.rank == self.spec.worker.evaluator:
            self._evaluator = w
            return
        self._write_result(w, None)

    def _write_result(self, w: _VWorker, figures: dict[str, float] | None) -> None:
        w.result = result = WorkerResult(
            worker=w.rank, steps=w.pushes, clock=w.clock, pushes=w.pushes,
            accepted=w.accepted, rejected=w.rejected,
            final_train_loss=sum(w.losses[-10:]) / max(1, len(w.losses[-10:])),
            seconds=self.now - w.started, train_seconds=self.now - w.started,
            budget_seconds=self.spec.worker.budget_seconds, budget_spent=w.budget_spent,
            wait_seconds=w.waited, final_versions=tuple(w.read_versions),
            eval=figures)
        data = result.to_json()
        w.events.write(result.to_event())
        if self.out is not None:
            write_json(self.out / "results" / f"worker{w.rank}.json", data)

    def _bye_arrives(self, w: _VWorker, shard: int) -> None:
        self.cores[shard].leave(w.rank, self.now)
        self.server_events[shard].write(ev.WorkerBye(shard=shard, worker=w.rank,
                                                     clock=self.cores[shard].workers[w.rank].clock))
        self._answer(shard)

    def _progress(self) -> Progress:
        # gradients computed, as the launcher counts them: a push holds sync_every
        steps = {w.rank: w.pushes * w.sync_every for w in self.workers}
        applied = sum(sum(s.applied for s in core.workers.values()) for core in self.cores[:1])
        return Progress(steps, sum(w.steps * w.sync_every for w in self.workers),
                        dict(self._last_loss),
                        applied, self.now)

    # ------------------------------------------------------------------ the end

    def _server_stats(self) -> list[JSONObject]:
        stats = []
        for k, core in enumerate(self.cores):
            stats.append({
                "shard": k, "num_shards": len(self.cores), "address": SIM_ADDRESS.format(k),
                "uptime": self.now, "counters": {}, **core.stats().to_dict(),
            })
        return stats

    def _finish(self, wall_seconds: float) -> ClusterResult:
        for k, core in enumerate(self.cores):
            self.server_events[k].write(ev.ServerStop(shard=k, version=core.version))
        final: dict[str, float] = {}
        merged: dict[str, torch.Tensor] = {}
        for core in self.cores:
            merged.update({key: p.detach() for key, p in core.params.items()})
        self.plan.assemble_into(self.params, merged)
        if self.spec.evaluate:
            final = evaluate(self.task, self.model)
        if self._evaluator is not None:  # its figures are the final weights', as final()'s
            w = self._evaluator
            if final:
                w.events.write(ev.Eval(worker=w.rank, clock=w.clock,
                                       versions=list(w.read_versions), figures=final, final=True))
            self._write_result(w, final or None)
        stats = self._server_stats()
        result = ClusterResult(
            spec=self.spec.to_dict(),
            addresses=tuple(SIM_ADDRESS.format(k) for k in range(len(self.cores))),
            seconds=self._end,
            eval=final,  # every worker is done here: of the final weights
            eval_of=FINAL_WEIGHTS if final else None,
            workers=tuple(w.result for w in self.workers if w.result is not None),
            servers=tuple(stats),
            updates_applied=tuple(shard_figures(s)[0] for s in stats),
            pushes_applied_shard0=shard_figures(stats[0])[1],
            sim=SimSummary(**dataclasses.asdict(self.sim), wall_seconds=wall_seconds,
                           steps=self._steps_done),
        )
        if self.out is not None:
            from safetensors.torch import save_file

            state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
            save_file(state, str(self.out / "final_model.safetensors"))
            write_json(self.out / "result.json", result.to_json())
        log.info("simulated %d steps of %d workers: %.2fs virtual in %.2fs", self._steps_done,
                 len(self.workers), self.now, wall_seconds)
        return result


def run_simulation(spec: ClusterSpec, out_dir: str | Path | None = None,
                   sim: SimSpec | None = None,
                   on_progress: Callable[[Progress], None] | None = None,
                   timing: Timing | None = None) -> ClusterResult:
    """Run ``spec`` in virtual time; like
    :func:`~paramserver.workers.launch.cluster.run_cluster`, it returns the result and,
    given ``out_dir``, writes the same run directory (``seconds`` and every ``t`` are
    virtual)."""
    if out_dir is not None:
        out = Path(out_dir)
        for sub in ("events", "results", "configs"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        write_json(out / "configs" / "simulation.json",
                    {"spec": spec.to_dict(), "sim": dataclasses.asdict(sim or SimSpec())})
    return Simulator(spec, sim, out_dir, timing).run(on_progress)
