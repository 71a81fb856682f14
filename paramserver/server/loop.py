"""ShardServer: the socket loop around one :class:`~paramserver.core.shard.ShardCore`.

One process per shard, one ROUTER socket, one event loop. The server decodes
and validates messages, hands them to the pure core, sends replies (pull
replies possibly much later, when the core's gates open) and writes the JSONL
event log. It never lets one bad message stop it: every failure becomes an
ERROR reply with a code, and the core's state is untouched.

Its parts live beside it: peers.py (the HELLO, HEARTBEAT and BYE handlers),
ops.py (INIT, PULL, PUSH and the sparse ops), access.py (who may do what under
CURVE), parts.py (pushes sent in parts), outbox.py (replies, parked pulls and
the zero-copy sends of the weights), checkpointer.py (checkpoints and resuming),
stopping.py (what --on-divergence does), roles.py (who the shard is among its
replicas: the loop asks its role, never the replication) and shardstate.py (its
whole state when it moves).

A server is built without I/O; :meth:`ShardServer.start` opens what it serves
through, and entry.py's ``serve`` is the one place that builds and starts one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec
import torch
import zmq

from paramserver.core import features
from paramserver.core.probe import MeasureBudget
from paramserver.core.shard import ShardCore
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, ErrorCode, ProtocolError
from paramserver.observe import records as ev
from paramserver.observe.console import Console
from paramserver.observe.events import EventLog
from paramserver.observe.metrics import MetricsExporter, TensorBoardWriter
from paramserver.observe.recorder import ShardObserver
from paramserver.observe.watchdog import Alarm, Watchdog
from paramserver.persist.checkpoint import CheckpointError
from paramserver.policies.registry import create_policy
from paramserver.server import roles, shardstate
from paramserver.server.access import Access, open_socket
from paramserver.server.checkpointer import RESTORE_ERRORS, Capture, Checkpointer
from paramserver.server.config import ServerConfig
from paramserver.server.elastic import Elastic
from paramserver.server.ops import DataOps, Handler
from paramserver.server.outbox import Outbox
from paramserver.server.parts import JoinedParts, StreamedParts
from paramserver.server.peers import PeerInfo, Peers
from paramserver.server.process import READY_PREFIX, Ready
from paramserver.server.replication import REPLAYED
from paramserver.server.roles import Lone, Route, ShardRole
from paramserver.server.scriptopt import META_KEY, ScriptOptimizer
from paramserver.server.shardstate import ShardImage, ShardState
from paramserver.server.stopping import DIVERGED_EXIT_CODE, Divergence
from paramserver.server.tables import TableBuilder
from paramserver.server.tracer import ShardTracer
from paramserver.shm.link import ShmHub, asks_board, lends, sweep, take_shm
from paramserver.shm.link import enabled as shm_enabled
from paramserver.sparse.shard import SparseShard
from paramserver.wire import replication as wrepl
from paramserver.wire import stats as wstats
from paramserver.wire.messages import Checkpoint
from paramserver.wire.protocol import DEFAULT_LIMITS, Message, Op, error_reply, reply
from paramserver.wire.requests import decode_request
from paramserver.wire.transport import RouterSocket

if TYPE_CHECKING:
    from paramserver.server.replication import Replication

__all__ = ["DIVERGED_EXIT_CODE", "READY_PREFIX", "Ready", "ServerConfig", "ShardServer"]

log = logging.getLogger(__name__)


class ShardServer:
    """One shard's process: a ROUTER socket in front of a
    :class:`~paramserver.core.shard.ShardCore`.

    ``serve_forever()`` runs the event loop until SHUTDOWN, :meth:`stop` or the
    divergence watchdog; the core holds every consistency rule, this class the I/O.
    """

    #: bound by :meth:`start`: the ROUTER socket and the address it listens at
    socket: RouterSocket
    address: str

    def __init__(self, config: ServerConfig, console: Console | None = None) -> None:
        """Everything but I/O: no socket, no metrics port, no checkpoint read and no
        word to the replicas yet (:meth:`start` does those, in that order)."""
        self.config = config
        self.policy = create_policy(config.policy, config.policy_args)
        # CURVE: what each client key may do (None: any admitted key acts as a plain
        # worker) and which key registered each worker id (the grants are read by start)
        self.access = Access(None)
        # what the console says comes from the records of the event log
        self.events = EventLog(config.event_log, console=console, lazy=True)
        # the optimizer a worker script wraps: adopted, checked, its lr changes (scriptopt.py)
        self.script = ScriptOptimizer(config, self.events)
        self.plan: ShardPlan | None = None
        self.core: ShardCore | None = None
        self.sparse: SparseShard | None = None  # the plan's row-sparse tables, if any
        self.tables: TableBuilder | None = None  # builds them once a live worker uses them
        self._running = False
        self.started = False
        self.counters: Counter[str] = Counter()
        self.outbox = Outbox(self.counters)
        # same-host workers' tensors through shared memory (paramserver/shm/link.py);
        # with replicas too: the primary forwards what it read there as frames
        # (forwarded.as_tcp), and a backup that takes over has a hub of its own
        self.shm = ShmHub(config.shard, DEFAULT_LIMITS) if shm_enabled() else None
        self.outbox.shm = self.shm
        self.started_at = time.time()
        self.checkpoints = Checkpointer(
            config.shard, config.checkpoint_dir, self.events, keep=config.checkpoint_keep,
            every=config.checkpoint_every, seconds=config.checkpoint_seconds)
        self.watchdog = Watchdog(config.shard, config.watchdog_config(),
                                 bounded_lag=config.mode != "async")
        # how much of the pushes the probe measures, kept within a share of the time
        self.measure_budget = MeasureBudget(self.watchdog.config.observe_budget)
        self.observer = ShardObserver(config.shard, self.events, self.watchdog,
                                      interval=config.metrics_interval)
        self.exporter: MetricsExporter | None = None  # (start, as --tensorboard's writer)
        self.metrics_port: int | None = None
        self.joined = JoinedParts(self.counters)  # pushes in parts the core takes whole
        self.streamed = StreamedParts()  # pushes in parts the core adds part by part
        self.peer_ops = Peers(self, config, self.policy, self.events, self.observer,
                              self.joined, shm=self.shm is not None)
        self.ops = DataOps(self, config, self.counters, self.events, self.observer,
                           self.outbox, self.joined, self.streamed, self.peer_ops.observers)
        self._handlers: dict[Op, Handler] = {
            Op.HELLO: self.peer_ops.on_hello,
            Op.INIT: self.ops.on_init,
            Op.PULL: self.ops.on_pull,
            Op.PUSH: self.ops.on_push,
            Op.HEARTBEAT: self.peer_ops.on_heartbeat,
            Op.BYE: self.peer_ops.on_bye,
            Op.STATS: self._on_stats,
            Op.SHUTDOWN: self._on_shutdown,
            Op.CHECKPOINT: self._on_checkpoint,
            Op.SPULL: self.ops.on_spull,
            Op.SPUSH: self.ops.on_spush,
            Op.SINIT: self.ops.on_sinit,
        }
        self.elastic = Elastic(self)  # a live move to another plan (issue 47, elastic.py)
        self._handlers[Op.RESHARD] = self.elastic.on_reshard
        self.divergence = Divergence(config, self.events, self.observer, self.save_checkpoint)
        # who this shard is among its replicas, and what that decides (roles.py): lone
        # until start() reaches the replicas (issue 32)
        self.role: ShardRole = Lone(self.checkpoints, self._capture)
        # a push's metrics, watchdog rules and event, run once its reply is out (the
        # critical path of a round trip ends at the reply); before the next message
        self._after_reply: list[Callable[[], None]] = []
        # set (any thread) when the rendezvous store says every worker is done (_job_over)
        self.job_done = threading.Event()
        self._secured = bool(config.curve_secret_key)
        self._hint_held: list[int] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Ready:
        """Open what the shard serves through, once: bind the socket, start the metrics
        exporter, adopt --plan, claim or resume the checkpoint directory and tell the
        replicas (a primary's backups hear of it, which may wait on them). What it
        opened is closed again if a step fails. Returns where the shard listens."""
        if self.started:
            return self.ready
        config = self.config
        try:
            self.socket = open_socket(config, self.access)  # (under CURVE: its grants read)
            self.address = self.socket.address
            self.outbox.socket = self.socket
            self.started = True
            if config.trace:  # --trace: what arrived, was decided and was read, in order
                tracer = ShardTracer(config)
                self.ops.tracer = self.outbox.tracer = self.peer_ops.tracer = tracer
            self.exporter = MetricsExporter.for_bind(self.observer.registry,
                                                     config.metrics_port, self.address)
            self.metrics_port = self.exporter.start()
            if config.tensorboard:
                self.observer.tensorboard = TensorBoardWriter(
                    Path(config.tensorboard) / f"shard{config.shard}")
            self.role = roles.for_shard(self, config, self.events, self.socket,
                                        self.checkpoints, self._capture)
            if config.plan is not None:
                self.adopt_plan(ShardPlan.from_description(config.plan))
            # an earlier run's checkpoints are resumed, or moved aside (--fresh), never
            # taken over; a shard's first primary claims its directory for all its replicas
            if self.role.first:
                self.checkpoints.claim(config.resume, config.fresh)
            if config.resume:
                self._restore(config.resume)
        except BaseException:
            self.close(linger=0.0)
            raise
        return self.ready

    @property
    def replication(self) -> Replication | None:
        """The replication its role drives (None: a lone shard)."""
        return self.role.replication

    @property
    def ready(self) -> Ready:
        """The shard's readiness signal: its address and metrics port (once started)."""
        return Ready(self.address, self.metrics_port)

    def close(self, linger: float = 1.0, stopped: bool = False) -> None:
        """Close what :meth:`start` opened, and the event log; ``serve_forever`` does at
        its end (``stopped``: the log says so first)."""
        self.role.close()
        self.observer.close()
        if self.exporter is not None:
            self.exporter.close()
        if stopped:
            self.events.write(ev.ServerStop(shard=self.config.shard,
                                            version=self.core.version if self.core else 0))
        self.events.close()
        if self.ops.tracer is not None:
            self.ops.tracer.close()
        if self.started:
            self.socket.close(linger=linger)
        if self.shm is not None:
            self.shm.close()

    def serve_forever(self, on_ready: Callable[[Ready], None] | None = None,
                      tick: float = 0.05) -> None:
        """Serve until SHUTDOWN, :meth:`stop`, the end of the job or the divergence
        watchdog, then close. Started first if it was not (:meth:`start`); ``on_ready``
        is told where it listens once it does."""
        self.start()
        self._running = True
        self.events.write(ev.ServerStart(shard=self.config.shard, address=self.address,
                                         metrics_port=self.metrics_port,
                                         mode=self.config.mode_spec().describe(),
                                         policy=self.policy.describe(),
                                         expected_workers=self.config.expected_workers,
                                         config=self.config.to_dict()))
        log.info("shard %d/%d serving at %s (%s, policy %s)", self.config.shard,
                 self.config.num_shards, self.address, self.config.mode_spec().describe(),
                 self.policy.describe())
        if on_ready is not None:
            on_ready(self.ready)
        last_expire = 0.0
        try:
            while self._running:
                got = self.socket.recv(int(tick * 1000))
                while got is not None:
                    self._handle(*got, self.socket.user_id(got[1]))
                    if not self._running:
                        break
                    got = self.socket.recv_nowait()
                now = time.monotonic()
                self.elastic.tick(now)  # a cut reached, a move's answers due
                try:
                    self.role.tick(now)  # keep-alives, snapshots, a takeover
                except Exception as exc:  # as every periodic task: logged, counted, alarm
                    self._periodic_failed("replication", exc)
                if self.core is not None and now - last_expire >= tick:
                    last_expire = now
                    self._periodic(now)
                self._act_on_alarms()  # a death may have closed a sync round
                if self.job_done.is_set() and self._job_over():
                    self._end_job(now)
                try:
                    self.observer.tick(now)
                    self.role.export(self.observer.registry, now)
                except Exception as exc:  # metrics must not take the shard down either
                    self._periodic_failed("metrics", exc)
                if self.divergence.over(now, self.core.workers.values() if self.core else None):
                    self._running = False
            # a diverged shard must not overwrite good checkpoints with its state
            if self.config.checkpoint_dir and self.divergence.alarm is None:
                try:
                    self.role.final_checkpoint()  # with replicas: one of them writes it
                except CheckpointError as exc:  # the last good checkpoint stays LATEST
                    log.error("%s", exc)
        finally:
            self.close(stopped=True)

    def stop(self) -> None:
        self._running = False

    def _periodic(self, now: float) -> None:
        """Expiry, parked pulls and timed checkpoints; an exception here (a sync round
        closed by a death that cannot be stepped, say) is logged, counted and raised
        as an alarm, and the shard serves on."""
        assert self.core is not None
        if not self.role.duties.answers:
            try:  # a backup's timers are its primary's (deaths come forwarded), but it
                self.maybe_checkpoint()  # writes the checkpoints
            except Exception as exc:
                self._periodic_failed("checkpoint", exc)
            return
        try:
            dead = self.core.expire(now)
            self._forward_timer("dead", dead)
            for worker in dead:
                sweep() if self.shm else None  # a worker died: its segments too
                self.joined.drop(worker)
                self.events.write(ev.WorkerDead(shard=self.config.shard, worker=worker,
                                                clock=self.core.workers[worker].clock,
                                                timeout=self.config.heartbeat_timeout))
                self.observer.left(self.core, worker)
                self.peer_ops.maybe_all_done(self.core)
            # live members a round or SSP gate waited on past its deadline, silent
            left_out = self.core.leave_out(now)
            self._forward_timer("left_out", left_out)
            for worker in left_out:
                self.events.write(ev.WorkerLeftOut(shard=self.config.shard, worker=worker,
                                                   deadline=self.core.round_deadline()))
        except Exception as exc:
            self._periodic_failed("expire", exc)
        try:
            self._answer_pulls(now)
        except Exception as exc:
            self._periodic_failed("answer_pulls", exc)
        try:
            self.maybe_checkpoint()
        except Exception as exc:
            self._periodic_failed("checkpoint", exc)

    def _periodic_failed(self, what: str, exc: Exception) -> None:
        self.counters["error_periodic"] += 1
        self.counters[f"error_periodic_{what}"] += 1
        count = self.counters[f"error_periodic_{what}"]
        if count & (count - 1):  # a failure repeating every tick: log and alarm at 1, 2, 4, ...
            return
        log.error("shard %d: periodic %s failed (%d times)", self.config.shard, what, count,
                  exc_info=exc)
        version = self.core.version if self.core else None
        self.observer.raise_alarm(Alarm(
            "internal_error", self.config.shard, None,
            {"where": what, "error": f"{type(exc).__name__}: {exc}"[:500]},
            f"shard {self.config.shard}: {what} failed: {type(exc).__name__}: {exc}"[:500],
            version))

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str | None = None) -> str | None:
        """Write this shard's checkpoint now; returns the manifest path (None: nothing to save)."""
        return self.role.save_checkpoint(directory)  # (with replicas: one writes them)

    def maybe_checkpoint(self) -> None:
        self.role.maybe_checkpoint(self.core)

    def _capture(self, copy: bool) -> Capture | None:
        """The shard's checkpoint as it is now (``copy``: to be written on a thread)."""
        if self.tables is not None:
            self.tables.ready()  # (the sparse tables are saved with it)
        return self.checkpoints.capture(
            self.core, self.plan, {"optimizer_name": self.config.optimizer,
                                   "server": self.config.to_dict(), **self.script.meta()},
            self.sparse, copy=copy)

    def _restore(self, directory: str) -> None:
        # a shard restarted alone takes its latest; a resumed run, the round all hold
        plan, tensors, meta = self.checkpoints.read(directory, self.plan,
                                                    alone=self.config.restart,
                                                    num_shards=self.config.num_shards)
        try:
            self.adopt_state(shardstate.from_checkpoint(plan, tensors, meta))
        except RESTORE_ERRORS as exc:  # the server does not start from it
            raise self.checkpoints.unusable(directory, exc) from exc
        assert self.core is not None
        if not self.config.restart:  # the workers are new processes: await each
            self.core.members.await_restored()
        self.checkpoints.resumed(directory, self.core.version, settle=self.role.first)

    # ------------------------------------------------------------------ dispatch

    def _handle(self, identity: bytes, frames: list[zmq.Frame],
                key: str | None = None) -> None:
        """One message; ``key``: the CURVE key it came with (a replayed input's: the
        one it reached the primary with)."""
        seq = forwarded = 0
        lent: dict[str, torch.Tensor] = {}  # tensors read from the sender's segment
        if not self.role.admit(identity, frames, key):
            return  # a replication message
        try:
            msg = decode_request(frames, self.socket.limits)
            seq = msg.seq
            self.access.check(msg, key)
            self.ops.claims_may_stop = self.access.may_stop(key)
            route = self.role.route(msg.op, identity)
            if route is Route.DROP:  # a backup is silent to workers, as a dead
                self.counters["not_primary"] += 1  # primary is: they ask who is
                return                             # primary now (failover.py)
            gate = self.elastic.intercept(identity, frames, key, msg)
            if gate is not False:  # held at a move's cut (True), or answered plan_moved
                if gate is not True:
                    self.outbox.send(identity, gate)
                return
            if lends(msg.body):
                take_shm(self.shm, msg, identity)  # tensors in the sender's segment
                lent = msg.tensors
            elif asks_board(msg.body):
                take_shm(self.shm, msg, identity)  # the answer through the weight board
            # to the backups first (they apply it while we do); answered once they have it
            forwarded = self.role.forward(route, msg, frames, key)
            self.outbox.acknowledged(identity, seq)
            self.counters["messages"] += 1
            self.counters["bytes_in"] += sum(len(f) for f in frames)
            handler = self._handlers.get(msg.op)
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_OP,
                                    f"a server does not accept {msg.op.value}")
            if self.divergence.alarm is not None and msg.op not in (Op.STATS, Op.SHUTDOWN):
                self.divergence.refuse(msg)
            answer = handler(msg, identity)
            # a same-host worker's offer of shared memory: granted, or not
            if (msg.op is Op.HELLO and answer is not None and self.shm and self.core
                    and self.shm.answer_hello(identity, msg, frames[0], self.address, answer,
                                              self.access.grants, key, self.core)):
                self.counters["shm_peers"] += 1
            self.access.handled(msg, key)
        except ProtocolError as exc:
            self.counters[f"error_{exc.code}"] += 1
            self.observer.error(exc.code)
            log.debug("refused a message: %s", exc)
            answer = error_reply(seq, exc.code, exc.reason)
        except ConfigError as exc:  # e.g. a plug-in policy misbehaving
            self.counters["error_internal"] += 1
            log.error("request failed: %s", exc)
            answer = error_reply(seq, ErrorCode.INTERNAL, str(exc))
        except Exception as exc:  # never let one message take the server down
            self.counters["error_internal"] += 1
            log.exception("internal error while handling a message")
            answer = error_reply(seq, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        if not self.role.settle(forwarded):
            return  # fenced: a newer primary holds the shard; answer no one, and rejoin
        self._act_on_alarms()  # before replying: the launcher learns of a stop first
        if answer is not None:
            self.outbox.send(identity, answer)
        if self.core is not None:
            self._answer_pulls(time.monotonic(), later=self._after_reply)
        if self._after_reply or (self.core is not None and self.core.probe.pending):
            self._run_after_reply()
        if lent and self.shm is not None and self._releases():
            self.shm.release(identity, lent)  # added or applied, and measured

    # ------------------------------------------------------------------ replicas

    def replay(self, frames: list[Any], key: str | None) -> None:
        """A backup handles a message its primary forwarded, as the primary did."""
        self._handle(REPLAYED, frames, key)

    def send_state(self) -> ShardImage | None:
        """What a joining replica is sent (None: not now, a push in parts under way)."""
        return shardstate.capture(self.core, self.plan,
                                  bool(self.joined.pending or self.streamed.pending),
                                  self.access.owners, self.script.meta()[META_KEY])

    def plan_description(self) -> object | None:
        # (as a snapshot's JSON gives it back: tuples are lists there)
        return None if self.plan is None else msgspec.json.decode(
            msgspec.json.encode(self.plan.describe()))

    def restore(self, record: wrepl.Snapshot, frames: list[Any]) -> None:
        shardstate.receive_snapshot(self, record, frames, self.socket.limits,
                                    self.config.plan_limits())  # a joining replica's

    def adopt_state(self, state: ShardState) -> None:
        """Put ``state`` (a checkpoint resumed, a primary's snapshot: shardstate.py) in
        place of everything this shard held: a core built from its plan and loaded, and
        none of the per-worker state a push or pull in flight left. When it does not
        fit, nothing half-restored stays (and the error is raised on)."""
        self.core = self.plan = None
        self.sparse = self.tables = None
        for parts in (self.joined, self.streamed, self.outbox):
            parts.forget(())
        self.outbox.observer_pulls.clear()
        if self.shm is not None:  # its board holds the old core's slices (a live move):
            self.shm.close()  # the same-host workers say HELLO again and are granted anew
            self.shm.shard = self.config.shard
        self.access.owners = dict(state.owners)  # (CURVE: who may act as each worker)
        if state.plan is None:
            return
        try:
            self.script.restore(state.meta)  # (the optimizer the core is built with)
            self.adopt_plan(state.plan)
            assert self.core is not None
            if state.load is not None:
                state.load(self.core, self.sparse)
        except BaseException:
            self.core = self.plan = None
            self.sparse = self.tables = None
            raise

    def replay_death(self, kind: str, workers: list[int]) -> None:
        """A backup applies the deaths or leave-outs its primary's timers decided in one
        tick: all of them, then the round closes if it can, as ShardCore.expire and
        leave_out do."""
        core = self.core
        if core is None:
            return
        for worker in core.members.apply_decided(kind, workers):
            self.joined.drop(worker)
            self.events.write(ev.WorkerDead(shard=self.config.shard, worker=worker,
                                            clock=core.workers[worker].clock,
                                            timeout=self.config.heartbeat_timeout))
        self._answer_pulls(time.monotonic())

    def _forward_timer(self, kind: str, workers: list[int]) -> None:
        """The primary's timers decided deaths or leave-outs: the backups apply them
        too, before any answer they unblock goes out."""
        if not self.role.decided(kind, workers):
            self._running = False  # fenced

    def _releases(self) -> bool:
        """Whether a same-host worker's used pages are unmapped after a message
        (``shm_release``). Unset: yes, unless one worker's pages are what a plain-SGD
        step reads in place; they then stand in for the aggregation buffer, and
        unmapping them would cost a refault per push and lower no peak."""
        if self.config.shm_release is not None:
            return self.config.shm_release
        core = self.core
        return (self.shm is not None and len(self.shm.peers) > 1) or core is None \
            or not core.stepper.reads_only(core.params)

    def _run_after_reply(self) -> None:
        """The deferred observation of pushes just answered (the core's measurements
        first, then what reads them); an alarm it raises acts now, before the next
        message is handled."""
        if self.core is not None and self.core.probe.pending:
            try:
                self.measure_budget.flush(self.core.probe, time.perf_counter)
            except Exception:  # observation must not take the server down
                self.counters["error_internal"] += 1
                log.exception("measuring a push failed")
        work, self._after_reply = self._after_reply, []
        for fn in work:
            try:
                fn()
            except Exception:  # observation must not take the server down
                self.counters["error_internal"] += 1
                log.exception("observing a push failed")
        self._act_on_alarms()

    def before_mutation(self) -> None:
        """Copy-on-write: parameters still being sent must not be written in place."""
        self.outbox.settle(self.core)
        if self.shm is not None and self.core is not None:
            # the weights' board slot is written in place in sync mode: each worker
            # read the round's weights before it pushed
            self.shm.before_change(in_place=self.core.mode.mode == "sync")

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the reply to the message being handled is out."""
        self._after_reply.append(fn)

    def forget_gone(self) -> None:
        """Drop the server's own per-worker state of workers the core evicted."""
        assert self.core is not None
        known = self.core.workers
        self.joined.forget(known)
        self.streamed.forget(known)
        self.outbox.forget(known)
        self.access.forget(known)
        if self.shm is not None:
            self.shm.forget(known)
        self.peer_ops.forget(known)
        self.divergence.forget(known)
        self.observer.forget(set(known))
        if self.core.squeeze is not None:  # (compressed pulls: core/pullsqueeze.py)
            self.core.squeeze.forget(known)

    @property
    def peers(self) -> dict[int, PeerInfo]:
        """Each worker's host and pid, from its HELLO (shown by STATS)."""
        return self.peer_ops.known

    def _after_mutation(self) -> None:
        if self.shm is not None and self.core is not None:
            self.shm.after_change(self.core.version)

    def _step_refused(self, version: int) -> None:
        """The core undid a step that made the weights or optimizer state NaN or Inf:
        counted, and an alarm at 1, 2, 4, ...; not divergence (Alarm.divergence): the
        weights are as before, and one worker's push must not stop the shard"""
        self.counters["steps_refused"] += 1
        count = self.counters["steps_refused"]
        if count & (count - 1):
            return
        self.observer.raise_alarm(Alarm(
            "nonfinite_weights", self.config.shard, None, {"steps_refused": count},
            f"a step at version {version} would have made the weights or the optimizer's "
            f"state NaN or Inf (finite gradients that overflow them); it was undone, the "
            f"weights are as before ({count} refused so far)", version))

    def _answer_pulls(self, now: float, later: list[Callable[[], None]] | None = None) -> None:
        """Send the pull replies whose gates opened; ``later``: see Outbox.answer_pulls."""
        assert self.core is not None
        if not self.role.duties.answers:
            roles.close_pulls(self.core, self.outbox, now)  # a backup answers no one
            return
        self.outbox.answer_pulls(self.core, now, self.observer, later)
        if self.tables is not None and self.tables.held:
            self.ops.answer_held_sparse()
        if self.sparse is not None:  # sync sparse pushes are answered when their round closes
            for token, outcome in self.core.rows.ready(self.sparse):
                identity, seq = cast("tuple[bytes, int]", token)
                self.outbox.send(identity, Message(Op.REPLY, seq,
                                                   {"re": "spush", **outcome.row_fields()}))

    # ------------------------------------------------------------------ watchdog

    def _observe_core(self) -> None:
        assert self.core is not None
        cfg = self.watchdog.config
        self.watchdog.elements = sum(s.numel for s in self.core.specs.values())
        cosine = cfg.enabled and "gradient_disagrees" not in cfg.disable
        self.core.observe(self.observer.on_core, cosine_decay=0.97 if cosine else None,
                          every=cfg.observe_every)
        self.core.probe.defer = True  # measured after the reply: see _run_after_reply

    def _act_on_alarms(self) -> None:
        self.divergence.act(self.core.version if self.core else 0)

    @property
    def exit_code(self) -> int:
        """The process's: 0, or DIVERGED_EXIT_CODE once the watchdog stopped training."""
        return self.divergence.exit_code

    def _end_job(self, now: float) -> None:
        """Stop: every worker is done. The final pulls the last BYE released
        (opt.final()) are answered first, not left to a _periodic tick that never comes."""
        log.info("shard %d: every worker is done; stopping", self.config.shard)
        self._running = False
        try:
            if self.core is not None:
                self._answer_pulls(now)
        except Exception as exc:
            self._periodic_failed("answer_pulls", exc)

    def _job_over(self) -> bool:
        """Act on :attr:`job_done`? Without CURVE yes (the store is as trusted as the
        wire); with it only once every expected worker said BYE over its key or died here:
        the store is not authenticated, and a hostile client of it must not stop us."""
        if not self._secured:
            return True
        expected = self.config.expected_workers
        holding = self.core.holding(expected) if self.core else list(range(expected))
        if holding and holding != self._hint_held:
            self._hint_held = holding  # warn once per change, not every tick
            log.warning("shard %d: the rendezvous store says every worker is done, but "
                        "worker(s) %s did not say BYE here; serving on until they do (or an "
                        "admin SHUTDOWN, or SIGTERM)", self.config.shard,
                        ", ".join(map(str, holding)))
        return not holding

    # ------------------------------------------------------------------ ops

    def adopt_plan(self, plan: ShardPlan) -> None:
        pinned = self.config.plan_hash
        if pinned is not None and plan.hash != pinned:  # (a HELLO's was checked before)
            raise ConfigError(f"shard {self.config.shard}: the plan {plan.hash[:12]}... is not "
                              f"the one --plan-hash pins ({pinned[:12]}...)")
        if plan.num_shards != self.config.num_shards:
            raise ProtocolError(
                ErrorCode.PLAN_MISMATCH,
                f"the worker's plan has {plan.num_shards} shards; this server is shard "
                f"{self.config.shard} of {self.config.num_shards}",
            )
        if plan.sparse:  # (a command's tables are known here first: one rule, the table's)
            try:
                features.check(self.config.features() | {"sparse"})
            except ConfigError as exc:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"invalid plan: {exc}") from exc
        core = self.config.new_core(plan, self.policy)
        self.sparse = SparseShard.for_server(plan, self.config, core.members.live_ids)
        self.tables = TableBuilder(self.sparse, self.config.shard) if self.sparse else None
        self.core = core  # (not before the plan's tables proved trainable)
        self.core.before_step = self.before_mutation
        self.core.after_step = self._after_mutation
        self.core.on_refused = self._step_refused
        self.core.ahead.busy = self.socket.pending  # step ahead only while idle
        self._observe_core()
        self.plan = plan
        self.joined.budget = (64 << 20) + (self.config.expected_workers + 1) * plan.shard_bytes(
            self.config.shard)
        log.info("shard %d holds %d slices, %d bytes", self.config.shard, len(core.specs),
                 plan.shard_bytes(self.config.shard))

    def _on_stats(self, msg: Message, identity: bytes) -> Message:
        return wstats.answer(msg, self.stats())

    def _on_checkpoint(self, msg: Message, identity: bytes) -> Message:
        # a peer may only choose a place inside the configured checkpoint
        # directory: the server never writes where a message tells it to
        b: Checkpoint = msg.body
        path = self.save_checkpoint(self.checkpoints.target(b.path))
        return reply(msg, path=path, version=self.core.version if self.core else 0)

    def _on_shutdown(self, msg: Message, identity: bytes) -> Message:
        log.info("shard %d: shutdown requested", self.config.shard)
        self._running = False
        return reply(msg)  # the socket closes with a linger, so that this still goes out

    def stats(self) -> wstats.ShardStats:
        core, sparse = self.core, self.sparse
        self.counters["plan_epoch"] = self.elastic.epoch  # (status shows it)
        figures = (wstats.Unplanned(self.config.mode_spec().describe(), self.policy.describe())
                   if core is None else wstats.heard(core.stats(), self.peers))
        return wstats.fit(wstats.ShardStats(  # bounded, so that the reply decodes
            self.config.shard, self.config.num_shards, self.address,
            time.time() - self.started_at, dict(self.counters), self.metrics_port,
            self.measure_budget.level, self.observer.summary(), figures,
            None if core is None or sparse is None else wstats.SparseStats.of(sparse.stats())))


if __name__ == "__main__":  # the launcher's way to start a shard: entry.py's main, run
    import runpy  # by name (entry.py imports this module: no import runs back to it)

    runpy.run_module("paramserver.server.entry", run_name="__main__", alter_sys=True)
