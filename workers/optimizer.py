"""DistributedOptimizer: train from your own loop against the parameter servers.

A ``torch.optim.Optimizer`` whose ``step()`` pushes each parameter's ``.grad`` to
the shards and pulls the new weights into the parameters in place. The
optimizer itself (SGD, Adam, ...) runs on the servers; the staleness machinery
(sync rounds, the SSP gate, policies) is theirs too. Everything a training
script does around an optimizer keeps working: ``zero_grad``,
``clip_grad_norm_`` before ``step()``, ``GradScaler.step(opt)`` (an inf/NaN step
is skipped by the scaler, so nothing is pushed), checkpointing code that
calls ``state_dict()``::

    model = Net()
    opt = paramserver.DistributedOptimizer(        # servers, rank from the environment
        model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    # or, started by hand: config=paramserver.ClientConfig(servers=[...], rank=0)
    for inputs, targets in loader:
        opt.zero_grad()
        loss_fn(model(inputs), targets).backward()
        opt.step(num_samples=len(targets))
    opt.close()

Without a ``config`` (a :class:`ClientConfig`), the client is configured from the
environment that ``paramserver launch -- COMMAND`` (or ``paramserver run``) sets:
``PARAMSERVER_SERVERS`` (addresses, comma-separated, in shard order; with
``--replicas`` a shard's replicas joined by ``|``, which the optimizer follows
through a failover), ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, and the launcher's
worker options (timeouts, wire options, this rank's straggler
scenario) from the file ``PARAMSERVER_WORKER_OPTIONS`` names. ``opt.log(loss=...,
eval_loss=..., eval_accuracy=...)`` records what the script measures in the
worker's event log, where result.json and the experiment report read it.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from paramserver.core import features
from paramserver.errors import ConfigError
from paramserver.observe import records as ev
from paramserver.observe.events import EventLog, write_json
from paramserver.observe.figures import FigureGate
from paramserver.util import faults, lifeline
from paramserver.wire.curve import CurveKeys
from paramserver.workers.client import PART_BYTES, PSClient, PullResult, PushResult, PushStream
from paramserver.workers.clientconfig import ClientConfig
from paramserver.workers.config import OPTIONS_ENV, LaunchOptions
from paramserver.workers.embedding import (
    SparseClient,
    refuse_sparse_grads,
    sparse_grad_refusal,
    sparse_modules,
)
from paramserver.workers.finish import FINAL_TIMEOUT, finish
from paramserver.workers.localsgd import LocalSteps
from paramserver.workers.overlap import BucketHooks
from paramserver.workers.scriptenv import (
    DistributedSampler,
    make_plan,
    read_plan,
    servers_from_env,
)
from paramserver.workers.stragglers import Straggler
from paramserver.workers.workerresult import PushCounts, WorkerResult
from paramserver.workers.wrapped import Wrapped

__all__ = ["OPTIONS_ENV", "ClientConfig", "DistributedOptimizer", "DistributedSampler",
           "LaunchOptions", "PushCounts", "StepOutcome", "WorkerResult", "read_plan",
           "servers_from_env"]

log = logging.getLogger(__name__)

_Init = TypeVar("_Init", bound=Callable[..., None])


def _refuse_moved_keywords(init: _Init) -> _Init:
    """A keyword the optimizer took before its configuration became one value
    (``servers=``, ``timeout=``, ...) refused in one line naming what to give instead."""
    fields = {f.name for f in dataclasses.fields(ClientConfig)}

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        if "drop_rate" in kwargs:
            raise TypeError(f"DistributedOptimizer() got drop_rate: losing messages on "
                            f"purpose is a test fault, {faults.DROP_RATE}=P in the "
                            f"environment (paramserver/util/faults.py)")
        moved = [k for k in kwargs if k in fields]
        if moved:
            given = ", ".join(f"{k}=..." for k in moved)
            raise TypeError(f"DistributedOptimizer() got {', '.join(moved)}: give "
                            f"config=ClientConfig({given}), or under paramserver launch "
                            f"config=ClientConfig.from_env({given})")
        init(self, *args, **kwargs)

    return cast(_Init, checked)


def _metric(name: str, value: object) -> float:
    """A logged figure as a float (a 0-d tensor included)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"log({name}=...) must be a number, got {value!r}") from None


@dataclass(frozen=True)
class StepOutcome:
    """What the shards did with one ``step()``'s push (over all shards)."""

    accepted: bool  # every shard applied it (possibly down-weighted)
    reasons: tuple[str, ...]  # why shards refused it (empty when accepted)
    weight: float  # the smallest weight a shard gave it (1.0: full)
    staleness: int  # the largest staleness a shard measured
    versions: tuple[int, ...]  # per shard, the version of the weights now in the model
    clock: int  # this worker's clock after the step (pushes so far)
    push_seconds: float
    pull_seconds: float
    waited: float  # longest time a shard held the pull (sync barrier or SSP gate)
    nbytes: int  # bytes sent and received
    push_nbytes: int = 0  # of them, those pushed (as they went: compressed, compressed)
    pull_nbytes: int = 0

    @classmethod
    def of(cls, pushed: PushResult, pulled: PullResult, clock: int) -> StepOutcome:
        return cls(
            accepted=pushed.accepted, reasons=tuple(pushed.reasons),
            weight=min((o.weight for o in pushed.outcomes), default=1.0),
            staleness=pushed.staleness, versions=pulled.versions, clock=clock,
            push_seconds=pushed.seconds, pull_seconds=pulled.seconds, waited=pulled.waited,
            nbytes=pushed.nbytes + pulled.nbytes, push_nbytes=pushed.nbytes,
            pull_nbytes=pulled.nbytes)


class DistributedOptimizer(torch.optim.Optimizer):
    """Push gradients to the parameter servers and pull their weights, from your loop.

    ``model_or_named_parameters`` is an ``nn.Module`` or ``named_parameters()``;
    names must be the same on every rank (they key the servers' plan).

    ``optimizer``: the script's own, over the model's parameters (``torch.optim.SGD``,
    ``Adam``, ``AdamW``, ...: paramserver/workers/wrapped.py). The servers run its class
    and hyper-parameters when the launch named no optimizer (a launch that named
    another refuses this worker in one line); the two share ``param_groups``, and an lr
    the evaluating rank sets there reaches the servers with its next step.

    * ``config``: a :class:`~paramserver.workers.clientconfig.ClientConfig`, everything
      else: the servers, this worker's ``rank`` among ``world_size``, the ``evaluator``
      rank (:attr:`evaluates`), the ``run_id`` (a shard of another run refuses this
      worker, ``wrong_run``), the client's options as for ``paramserver worker``
      (``timeout``, ``request_timeout``, ``barrier_timeout``, ``heartbeat_interval``,
      ``chunk_bytes``, ``part_bytes``, ``early_parts``, ``bucket_bytes``,
      ``wire_dtype``, the CURVE key files), this rank's ``straggler`` scenario
      (``step()`` sleeps what it injects on top of the compute time since
      ``zero_grad()`` and logs it apart, ``sleep_s`` beside ``compute_s``), whether it
      offers its weights (``offer_weights``; by default rank 0 offers and the others
      wait) and its event log (``events``, ``event_log``). Left out: what the launcher
      set, :meth:`ClientConfig.from_env() <ClientConfig.from_env>`. Started by a
      launcher, the process also ends when the launcher does (by any signal):
      paramserver/util/lifeline.py.
    * ``overlap``: push gradients in buckets of about ``config.bucket_bytes`` from
      inside backward (post-accumulate hooks), so ``step()`` only waits. The
      push's sample count is then the one given to :meth:`set_num_samples`
      before backward (each worker counts equally by default).
    * ``backward_passes_per_step``: backward passes accumulated into ``.grad``
      per ``step()`` (only used with ``overlap``, to know which backward is the
      step's last); scale the loss yourself if you want their mean.
    * ``local``, ``sync_every``: local SGD / DiLoCo. ``step()`` steps ``local`` (an
      optimizer over the model's parameters, e.g. AdamW) and only every
      ``sync_every``-th step pushes the pseudo-gradient (the weights last pulled minus
      the local ones; samples summed over the round), then pulls. The servers'
      optimizer is the outer one; :attr:`clock` counts pushes (outer steps).

    Construction registers with every shard and agrees on the plan. Shards without
    weights are seeded by the offering rank at its first ``step()`` (:meth:`seed`), from
    its weights as they are then, so a snapshot loaded after construction is what
    training resumes from; the other ranks wait for those weights at construction.
    Shards that hold weights already (a rejoining worker, a resumed run) keep them, and
    every rank pulls them at construction. So all ranks start from the same weights
    whatever their local initialization.

    :meth:`final` ends this worker's training and waits for every other worker: the
    evaluating rank calls it before its last evaluation, which is then of the final weights.
    """

    #: :meth:`final` was called: this worker said BYE and reads on as an observer
    finished = False

    @_refuse_moved_keywords
    def __init__(
        self,
        model_or_named_parameters: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        overlap: bool = False,
        backward_passes_per_step: int = 1,
        local: torch.optim.Optimizer | None = None,
        sync_every: int = 1,
        config: ClientConfig | None = None,
    ) -> None:
        # started by a launcher: this process ends when it does, however it ends
        lifeline.watch()
        named: list[tuple[str, torch.Tensor]]
        # ShardedEmbedding tables: on the shards by row, pushed by step() beside the dense
        tables = []
        if isinstance(model_or_named_parameters, torch.nn.Module):
            refuse_sparse_grads(model_or_named_parameters)
            named = list(model_or_named_parameters.named_parameters())
            tables = sparse_modules(model_or_named_parameters)
        else:
            named = list(model_or_named_parameters)
        if not named or not all(isinstance(n, str) and isinstance(p, torch.Tensor)
                                for n, p in named):
            raise ConfigError("DistributedOptimizer needs a model or its named_parameters(): "
                              "(name, tensor) pairs, at least one")
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, "
                              f"got {backward_passes_per_step}")
        super().__init__([p for _, p in named], {})
        # nothing given: what the launcher set (launch -- COMMAND), else the defaults
        if config is None:
            config = ClientConfig.from_env()
        elif not isinstance(config, ClientConfig):
            raise ConfigError(f"config must be a paramserver.ClientConfig, got "
                              f"{type(config).__name__}")
        if not config.servers:
            raise ConfigError("no servers: give ClientConfig(servers=[...]), or leave config "
                              "out under paramserver launch -- COMMAND (or use "
                              "ClientConfig.from_env(...))")
        #: what this optimizer was configured with
        self.config = config
        self.servers = list(config.servers)
        self.rank = config.rank
        self.world_size = config.world_size
        #: the rank that evaluates held-out data (:attr:`evaluates`)
        self.evaluator = config.evaluator
        self.backward_passes_per_step = backward_passes_per_step
        self.params: dict[str, torch.Tensor] = dict(named)
        if local is None and sync_every != 1:
            raise ConfigError("sync_every needs a local optimizer (local=...)")
        # the feature pairs a script turns on here are refused as the launcher refuses
        # them (one table: paramserver/core/features.py); with --replicas the launcher
        # gives a shard's replicas joined by "|"
        features.check(features.active(
            local_sgd=local is not None, overlap=overlap, sparse=bool(tables),
            compression=config.compression, wire_dtype=config.wire_dtype,
            replicas=any("|" in s for s in self.servers), script_optimizer=optimizer is not None))
        self.local = None if local is None else LocalSteps(local, sync_every, self.params)
        self.wrapped = None if optimizer is None else Wrapped(optimizer, self.params)
        self.plan = make_plan(named, len(self.servers), config.chunk_bytes,
                              [m.table_spec(name) for name, m in tables])
        curve = (CurveKeys.load(config.curve_key, config.curve_server_key)
                 if config.curve_key else None)
        self.client = PSClient(
            self.servers, self.plan, self.rank, timeout=config.timeout,
            request_timeout=config.request_timeout,
            heartbeat_interval=config.heartbeat_interval, curve=curve,
            wire_dtype=config.wire_dtype, compression=config.compression,
            part_bytes=config.part_bytes,
            early_parts=config.early_parts, barrier_timeout=config.barrier_timeout,
            optimizer=None if self.wrapped is None else self.wrapped.spec.to_wire(),
            run_id=config.run_id)
        # this rank's straggler scenario: step() sleeps the injected delay, logged apart
        self.straggler = (Straggler(config.straggler, seed=(config.seed, self.rank))
                          if config.straggler.active else None)
        self._t_compute = time.perf_counter()  # since zero_grad() or the last step()
        self._pending: tuple[float, ev.Step] | None = None  # the latest step's, unwritten
        # what the script logs: finite numbers, under a bounded set of names
        self._figures = FigureGate(f"worker {self.rank}")
        self.last_eval: dict[str, float] | None = None  # the latest figures log() got
        self._closed = False
        self._t0 = time.time()
        self._counts = PushCounts()
        self._waited = 0.0
        # the records of this worker's start and end are ours only in our own log
        events = config.events
        self._own_events = events is None
        self._events = events if events is not None else EventLog(config.event_log)
        self.clock = self.client.connect()
        if self.wrapped is not None:  # its param_groups are ours, at the shards' lr
            self.wrapped.share(self, self.client.server_lr)
        # by default rank 0 seeds the weights and the others wait for them, so every
        # rank starts from rank 0's initialization (or the servers' resumed weights)
        offer = self.rank == 0 if config.offer_weights is None else config.offer_weights
        self.tables = tables
        self.sparse = SparseClient(self.client) if tables else None
        for name, module in tables:
            assert self.sparse is not None
            module.attach(name, self.sparse)
        pretrained = {name: m.pretrained for name, m in tables if m.pretrained is not None}
        if offer and pretrained and self.sparse is not None:
            # before the dense INIT: ranks that wait for the weights then find the rows in
            self.sparse.seed(pretrained, config.part_bytes or PART_BYTES)
        self.seeded = False
        self.versions: tuple[int, ...] = tuple(0 for _ in self.servers)
        # servers without weights are seeded from this rank's weights as they are at its
        # first step (or seed(), pull(), close()), not as they are now: a script that
        # loads a snapshot into the model after building its optimizer (the PyTorch DDP
        # tutorial's order) resumes from the snapshot. Servers that hold weights already
        # (a rejoin, a resumed run) are never seeded over: every rank pulls theirs now.
        self._seed_pending = offer and not self.client.initialized
        if not self._seed_pending:
            self._pull_start(wait_init=not offer)
        self.last: StepOutcome | None = None  # the outcome of the latest step()
        if self._own_events:
            self._events.write(ev.WorkerStart(worker=self.rank, clock=self.clock,
                                              seeded=self.seeded, steps=None,
                                              plan_hash=self.plan.hash))
        if config.plan_file and self.rank == 0:  # the launcher saves the final model by it
            write_json(config.plan_file, self.plan.describe())
        self._num_samples = 1
        self._loss: float | None = None
        self._buckets: BucketHooks | None = None
        if overlap:
            self._buckets = BucketHooks(named, config.bucket_bytes, self._open_stream,
                                        backward_passes_per_step)
        # a script that ends without close() is done, not dead: say BYE at exit
        atexit.register(self._at_exit)
        log.info("worker %d/%d: %d parameters on %d shards, from clock %d", self.rank,
                 self.world_size, len(self.params), len(self.servers), self.clock)

    # ------------------------------------------------------------------ training

    def set_num_samples(self, num_samples: int, loss: float | None = None) -> None:
        """The sample count (and training loss, for the servers' watchdog) of the next
        push; with ``overlap``, call it before the step's last backward."""
        if num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {num_samples}")
        self._num_samples = int(num_samples)
        self._loss = None if loss is None else float(loss)

    def seed(self) -> bool:
        """Offer this rank's weights, as they are now, to the shards that have none (the
        first offer wins), then pull what the shards hold; True if this rank seeded one.
        Runs at the first :meth:`step` by itself; call it to seed earlier. Without a
        pending seed (the shards had weights, or this rank waits for them) it does
        nothing."""
        return self._seed(pull=True)

    def _seed(self, pull: bool) -> bool:
        if self._seed_pending:
            self._check_open()
            self._seed_pending = False
            self.seeded = self.client.initialize(self.params)
            # the winning offer's weights, should another rank's have won (the shards
            # also note what this worker read); `into` a copy where they must not change
            self._pull_start(wait_init=False, into=None if pull else {
                n: p.detach().clone() for n, p in self.params.items()})
        return self.seeded

    def _pull_start(self, wait_init: bool,
                    into: Mapping[str, torch.Tensor] | None = None) -> None:
        with torch.no_grad():
            pulled = self.client.pull(self.params if into is None else into, self.clock,
                                      wait_init=wait_init)
        self.versions = pulled.versions
        self.clock = max(self.clock, pulled.clock)

    def _open_stream(self) -> PushStream:
        assert self._buckets is not None
        # before the first bucket leaves; inside backward the parameters must not change
        # (autograd may still need them): the step's own pull brings the weights
        self._seed(pull=False)
        self._lr_change()
        stream = self.client.push_stream(self._buckets.buckets, self.versions,
                                         self._num_samples, self.clock, prefetch=True)
        stream.loss = self._loss  # every part carries it
        return stream

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             num_samples: int | None = None, *, loss: float | None = None,
             log: Mapping[str, Any] | None = None) -> Any:
        """Push every parameter's ``.grad`` (``None``: a zero gradient), then pull the
        servers' weights into the parameters, honouring the mode (the sync barrier,
        the SSP gate, or none). ``num_samples`` weighs this push in a sync round's
        mean (omitted: every worker counts equally). ``loss`` (or the closure's)
        travels with the push for the servers' watchdog; ``log`` adds fields to the
        step's event record (as :meth:`log` does: the optimizer's own names are dropped).
        Returns the closure's loss; the outcome is :attr:`last`."""
        self._check_open()
        log = self._figures.unreserved(log or {}, held_out=False)
        if self.finished:
            raise ConfigError("step() after final(): this worker's training is over")
        compute = time.perf_counter() - self._t_compute  # not the seeding below
        self._flush()  # the previous step's record, before this one may wait at a barrier
        self.seed()  # before this step's gradients go: from the weights they were taken at
        result = None
        if closure is not None:
            t_closure = time.perf_counter()
            with torch.enable_grad():
                result = closure()
            loss = float(result)  # a tensor, as torch's closures return
            compute += time.perf_counter() - t_closure
        # the scenario's slowness stands for compute on slower hardware: before the push
        injected = self.straggler.inject(compute) if self.straggler is not None else 0.0
        if num_samples is not None:
            self.set_num_samples(num_samples, self._loss if loss is None else loss)
        loss = self._loss if loss is None else float(loss)
        self._lr_change()  # (before the sparse rows: they step at the new lr too)
        if self.sparse is not None:
            self._push_sparse()
        num = self._num_samples
        if self.local is not None:
            if not self.local.step(num, compute, injected):  # a local step: no push yet
                self._num_samples, self._loss = 1, None
                self._t_compute = time.perf_counter()
                return result
            grads, num = self.local.pseudo_gradient(), self.local.samples
            compute, injected = self.local.compute, self.local.slept
            log = {**(log or {}), "local_steps": self.local.taken}  # gradients this push holds
            pushed, pulled = self.client.push_pull(grads, self.versions, num, self.clock,
                                                   self.params, loss=loss)
            self.local.mark()  # the pulled weights start the next round
        elif self._buckets is not None:
            stream = self._buckets.flush()
            if loss is not None and stream.loss is None:
                stream.loss = loss
            pushed, pulled_or_none = stream.finish(self.params)
            assert pulled_or_none is not None
            pulled = pulled_or_none
        else:
            grads = {}
            for name, p in self.params.items():
                if p.grad is not None and p.grad.is_sparse:  # (named_parameters given)
                    raise ConfigError(sparse_grad_refusal(name))
                grads[name] = p.grad if p.grad is not None else torch.zeros_like(p)
            pushed, pulled = self.client.push_pull(grads, self.versions, self._num_samples,
                                                   self.clock, self.params, loss=loss)
        if self.wrapped is not None and self.client.lr is not None:  # the shards have it
            self.wrapped.sent, self.client.lr = self.client.lr, None
        read = self.versions
        self.clock = max(self.clock + 1, pulled.clock)
        self.versions = pulled.versions
        self.last = out = StepOutcome.of(pushed, pulled, self.clock)
        self._counts = self._counts.add(out.accepted)
        self._waited += out.waited
        # written at the next step(), log() or close(), so log(loss=...) after this
        # step lands in its record; `t` is now, when the step ended
        local_steps = log.pop("local_steps", ev.UNSET)  # (int: the optimizer's own)
        self._pending = (time.time(), ev.Step(
            worker=self.rank, clock=self.clock, read_versions=list(read),
            staleness=out.staleness, accepted=out.accepted, reasons=list(out.reasons),
            weight=out.weight, loss=loss, num_samples=num,
            compute_s=compute, sleep_s=injected, pull_s=out.pull_seconds,
            push_s=out.push_seconds, wait_s=out.waited, bytes=out.nbytes,
            push_bytes=out.push_nbytes, pull_bytes=out.pull_nbytes,
            local_steps=local_steps, figures=log))  # figures: not the optimizer's names
        if self._buckets is None:
            self._num_samples = 1
        self._loss = None
        self._t_compute = time.perf_counter()
        return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every gradient the next ``step()``
        pushes: the parameters' and the ShardedEmbedding tables' rows (which are no
        parameters of the model, so torch's, given ``model.parameters()``, leaves them
        out). A row read by several forwards counts once, with its summed gradient, as
        it is pushed. Returns the total norm, before clipping."""
        dense = [p for p in self.params.values() if p.grad is not None]
        grads = [g for g in (p.grad for p in dense) if g is not None]
        rows = [m.grad_rows()[1] for _, m in self.tables]
        total = torch.nn.utils.get_total_norm([*grads, *rows], norm_type, error_if_nonfinite)
        torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
        factor = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # (torch's rule)
        for _, m in self.tables:
            m.scale_grads_(factor)
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, and the start of the next step's compute time (for the straggler
        scenario and the step's ``compute_s``)."""
        self._t_compute = time.perf_counter()
        super().zero_grad(set_to_none)

    def log(self, loss: float | None = None, eval_loss: float | None = None,
            eval_accuracy: float | None = None, **metrics: float) -> None:
        """Record what the script measured in this worker's event log, from which
        result.json's ``eval``, the experiment report's curves and time-to-target,
        TensorBoard and Prometheus are built.

        ``loss`` and the other training figures describe the latest :meth:`step`
        (they join its ``step`` record); ``eval_loss``, ``eval_accuracy`` and any
        ``eval_NAME`` are held-out figures of the weights now in the model: an
        ``eval`` record (``loss``, ``accuracy``, ``NAME``) at this worker's clock.
        Figures are numbers (a 0-d tensor is fine). The names the optimizer writes in
        those records itself (``worker``, ``clock``, ``staleness``, ...: docs/events.md)
        are never overwritten: such a figure is dropped, as is one that is NaN or Inf,
        and new names past ``MAX_FIGURES`` (64) per worker, each kind with one warning
        (observe/figures.py)."""
        self._check_open()
        train = self._figures.unreserved(
            {k: _metric(k, v) for k, v in metrics.items() if not k.startswith("eval_")},
            held_out=False)
        held_out = self._figures.unreserved(
            {k[len("eval_"):]: _metric(k, v) for k, v in metrics.items()
             if k.startswith("eval_")}, held_out=True)
        if loss is not None:
            train["loss"] = _metric("loss", loss)
        if eval_accuracy is not None:
            held_out = {"accuracy": _metric("eval_accuracy", eval_accuracy), **held_out}
        if eval_loss is not None:
            held_out = {"loss": _metric("eval_loss", eval_loss), **held_out}
        if train:
            if self._pending is None:
                raise ConfigError(f"log({', '.join(train)}=...) describes the latest step(): "
                                  "call it after step() (held-out figures: eval_NAME=...)")
            step = self._pending[1]
            step.loss = train.pop("loss", step.loss)
            step.figures.update(train)
        self._flush()
        kept = self._figures.admit({f"eval_{k}": v for k, v in held_out.items()})
        held_out = {k[len("eval_"):]: v for k, v in kept.items()}
        if held_out:  # after final(): the final weights' figures, marked so
            self._events.write(ev.Eval(worker=self.rank, clock=self.clock,
                                       versions=list(self.versions), figures=held_out,
                                       final=True if self.finished else ev.UNSET))
            self.last_eval = held_out

    def _flush(self) -> None:
        """Write the latest step's record, if not written yet."""
        if self._pending is not None:
            (t, step), self._pending = self._pending, None
            figures = {k: v for k, v in step.figures.items() if v is not None}
            kept = self._figures.admit(figures)
            step.figures = {k: v for k, v in step.figures.items()
                            if k not in figures or k in kept}
            self._events.write(step, t=t)

    def _lr_change(self) -> None:
        """The evaluating rank's change to ``param_groups`` lr goes with the next push."""
        if self.wrapped is not None:
            self.client.lr = self.wrapped.change(self.evaluates, self.rank)

    def _push_sparse(self) -> None:
        """Every ShardedEmbedding's row gradients, summed per id, to their shards (in
        sync mode this returns once the shards' sparse rounds have closed)."""
        assert self.sparse is not None
        grads, versions = {}, list(self.sparse.versions)
        for name, module in self.tables:
            ids, values, read = module.take_grads()
            grads[name] = (ids, values)
            if read is not None:
                versions = [min(a, b) for a, b in zip(versions, read, strict=True)]
        self.sparse.push(grads, versions, self._num_samples, self.clock)

    @property
    def evaluates(self) -> bool:
        """Whether this rank is the one that evaluates held-out data (``opt.log(eval_...)``):
        the run's curves, time to target and result.json's ``eval`` come from it."""
        return self.rank == self.evaluator

    @property
    def counts(self) -> PushCounts:
        """Pushes so far, and how many every shard accepted or some shard rejected."""
        return self._counts

    @property
    def waited(self) -> float:
        """Seconds shards held this worker's pulls (sync barrier, SSP gate), in all."""
        return self._waited

    def final(self, timeout: float = FINAL_TIMEOUT) -> tuple[int, ...]:
        """End this worker's training and wait until every worker is done (said BYE, or
        was judged gone by the shards' liveness rules), then load the final weights into
        the parameters; returns their versions per shard. The evaluating rank calls it
        before its last evaluation: what :meth:`log` records after it is marked as the
        final weights' figures, the run's final figures (result.json, the experiment
        report). Other ranks need not call it (:meth:`close` says BYE). After it,
        ``step()`` is refused and reads (``pull()``, a ShardedEmbedding's rows) are an
        observer's. Waits at most ``timeout`` seconds (0: no bound); past it a
        BarrierTimeoutError names the workers the shards still wait for."""
        self._check_open()
        return finish(self, timeout)

    def pull(self) -> tuple[int, ...]:
        """Fetch the servers' current weights into the parameters (e.g. to evaluate
        the latest model); returns the versions. Clocks do not move."""
        self._check_open()
        self.seed()
        with torch.no_grad():
            pulled = self.client.pull(self.params, self.clock)
        self.versions = pulled.versions
        if self.local is not None:  # the local steps since the last push are dropped
            self.local.mark()
        return pulled.versions

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This worker's place in training: its clock and the versions it read.

        The optimizer's own state (momentum, Adam moments, the learning-rate
        schedule) lives on the servers and is saved by their checkpoints
        (``--checkpoint-dir``), not here; a ``local`` optimizer's is here (``local``)."""
        state = {"clock": self.clock, "versions": list(self.versions), "rank": self.rank,
                 "server_side": True}
        if self.local is not None:  # the inner optimizer's state is the worker's own
            state["local"] = self.local.state_dict()
        if self.client.encoder is not None:  # what compressed pushes left out, to come
            state["compression"] = self.client.encoder.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Accepts what :meth:`state_dict` gave; the clock is where the shards say it is
        (a rejoining worker resumes at their clock), so nothing is restored locally."""
        if not state_dict.get("server_side"):
            raise ConfigError("not a DistributedOptimizer state_dict: this optimizer's state "
                              "lives on the servers (their checkpoints hold it)")
        if self.local is not None and state_dict.get("local") is not None:
            self.local.load_state_dict(state_dict["local"])
        if self.client.encoder is not None and state_dict.get("compression") is not None:
            self.client.encoder.load_state_dict(state_dict["compression"])

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Say goodbye to every shard (this worker is done) and close the sockets."""
        if self._closed:
            return
        self.seed()  # the ranks waiting for this one's weights must not wait forever
        self._closed = True
        atexit.unregister(self._at_exit)
        if self._buckets is not None:
            self._buckets.remove()
        self._flush()
        try:
            if not self.finished:  # final() said it
                self.client.bye()
        finally:
            self.client.close()
        if not self._own_events:
            return
        result = self.result(time.time() - self._t0)
        self._events.write(result.to_event())
        self._events.close()
        if self.config.result_file:
            write_json(self.config.result_file, result.to_json())

    def result(self, seconds: float) -> WorkerResult:
        """This worker's counts, clock and versions so far, after ``seconds``."""
        c = self._counts
        return WorkerResult(worker=self.rank, steps=c.pushes, clock=self.clock,
                            pushes=c.pushes, accepted=c.accepted, rejected=c.rejected,
                            seconds=seconds, wait_seconds=self._waited,
                            final_versions=tuple(self.versions), eval=self.last_eval)

    def _at_exit(self) -> None:
        # after an uncaught exception the worker failed: no BYE, so that its
        # supervisor's death report (or the heartbeat timeout) is what the shards see
        if getattr(sys, "last_value", None) is not None:
            self._abandon()
            return
        try:
            self.close()
        except Exception as exc:  # at exit the shards may be gone already
            log.warning("worker %d: goodbye at exit failed: %s", self.rank, exc)

    def _abandon(self) -> None:
        """The worker failed: close the sockets without saying goodbye."""
        self._closed = True
        atexit.unregister(self._at_exit)
        if self._buckets is not None:
            self._buckets.remove()
        self._flush()  # the steps it made stay on record
        if self._own_events:
            self._events.close()
        self.client.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this DistributedOptimizer is closed")

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # leaving on an exception: this worker failed, it is not done
            self._abandon()
