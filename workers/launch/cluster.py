"""Run a whole local cluster (S shard processes + N worker processes) to completion.

This is the Python API behind ``paramserver launch`` and the tests::

    spec = ClusterSpec(num_servers=2, num_workers=3,
                       server=ServerConfig(mode="sync"), worker=WorkerConfig(steps=200))
    result = run_cluster(spec, out_dir="runs/demo")

Every process is a real OS process talking over loopback TCP. Servers bind
port 0 and announce the port they got on stdout, so there are no port races.
Each process logs to ``out_dir/logs/<name>.log`` and writes a JSONL event log
to ``out_dir/events/<name>.jsonl``. When the workers are done the launcher
evaluates the final weights (as an observer, so nothing is gated), collects
every shard's statistics and writes ``out_dir/result.json``. Whatever
happens, :meth:`LocalCluster.stop` leaves no process behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from paramserver.errors import ConfigError, ParamServerError, RequestTimeoutError
from paramserver.observe import records as ev
from paramserver.observe.events import write_json
from paramserver.observe.recorder import JsonlFollower, LauncherObserver
from paramserver.server.config import ServerConfig
from paramserver.server.process import Ready
from paramserver.util import lifeline
from paramserver.util.jsontypes import JSONObject
from paramserver.wire.curve import admin_key_pair
from paramserver.wire.replauth import make_key_file
from paramserver.workers.failover import current_primaries, join_replicas
from paramserver.workers.launch.children import ChildProcess, child_env
from paramserver.workers.launch.clusterspec import (
    FAILURE_POLICIES,
    ClusterSpec,
    Progress,
    replica_name,
)
from paramserver.workers.launch.finalfigures import final_figures
from paramserver.workers.launch.netcluster import EmulatedCluster, emulated_cluster
from paramserver.workers.launch.processes import (
    ProcessInfo,
    command_python,
    exit_reason,
    shard_cause,
    tail,
)
from paramserver.workers.launch.replicas import ReplicaKeeper
from paramserver.workers.launch.results import (
    NOT_JOINED,
    ClusterResult,
    FailureRecord,
    LostWorker,
    RestartRecord,
    WorkerResult,
    WorkerSummary,
    worker_summaries,
)
from paramserver.workers.launch.stall import StallNotice, StallRecord, StallWatch
from paramserver.workers.launch.zygote import ForkedProcess, ZygoteError, fork_enabled, zygote_for

__all__ = [
    "FAILURE_POLICIES",
    "ClusterError",
    "ClusterResult",
    "ClusterSpec",
    "LocalCluster",
    "ProcessInfo",
    "Progress",
    "WorkerSummary",
    "exit_reason",
    "run_cluster",
    "worker_summaries",
]

log = logging.getLogger(__name__)


WORKER_MODULE = "paramserver.workers.worker"  # what each worker process runs as __main__


class ClusterError(ParamServerError):
    """A process of the cluster failed; the message names it and shows its log's tail."""


class LocalCluster:
    """Start, watch and stop the processes of one local run."""

    def __init__(self, spec: ClusterSpec, out_dir: str | Path,
                 on_alarm: Callable[[dict[str, Any]], None] | None = None,
                 on_process: Callable[[ProcessInfo], None] | None = None) -> None:
        self.out = Path(out_dir)
        for sub in ("logs", "events", "results", "configs"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        if spec.server.curve_secret_key and not spec.admin_key:
            # CURVE: the launcher runs SHUTDOWN and death reports with an admin key
            # of its own, which only it and its shards know of
            spec = dataclasses.replace(spec, admin_key=str(admin_key_pair(self.out / "keys")))
        if spec.server.replicas and not spec.server.replication_key:
            # the run's replication key: its replicas seal every message with it, so no
            # stranger who reaches their ports can replicate into them (a new one per
            # run, in a file only this user may read; its path goes to them, not it)
            key = make_key_file(self.out / "keys" / "replication.key", force=True)
            spec = dataclasses.replace(spec, server=dataclasses.replace(
                spec.server, replication_key=str(key)))
        if not spec.run_id:  # one identity for every process of the run (wrong_run)
            spec = dataclasses.replace(spec, run_id=secrets.token_hex(16))
        self.spec = spec
        #: the pipe whose end only this process holds: the processes started without the
        #: zygote (which stops its own) watch it and stop when this process ends, however
        self.lifeline = lifeline.Lifeline()
        # follows every event log: launcher metrics, watchdog alarms (on_alarm), divergence
        self.observer = LauncherObserver(self.out, metrics_port=spec.metrics_port,
                                         tensorboard=spec.tensorboard, on_alarm=on_alarm)
        self.servers: list[ChildProcess] = []
        self.retired: list[ChildProcess] = []  # shards a live reshard removed (elastic.py)
        self.workers: list[ChildProcess] = []
        self.addresses: list[str] = []
        #: with --replicas: each shard's backups, and each shard's replicas' addresses
        #: (the first primary first)
        self.backups: list[list[ChildProcess]] = []
        self.replica_sets: list[list[str]] = []
        self._gone: set[str] = set()  # replicas whose death was recorded
        self.keeper = ReplicaKeeper(self)  # dead replicas replaced, their events told
        self._env = child_env()
        self._cold_starts = False  # set when the zygote cannot fork: python -m per process
        self._followers: dict[int, JsonlFollower] = {}
        self._progress_steps: dict[int, int] = {}
        self._progress_loss: dict[int, float] = {}
        self._t0 = time.time()
        self.failures: list[FailureRecord] = []
        self.restarts: list[RestartRecord] = []
        #: times the run logged no step for long (StallWatch), and when it went on
        self.stalls: list[StallRecord] = []
        self._stall = StallWatch(spec.stall_warning)
        #: with --hosts: the emulated hosts every process runs on (made by start_servers,
        #: deleted by stop, after the processes)
        self.plan = spec.host_plan()
        self.net: EmulatedCluster | None = None
        self._net_stack = contextlib.ExitStack()
        #: every process started, restarts included; also in out_dir/processes.json
        self.processes: list[ProcessInfo] = []
        self._on_process = on_process

    # ------------------------------------------------------------------ processes

    def _spawn(self, name: str, module: str, config: JSONObject, *,
               ready_pipe: bool, append: bool = False, host: int | None = None) -> ChildProcess:
        """Start ``python -m module config.json``; output goes to the log file, except
        stdout of a server, which announces its address on it. ``host``: on that
        emulated host (its namespace is entered by exec, so never forked)."""
        cfg_path = self.out / "configs" / f"{name}.json"
        cfg_path.write_text(json.dumps(config, indent=2))
        log_path = self.out / "logs" / f"{name}.log"
        log_file = log_path.open("ab" if append else "wb")  # a restart keeps the history
        try:
            popen: subprocess.Popen[bytes] | ForkedProcess | None = None
            if fork_enabled() and not self._cold_starts and host is None:
                try:
                    popen = self._fork(module, str(cfg_path), log_file, ready_pipe)
                except ZygoteError as exc:
                    log.warning("%s; starting processes without it from now on", exc)
                    self._cold_starts = True
            if popen is None:
                popen = subprocess.Popen(
                    [*self._prefix(host), sys.executable, "-m", module, str(cfg_path)],
                    stdout=subprocess.PIPE if ready_pipe else log_file,
                    stderr=log_file if ready_pipe else subprocess.STDOUT,
                    env={**self._env, **self.lifeline.env()}, pass_fds=self.lifeline.pass_fds,
                )
        finally:
            log_file.close()
        role = "server" if module == "paramserver.server.loop" else "worker"
        self._started(ProcessInfo(name, role,
                                  popen.pid, time.time()))
        return ChildProcess(name, popen, log_path)

    def _prefix(self, host: int | None) -> list[str]:
        """What runs a program on emulated host ``host`` ([]: none, or no hosts)."""
        if host is None or self.net is None:
            return []
        return self.net.exec_prefix(host)

    def server_host(self, shard: int, replica: int = 0) -> int | None:
        """The emulated host of ``shard``'s ``replica`` (None: no --hosts)."""
        return None if self.plan is None else self.plan.server_host(shard, replica)

    def worker_host(self, rank: int) -> int | None:
        return None if self.plan is None else self.plan.worker_host(rank)

    def bind_on(self, cfg: ServerConfig, shard: int, replica: int = 0) -> ServerConfig:
        """``cfg`` bound to its emulated host's address (any port), where there are hosts."""
        host = self.server_host(shard, replica)
        if host is None or self.net is None:
            return cfg
        return dataclasses.replace(cfg, bind=f"tcp://{self.net.address(host)}:0")

    def open_hosts(self) -> None:
        """Make the emulated hosts (--hosts), reachable from here for the launcher's own
        requests (stats, the final weights, SHUTDOWN); :meth:`stop` deletes them."""
        if self.plan is None or self.net is not None:
            return
        plan = self.plan
        self.net = self._net_stack.enter_context(emulated_cluster(
            plan.workers, plan.servers, plan.link, dict(plan.link_of), reach=True))
        # at once, as processes.json: which namespace and address each host is, while
        # the run goes on (`ip netns exec NAMESPACE ...` looks inside one)
        write_json(self.out / "hosts.json", list(self.host_records() or ()))
        log.info("emulated hosts: %s", plan.describe())

    def host_records(self) -> tuple[JSONObject, ...] | None:
        """Each emulated host: name, role, address, NIC rate, the processes it ran."""
        if self.plan is None or self.net is None:
            return None
        return self.plan.records(self.net, self.spec.num_workers, self.spec.num_servers,
                                 self.spec.server.replicas)

    def _started(self, info: ProcessInfo) -> None:
        """Record a new process in processes.json at once, so that a user (or a test)
        can tell which pid is which while the run goes on."""
        self.processes.append(info)
        write_json(self.out / "processes.json", [p.as_dict() for p in self.processes])
        log.info("%s started: pid %d", info.name, info.pid)
        if self._on_process is not None:
            self._on_process(info)

    def _fork(self, module: str, cfg_path: str, log_file: BinaryIO,
              ready_pipe: bool) -> ForkedProcess:
        """The same process, forked from a preloaded zygote (paramserver.workers.launch.zygote)."""
        if not ready_pipe:
            return zygote_for(self._env).spawn(module, [cfg_path], env=self._env,
                                               stdout=log_file.fileno(),
                                               stderr=log_file.fileno())
        read_fd, write_fd = os.pipe()
        stdout = os.fdopen(read_fd, "rb", buffering=0)
        try:
            return zygote_for(self._env).spawn(
                module, [cfg_path], env=self._env, stdout=write_fd, stderr=log_file.fileno(),
                stdout_pipe=stdout)
        except BaseException:
            stdout.close()
            raise
        finally:
            os.close(write_fd)

    def start_servers(self) -> list[str]:
        self.open_hosts()
        self.observer.start(spec=self.spec.to_dict())
        deadline = time.monotonic() + self.spec.startup_timeout
        # backups first: each primary is told where its backups listen
        self.backups = [[self._spawn(replica_name(shard, k), "paramserver.server.loop",
                                     self.bind_on(self.spec.replica_config(shard, k, self.out),
                                                  shard, k).to_dict(),
                                     ready_pipe=True, host=self.server_host(shard, k))
                         for k in range(1, self.spec.server.replicas + 1)]
                        for shard in range(self.spec.num_servers)]
        peers = [[self._await_ready(p, deadline) for p in procs] for procs in self.backups]
        for shard in range(self.spec.num_servers):
            cfg = dataclasses.replace(self.bind_on(self.spec.server_config(shard, self.out),
                                                   shard), replica_peers=peers[shard])
            self.servers.append(self._spawn(f"server{shard}", "paramserver.server.loop",
                                            cfg.to_dict(), ready_pipe=True,
                                            host=self.server_host(shard)))
        self.addresses = [self._await_ready(p, deadline) for p in self.servers]
        self.replica_sets = [[a, *b] for a, b in zip(self.addresses, peers, strict=True)]
        return self.addresses

    def worker_addresses(self) -> list[str]:
        """What workers are given: each shard's address, or with --replicas its replicas'
        joined by ``|`` (workers/failover.py)."""
        if not self.spec.server.replicas:
            return self.addresses
        return [join_replicas(r) for r in self.replica_sets]

    def primaries(self) -> list[str]:
        """Each shard's primary now (with --replicas, asked of its replicas)."""
        if not self.spec.server.replicas:
            return self.addresses
        return current_primaries(self.worker_addresses(), curve=self.spec.admin_curve())

    def _all_servers(self) -> list[ChildProcess]:
        return self.servers + self.retired + [p for procs in self.backups for p in procs]

    def _replica_died(self, shard: int, proc: ChildProcess, code: int) -> None:
        """With --replicas, one replica's death is not the shard's: the run goes on
        while one of its replicas lives (its backup takes over if it was the primary)."""
        if proc.name not in self._gone:
            self._gone.add(proc.name)
            self._failed(proc.name, code)
            log.warning("%s exited (%s); shard %d goes on on its other replica(s)",
                        proc.name, exit_reason(code), shard)
            if code != 0:  # (not one stopped at the end): a new process rejoins for it
                self.keeper.died(shard, proc)
        replicas = [self.servers[shard], *self.backups[shard]]
        if all(p.popen.poll() is not None for p in replicas):
            raise ClusterError(f"every replica of shard {shard} exited; log tail "
                               f"({proc.log_path}):\n{tail(proc.log_path)}")

    def _await_ready(self, proc: ChildProcess, deadline: float) -> str:
        assert proc.popen.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.popen.stdout, selectors.EVENT_READ)
        buf = b""
        try:
            while b"\n" not in buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestTimeoutError(
                        f"{proc.name} did not report ready within {self.spec.startup_timeout:g}s;"
                        f" log tail:\n{tail(proc.log_path)}"
                    )
                if sel.select(remaining):
                    chunk = os.read(proc.popen.stdout.fileno(), 4096)
                    if not chunk:
                        proc.popen.wait()
                        raise ClusterError(
                            f"{proc.name} exited with code {proc.popen.returncode} before it "
                            f"was ready; log tail:\n{tail(proc.log_path)}"
                        )
                    buf += chunk
        finally:
            sel.close()
        line = buf.decode().splitlines()[0]
        try:
            ready = Ready.parse(line)
        except ValueError:
            raise ClusterError(f"{proc.name} printed {line!r} instead of its address") from None
        if ready.metrics_port is not None:
            proc.metrics_port = ready.metrics_port
            log.info("%s metrics at http://127.0.0.1:%s/metrics", proc.name, ready.metrics_port)
        return ready.address

    def start_workers(self) -> None:
        if self.spec.command:  # `python` outside the launcher's environment, say
            command, note = command_python(self.spec.command, self._env)
            if note is not None:
                log.warning("%s", note)
                self.spec = dataclasses.replace(self.spec, command=command)
        for rank in range(self.spec.num_workers):
            self.workers.append(self._start_worker(rank))

    def _start_worker(self, rank: int, append: bool = False) -> ChildProcess:
        if self.spec.command:
            return self._run_command(rank, append)
        cfg = self.spec.worker_config(rank, self.worker_addresses(), self.out)
        return self._spawn(f"worker{rank}", WORKER_MODULE, cfg.to_dict(), ready_pipe=False,
                           append=append, host=self.worker_host(rank))

    def _run_command(self, rank: int, append: bool) -> ChildProcess:
        """The user's command as worker ``rank`` (not forked: it is not our module)."""
        assert self.spec.command
        name = f"worker{rank}"
        log_path = self.out / "logs" / f"{name}.log"
        write_json(self.spec.options_file(rank, self.out),
                   self.spec.launch_options(rank).to_json())
        env = {**self._env, **self.spec.command_env(rank, self.worker_addresses(), self.out),
               **self.lifeline.env()}  # its DistributedOptimizer watches it
        with log_path.open("ab" if append else "wb") as log_file:
            try:
                popen = subprocess.Popen([*self._prefix(self.worker_host(rank)),
                                          *self.spec.command], stdout=log_file,
                                         stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL,
                                         pass_fds=self.lifeline.pass_fds)
            except OSError as exc:
                raise ConfigError(f"cannot run {' '.join(self.spec.command)!r}: "
                                  f"{exc.strerror or exc}") from None
        self._started(ProcessInfo(name, "worker", popen.pid, time.time()))
        return ChildProcess(name, popen, log_path)

    def wait_workers(self, on_progress: Callable[[Progress], None] | None = None,
                     poll: float = 0.5) -> None:
        """Block until every worker exits, handling failures as the spec says.

        Raises ClusterError naming the failed process (with its log's tail) when
        a failure is not to be tolerated or restarted.
        """
        deadline = (time.monotonic() + self.spec.run_timeout) if self.spec.run_timeout else None
        pending = set(range(len(self.workers)))
        while pending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.workers[min(pending)].popen.wait(timeout=poll)
            self._raise_if_diverged()
            for rank in sorted(pending):
                proc = self.workers[rank]
                code = proc.popen.poll()
                if code is None:
                    continue
                if code == 0 and not self._never_joined(rank):
                    pending.discard(rank)
                    continue
                if code == 0:  # a command that ran to its end without a DistributedOptimizer
                    self.failures.append(FailureRecord(proc.name, 0, NOT_JOINED, time.time()))
                    if self.spec.on_worker_failure == "tolerate":
                        log.warning("%s %s; the others go on", proc.name, NOT_JOINED)
                        pending.discard(rank)
                        continue
                    raise ClusterError(
                        f"{proc.name} {NOT_JOINED}: its command ran to its end without "
                        f"building a DistributedOptimizer, so it trained nothing "
                        f"(--on-worker-failure {self.spec.on_worker_failure}); log tail "
                        f"({proc.log_path}):\n{tail(proc.log_path)}")
                self._raise_if_diverged()  # a stopped shard's refusal, not the worker's fault
                self._failed(proc.name, code)
                self._report_dead(rank)
                policy = self.spec.on_worker_failure
                if policy == "restart" and self._restarts(proc.name) < self.spec.max_restarts:
                    log.warning("%s died (%s); restarting it", proc.name, exit_reason(code))
                    self._restart_worker(rank)
                elif policy == "tolerate":
                    log.warning("%s died (%s); the others go on", proc.name, exit_reason(code))
                    pending.discard(rank)
                else:
                    cause = shard_cause(proc.log_path, [s.log_path for s in self.servers])
                    raise ClusterError(
                        f"{cause}{proc.name} failed with {exit_reason(code)}"
                        f"{' on that error reply' if cause else ''}; log tail "
                        f"({proc.log_path}):\n{tail(proc.log_path)}"
                    )
            for shard, backups in enumerate(self.backups):
                for proc in [self.servers[shard], *backups] if backups else []:
                    if (code := proc.popen.poll()) is not None:
                        self._replica_died(shard, proc, code)
                    self.keeper.report(proc.name)
            self.keeper.tick()
            for shard, proc in enumerate(self.servers):
                code = proc.popen.poll()
                if code is None or self.spec.server.replicas:
                    continue
                self._raise_if_diverged()  # a watchdog stop is not restarted
                self._failed(proc.name, code)
                if self.spec.restart_servers and (
                        self._restarts(proc.name) < self.spec.max_restarts):
                    log.warning("%s died (exit code %d); restarting it", proc.name, code)
                    self._restart_server(shard)
                    continue
                raise ClusterError(
                    f"{proc.name} exited early with code {code}; log tail "
                    f"({proc.log_path}):\n{tail(proc.log_path)}"
                )
            if on_progress is not None or self.spec.stall_warning:
                progress = self.progress()
                notice = self._stall.update(progress.done_steps, time.monotonic())
                if notice is not None:
                    self._report_stall(notice, sorted(pending))
                if on_progress is not None:
                    on_progress(progress)
            if deadline is not None and time.monotonic() > deadline:
                raise RequestTimeoutError(self._overdue(sorted(pending)))

    def _never_joined(self, rank: int) -> bool:
        """A command's worker that exited without a result: its DistributedOptimizer
        writes one when closed, at exit at the latest, so it never built one."""
        return bool(self.spec.command) and not (
            self.out / "results" / f"worker{rank}.json").exists()

    def _tails(self, pending: list[int]) -> str:
        """The workers still running and the last lines each of them and each shard
        logged: what they were waiting for."""
        procs = [self.workers[r] for r in pending] + list(self.servers)
        return (", ".join(self.workers[r].name for r in pending)
                + "; the last lines of their logs and the shards':"
                + "".join(f"\n--- {p.name} ({p.log_path}):\n{tail(p.log_path, 8)}"
                          for p in procs))

    def _overdue(self, pending: list[int]) -> str:
        """What a run past ``run_timeout`` says."""
        return f"workers still running after {self.spec.run_timeout:g}s: {self._tails(pending)}"

    def _report_stall(self, notice: StallNotice, pending: list[int]) -> None:
        pace = ""
        if notice.pace >= 1:
            pace = f"; before it, a step every {notice.pace:.1f}s"
        elif notice.pace:
            pace = f"; before it, {1 / notice.pace:.0f} steps a second"
        self.stalls.append(StallRecord(notice.stalled, notice.quiet, notice.pace, time.time()))
        self.observer.events.write(ev.Stall(stalled=notice.stalled, quiet=notice.quiet,
                                            pace=notice.pace,
                                            running=[self.workers[r].name for r in pending]))
        if notice.stalled:
            log.warning("no worker has logged a step for %.0fs%s (--stall-warning %gs); "
                        "still running: %s", notice.quiet, pace, self.spec.stall_warning,
                        self._tails(pending))
        else:
            log.warning("steps resumed after %.0fs without one", notice.quiet)

    def _report_dead(self, rank: int) -> None:
        """Best effort: the shards' heartbeat timeout still holds if this fails."""
        from paramserver.workers.admin import report_dead

        try:
            report_dead(self.primaries(), rank, curve=self.spec.admin_curve())
        except ParamServerError as exc:
            log.warning("could not report worker%d's death to the servers: %s", rank, exc)

    def _raise_if_diverged(self) -> None:
        """Raise ClusterError if a shard's watchdog stopped training (``diverged`` event)."""
        self.observer.poll()
        if self.observer.diverged:
            rec = self.observer.diverged[0]
            saved = f"; saved {rec['checkpoint']}" if rec.get("checkpoint") else ""
            raise ClusterError(
                f"the divergence watchdog stopped training on {rec['process']} "
                f"(--on-divergence {rec['action']}): {rec['message']}{saved}"
            )

    def _failed(self, name: str, code: int) -> None:
        self.failures.append(FailureRecord(name, code, exit_reason(code), time.time()))

    def _restarts(self, name: str) -> int:
        return sum(1 for r in self.restarts if r.process == name)

    def _restart_worker(self, rank: int) -> None:
        self.workers[rank] = self._start_worker(rank, append=True)
        self.restarts.append(RestartRecord(f"worker{rank}", time.time()))

    def _restart_server(self, shard: int) -> None:
        """Same shard, same address, state from its latest checkpoint (if any)."""
        from paramserver.persist.checkpoint import CheckpointError, load_shard

        cfg = self.spec.server_config(shard, self.out)
        cfg.bind = self.addresses[shard]
        cfg.restart = True  # its workers run on: its own latest checkpoint, nobody awaited
        if cfg.checkpoint_dir:
            try:
                load_shard(cfg.checkpoint_dir, shard)
                cfg.resume, cfg.fresh = cfg.checkpoint_dir, False
            except CheckpointError as exc:
                # what is there cannot be resumed: it is moved aside, not taken over
                cfg.fresh = True
                log.warning("server%d restarts empty: %s", shard, exc)
        old = self.servers[shard]
        if old.popen.stdout is not None:
            old.popen.stdout.close()
        proc = self._spawn(f"server{shard}", "paramserver.server.loop", cfg.to_dict(),
                           ready_pipe=True, append=True, host=self.server_host(shard))
        self.servers[shard] = proc
        self._await_ready(proc, time.monotonic() + self.spec.startup_timeout)
        self.restarts.append(RestartRecord(f"server{shard}", time.time(),
                                           resumed=cfg.resume is not None))

    def shutdown_backups(self) -> None:
        """SHUTDOWN to every live backup before the primaries (a backup whose primary
        stopped first would take over, for nothing)."""
        from paramserver.workers.admin import shutdown_servers

        if not any(self.backups):  # (no --replicas; a live move may have left fewer shards)
            return
        primaries = set(self.primaries())
        procs = [[self.servers[s], *b] for s, b in enumerate(self.backups)]
        backups = [a for r, ps in zip(self.replica_sets, procs, strict=True)
                   for a, p in zip(r, ps, strict=True)
                   if a not in primaries and p.popen.poll() is None]
        if backups:
            try:
                shutdown_servers(backups, curve=self.spec.admin_curve())
            except ParamServerError as exc:  # a dead one: stop() reaps the others
                log.debug("stopping the backups: %s", exc)

    def progress(self) -> Progress:
        """Steps and last loss per worker, read incrementally from the event logs."""
        for rank in range(self.spec.num_workers):
            follower = self._followers.get(rank)
            if follower is None:
                path = self.out / "events" / f"worker{rank}.jsonl"
                follower = self._followers[rank] = JsonlFollower(path)
            for rec in follower.read():
                if rec.get("event") == "step":
                    # gradients computed: a local-SGD push holds local_steps of them
                    done = rec.get("local_steps", 1)
                    self._progress_steps[rank] = (self._progress_steps.get(rank, 0)
                                                  + (done if isinstance(done, int) else 1))
                    if rec.get("loss") is not None:
                        self._progress_loss[rank] = rec["loss"]
        return Progress(dict(self._progress_steps),
                        (self.spec.worker.steps or 0) * self.spec.num_workers,
                        dict(self._progress_loss), 0, time.time() - self._t0)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every process: ask politely (SIGTERM), then insist (SIGKILL); then
        delete the emulated hosts, if any (and kill what still runs on them)."""
        try:
            self._stop_processes(timeout)
        finally:
            self._net_stack.close()

    def _stop_processes(self, timeout: float) -> None:
        procs = self.workers + self._all_servers()
        for p in procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM; killing it", p.name)
                p.popen.kill()
                p.popen.wait()
            if p.popen.stdout is not None:
                p.popen.stdout.close()
        self.lifeline.close()
        self.observer.close(failures=len(self.failures), restarts=len(self.restarts),
                            stalls=sum(1 for s in self.stalls if s.stalled),
                            exit_codes={p.name: p.popen.returncode for p in procs})

    @property
    def metrics_ports(self) -> dict[str, int | None]:
        """Prometheus ports: ``launcher`` and ``server<i>`` (None: no endpoint)."""
        ports = {"launcher": self.observer.exporter.port}
        ports.update({p.name: p.metrics_port for p in self._all_servers()})
        return ports

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.workers + self._all_servers()]

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_cluster(spec: ClusterSpec, out_dir: str | Path,
                on_progress: Callable[[Progress], None] | None = None,
                on_alarm: Callable[[dict[str, Any]], None] | None = None,
                on_process: Callable[[ProcessInfo], None] | None = None,
                on_servers: Callable[[list[str]], None] | None = None) -> ClusterResult:
    """Start, run to completion, evaluate, stop. Returns the result, also written as
    ``result.json``.

    ``on_alarm`` gets each watchdog alarm (an ``alarm`` event of a shard's log) as
    it happens; ``on_process`` each process started (restarts included);
    ``on_servers`` the shards' addresses once they listen, as workers are given them.
    """
    from paramserver.workers.admin import server_stats, shutdown_servers
    from paramserver.workers.launch.elastic import Resharder

    out = Path(out_dir)
    t0 = time.time()
    with LocalCluster(spec, out, on_alarm=on_alarm, on_process=on_process) as cluster:
        cluster.start_servers()
        if on_servers is not None:
            on_servers(cluster.worker_addresses())
        moves = Resharder(cluster) if spec.reshard_at else None  # --reshard-at
        if moves is not None:
            moves.prepare()
            moves.start()
        cluster.start_workers()
        cluster.wait_workers(on_progress)
        if moves is not None:
            moves.finish()
        train_seconds = time.time() - t0
        admin = cluster.spec.admin_curve()
        addresses = cluster.primaries()  # (a backup may have taken over a shard)
        stats = server_stats(addresses, curve=admin)
        final, eval_of = final_figures(spec, addresses, out)  # saves the model, eval or not
        cluster.shutdown_backups()
        shutdown_servers(addresses, curve=admin)
    workers: list[WorkerResult | LostWorker] = []
    for rank in range(spec.num_workers):
        path = out / "results" / f"worker{rank}.json"
        if path.exists():
            workers.append(WorkerResult.read(path))
        else:  # a tolerated failure
            deaths = [f for f in cluster.failures if f.process == f"worker{rank}"]
            workers.append(LostWorker(rank, deaths[-1].exit_code, deaths[-1].reason)
                           if deaths else LostWorker(rank))
    result = ClusterResult(
        spec=spec.to_dict(),
        addresses=tuple(addresses),
        seconds=train_seconds,
        eval=final,
        workers=tuple(workers),
        servers=tuple(s.to_dict() for s in stats),
        updates_applied=tuple(s.version for s in stats),
        pushes_applied_shard0=sum(w.applied for w in stats[0].workers.values()) if stats else 0,
        failures=tuple(cluster.failures),
        restarts=tuple(cluster.restarts),
        alarms=tuple(cluster.observer.alarms),
        metrics_ports=cluster.metrics_ports,
        processes=tuple(cluster.processes),
        eval_of=eval_of,
        hosts=cluster.host_records(),
    )
    write_json(out / "result.json", result.to_json())
    return result
