"""Roles and server addresses for runs started by torchrun or Slurm.

We run no scheduler of our own. The launcher people already use starts one
process per rank; this module reads that launcher's environment, maps the rank
to a role, and exchanges server addresses through torch.distributed's
``TCPStore``:

* ranks ``0 .. S-1`` are servers: rank ``i`` is shard ``i`` of ``S``;
* ranks ``S .. W-1`` are workers: rank ``r`` is worker ``r - S`` of ``W - S``.

With ``--replicas R`` the first ``S x (1 + R)`` ranks are servers, and which shard and
replica each one is depends on the nodes they run on (placement.py: a shard's
replicas on different nodes where there are several).

The store is the one torch itself would use: at ``MASTER_ADDR:MASTER_PORT``,
hosted by torchrun's agent where it offers one (``TORCHELASTIC_USE_AGENT_STORE``)
and otherwise by rank 0. Under Slurm, rank 0 hosts it on the first node of the
step's node list. Keys (all under ``paramserver/``):

``server/<i>``
    the address shard ``i`` listens on; set by the server once bound, waited
    for by every worker (a timeout names the server ranks still missing).
``node/<k>`` (``--replicas``)
    the node server rank ``k`` runs on; every server rank waits for all of them and
    places itself (placement.py).
``replica/<i>/<k>`` (``--replicas``)
    the address backup ``k`` of shard ``i`` listens on; the shard's primary waits for
    them before it serves, and publishes ``server/<i>`` as its replicas' addresses
    joined by ``|``, itself first (what workers are given).
``done``
    a counter every worker increments when it stops training, successfully or
    not; the worker whose increment reaches the number of workers sets
    ``finished``.
``finished``
    each server waits for this key and then stops as if it got SIGTERM. So the
    servers of a run end when the last worker ends, and the launcher sees
    every rank exit. The store is not authenticated: under CURVE a server takes
    this key only as a hint, and stops once every worker has said BYE to it (over
    its key) or died; a worker trusts the ``server/<i>`` addresses only as far as
    the CURVE handshake with the server key it holds, and the shard number the
    server then gives, confirm them.
``left`` and ``left/<rank>``
    every process checks out before it exits; the process that hosts the
    store (rank 0) waits, for a bounded time, until all have, so no rank loses
    the store while it still needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from torch.distributed import DistError, DistNetworkError, DistStoreError, TCPStore

from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, ParamServerError, TransportError
from paramserver.server.config import ServerConfig
from paramserver.server.entry import run_server
from paramserver.server.process import Ready
from paramserver.wire.curve import CurveKeys
from paramserver.workers.admin import save_final_model
from paramserver.workers.failover import SEPARATOR, join_replicas
from paramserver.workers.launch.placement import Placement, place_replicas
from paramserver.workers.optimizer import read_plan
from paramserver.workers.worker import (
    WorkerConfig,
    WorkerResult,
    build_task,
    run_worker,
    worker_title,
)

__all__ = [
    "LaunchEnv",
    "Rendezvous",
    "RendezvousError",
    "Role",
    "assign_role",
    "default_host",
    "detect_launcher",
    "expand_nodelist",
    "launch_env",
    "local_address_for",
    "run_command_rank",
    "run_server_rank",
    "run_worker_rank",
    "slurm_hostnames",
]

log = logging.getLogger(__name__)

PREFIX = "paramserver"
LAUNCHERS = ("torchrun", "slurm")
DEFAULT_SLURM_STORE_PORT = 29500


class RendezvousError(TransportError):
    """The store could not be reached, or a rank never published what others wait for."""


# --------------------------------------------------------------------------- environment


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process: who it is and where the store lives."""

    launcher: str  # "torchrun" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    store_host: str
    store_port: int
    single_node: bool
    agent_store: bool = False  # torchrun's agent hosts the store, not rank 0
    #: torchrun's restart of the whole group (TORCHELASTIC_RESTART_COUNT): its agent's
    #: store outlives a restart, so each attempt's keys are its own (as torch's own)
    attempt: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"{self.launcher}: rank {self.rank} is not in [0, {self.world_size})"
            )
        if not 0 < self.store_port < 65536:
            raise ConfigError(f"{self.launcher}: store port {self.store_port} is not in 1..65535")

    @property
    def hosts_store(self) -> bool:
        return self.rank == 0 and not self.agent_store

    @property
    def store(self) -> str:
        return f"{self.store_host}:{self.store_port}"


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS")


def detect_launcher(environ: Mapping[str, str]) -> str | None:
    """``torchrun`` (also ``srun torchrun ...``), ``slurm`` or None."""
    if all(environ.get(v) for v in _TORCHRUN_VARS):
        return "torchrun"
    if all(environ.get(v) for v in _SLURM_VARS):
        return "slurm"
    return None


def _int(environ: Mapping[str, str], var: str, default: int | None = None) -> int:
    text = environ.get(var)
    if text is None or text == "":
        if default is None:
            raise ConfigError(f"environment variable {var} is not set")
        return default
    try:
        return int(text)
    except ValueError as exc:
        raise ConfigError(f"environment variable {var}={text!r} is not an integer") from exc


def _from_torchrun(environ: Mapping[str, str]) -> LaunchEnv:
    world = _int(environ, "WORLD_SIZE")
    return LaunchEnv(
        launcher="torchrun",
        rank=_int(environ, "RANK"),
        world_size=world,
        local_rank=_int(environ, "LOCAL_RANK", 0),
        store_host=environ["MASTER_ADDR"],
        store_port=_int(environ, "MASTER_PORT"),
        single_node=_int(environ, "LOCAL_WORLD_SIZE", world) == world,
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        attempt=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
    )


def _from_slurm(environ: Mapping[str, str], store_host: str | None,
                store_port: int | None) -> LaunchEnv:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
        or environ.get("SLURM_NODELIST")
    hosts = slurm_hostnames(nodelist) if nodelist else []
    host = store_host or environ.get("MASTER_ADDR") or (hosts[0] if hosts else None)
    if not host:
        raise ConfigError(
            "slurm: cannot tell where rank 0 runs: SLURM_JOB_NODELIST is not set "
            "(give --store-host or MASTER_ADDR)"
        )
    if store_port is None:
        # two jobs sharing a node must not pick the same port: derive it from the job id
        store_port = _int(environ, "MASTER_PORT",
                          DEFAULT_SLURM_STORE_PORT + _int(environ, "SLURM_JOB_ID", 0) % 1000)
    nodes = _int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_NNODES", len(hosts) or 1))
    return LaunchEnv(
        launcher="slurm",
        rank=_int(environ, "SLURM_PROCID"),
        world_size=_int(environ, "SLURM_NTASKS"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        store_host=host,
        store_port=store_port,
        single_node=nodes <= 1,
    )


def launch_env(environ: Mapping[str, str] | None = None, launcher: str = "auto", *,
               store_host: str | None = None, store_port: int | None = None) -> LaunchEnv:
    """Read rank, world size and the store's address from torchrun's or Slurm's variables.

    ``store_host``/``store_port`` override the store address (Slurm only: under
    torchrun the store is where torchrun says).
    """
    env = os.environ if environ is None else environ
    if launcher == "auto":
        found = detect_launcher(env)
        if found is None:
            raise ConfigError(
                "no launcher environment found: `paramserver run` expects to be started by "
                "torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or by srun "
                "(SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST). To start a cluster on "
                "this machine, use `paramserver launch`."
            )
        launcher = found
    if launcher == "torchrun":
        missing = [v for v in _TORCHRUN_VARS if not env.get(v)]
        if missing:
            raise ConfigError(f"torchrun: environment variable(s) {', '.join(missing)} not set")
        return _from_torchrun(env)
    if launcher == "slurm":
        missing = [v for v in _SLURM_VARS if not env.get(v)]
        if missing:
            raise ConfigError(f"slurm: environment variable(s) {', '.join(missing)} not set")
        return _from_slurm(env, store_host, store_port)
    raise ConfigError(f"launcher must be auto, {' or '.join(LAUNCHERS)}; got {launcher!r}")


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        return [name]
    head, tail = name[: m.start()], name[m.end():]
    out: list[str] = []
    for item in m.group(1).split(","):
        r = _RANGE.match(item.strip())
        if r is None:
            raise ConfigError(f"node list entry {name!r}: cannot read range {item!r}")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"node list entry {name!r}: range {item!r} runs backwards")
        width = len(lo)
        for n in range(int(lo), int(hi) + 1):
            out.extend(head + str(n).zfill(width) + rest for rest in _expand_one(tail))
    return out


def expand_nodelist(text: str) -> list[str]:
    """Expand Slurm's compressed host list: ``node[01-03],gpu7`` -> node01 node02 node03 gpu7.

    Handles comma lists inside brackets (``n[1,4-5]``), zero padding and
    several bracket groups in one name (``r[1-2]n[1-2]``).
    """
    return [host for part in _split_top(text) for host in _expand_one(part)]


def slurm_hostnames(text: str) -> list[str]:
    """``scontrol show hostnames`` where Slurm is installed, else :func:`expand_nodelist`."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", text], check=True,
                                 capture_output=True, text=True, timeout=30).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError) as exc:
            log.debug("scontrol show hostnames failed (%s); parsing the list myself", exc)
    return expand_nodelist(text)


def local_address_for(host: str, port: int = 9) -> str:
    """The IP of this machine's interface that routes to ``host`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((target, port))
            return str(sock.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            f"cannot find this host's address on the route to {host}: {exc}; give --host"
        ) from exc


def default_host(env: LaunchEnv) -> str:
    """Where a server binds by default: loopback on one node, else the interface that
    reaches the store's host (which every rank can reach too)."""
    return "127.0.0.1" if env.single_node else local_address_for(env.store_host, env.store_port)


# --------------------------------------------------------------------------- roles


@dataclass(frozen=True)
class Role:
    """``server`` ``index`` of ``num_servers``, or ``worker`` ``index`` of ``num_workers``."""

    kind: str
    index: int  # a server's: its rank among the server ranks (its shard without replicas)
    num_servers: int
    num_workers: int
    replicas: int = 0  # backups per shard

    @property
    def server_ranks(self) -> int:
        return self.num_servers * (1 + self.replicas)

    def describe(self) -> str:
        if self.kind == "server" and self.replicas:
            return (f"server rank {self.index} of {self.server_ranks} ({self.num_servers} "
                    f"shard(s) x {1 + self.replicas} replicas)")
        if self.kind == "server":
            return f"server (shard {self.index} of {self.num_servers})"
        return f"worker {self.index} of {self.num_workers}"


def assign_role(rank: int, world_size: int, num_servers: int, replicas: int = 0) -> Role:
    """The first ``num_servers x (1 + replicas)`` ranks are servers, the rest workers."""
    if num_servers < 1:
        raise ConfigError(f"--num-servers must be >= 1, got {num_servers}")
    servers = num_servers * (1 + replicas)
    if world_size <= servers:
        held = f"{num_servers} server(s)" + (f" x {1 + replicas} replicas" if replicas else "")
        raise ConfigError(
            f"{world_size} processes cannot hold {held} and at least one worker: start more "
            f"processes (e.g. torchrun --nproc-per-node) or lower --num-servers"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in [0, {world_size})")
    num_workers = world_size - servers
    if rank < servers:
        return Role("server", rank, num_servers, num_workers, replicas)
    return Role("worker", rank - servers, num_servers, num_workers, replicas)


# --------------------------------------------------------------------------- the store


class Rendezvous:
    """This process's handle on the run's TCPStore."""

    def __init__(self, env: LaunchEnv, timeout: float = 300.0) -> None:
        self.env = env
        self.timeout = timeout
        self.prefix = PREFIX if not env.attempt else f"{PREFIX}/attempt{env.attempt}"
        try:
            self.store = TCPStore(
                env.store_host, env.store_port, None, env.hosts_store,
                timedelta(seconds=timeout), wait_for_workers=False,
                multi_tenant=env.hosts_store,
            )
        except (DistError, RuntimeError, OSError) as exc:
            where = "host it" if env.hosts_store else "reach it"
            host = "rank 0" if not env.agent_store else "torchrun's agent on the first node"
            raise RendezvousError(
                f"rank {env.rank} could not {where}: the rendezvous store at {env.store} "
                f"(hosted by {host}) within {timeout:g}s: {exc}"
            ) from exc
        try:
            self.store.add(self._key("joined"), 1)  # the store's host waits for these to check out
        except DistError as exc:
            raise RendezvousError(f"rank {env.rank}: the rendezvous store at {env.store} "
                                  f"went away: {exc}") from exc

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *(str(p) for p in parts)])

    # servers ------------------------------------------------------------------

    def publish_server(self, shard: int, address: str) -> None:
        self.store.set(self._key("server", shard), address)

    def replaces(self, role: Role) -> bool:
        """With replicas: whether this server rank started before in this run (its node
        is in the store), so that this process is started in place of a dead one. It
        then counts as the dead one, which joined the store but never left."""
        if not self.store.check([self._key("node", role.index)]):
            return False
        self.store.add(self._key("joined"), -1)
        return True

    def place(self, role: Role, node: str, replacement: bool = False) -> Placement:
        """With replicas: publish this server rank's node, wait for every server rank's,
        and return this rank's shard and replica (the same rule on every rank). A
        replacement keeps the dead rank's node, so it is the same shard and replica."""
        if not replacement:
            self.store.set(self._key("node", role.index), node)
        keys = [self._key("node", k) for k in range(role.server_ranks)]
        self._wait(keys, "server rank(s) {} published no node")
        nodes = [self.store.get(k).decode() for k in keys]
        return place_replicas(nodes, role.num_servers, role.replicas)[role.index]

    def shard_replicas(self, shard: int) -> list[str]:
        """Shard ``shard``'s replicas' addresses, by replica index, as its first primary
        published them (``server/<shard>``)."""
        self._wait([self._key("server", shard)], "shard {} published no address")
        return self.store.get(self._key("server", shard)).decode().split(SEPARATOR)

    def publish_replica(self, shard: int, replica: int, address: str) -> None:
        self.store.set(self._key("replica", shard, replica), address)

    def wait_replicas(self, shard: int, replicas: int) -> list[str]:
        """The addresses of shard ``shard``'s backups 1 .. ``replicas``, once all listen."""
        keys = [self._key("replica", shard, k) for k in range(1, replicas + 1)]
        self._wait(keys, f"backup(s) {{}} of shard {shard} published no address")
        return [self.store.get(k).decode() for k in keys]

    def _wait(self, keys: list[str], missing: str) -> None:
        """Wait for ``keys``; the timeout's error names the missing ones (their last part
        fills ``missing``'s ``{}``)."""
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except DistStoreError as exc:
            gone = ", ".join(k.rsplit("/", 1)[1] for k in keys if not self.store.check([k]))
            raise RendezvousError(f"rendezvous incomplete after {self.timeout:g}s: "
                                  f"{missing.format(gone)} to the store at {self.env.store}; "
                                  "are all ranks started, with the same --num-servers and "
                                  "--replicas?") from exc
        except DistError as exc:
            raise RendezvousError(f"lost the rendezvous store at {self.env.store}: {exc}") \
                from exc

    def wait_finished(self, stop: threading.Event, poll: float = 5.0) -> bool:
        """Block until the last worker is done (True), ``stop`` is set or the store is gone.

        Meant for a background thread: it waits on a connection of its own, so the
        main thread's use of the store never queues behind it.
        """
        try:
            store = TCPStore(self.env.store_host, self.env.store_port, None, False,
                             timedelta(seconds=self.timeout))
        except DistError as exc:
            log.warning("lost the rendezvous store at %s (%s); stopping", self.env.store, exc)
            return False
        while not stop.is_set():
            try:
                store.wait([self._key("finished")], timedelta(seconds=poll))
                return True
            except DistStoreError:
                continue  # not yet
            except (DistNetworkError, RuntimeError) as exc:
                log.warning("lost the rendezvous store at %s (%s); stopping", self.env.store, exc)
                return False
        return False

    # workers ------------------------------------------------------------------

    def wait_servers(self, num_servers: int, timeout: float | None = None) -> list[str]:
        """The address of every shard, once all are published; the timeout names the missing."""
        wait = self.timeout if timeout is None else timeout
        keys = [self._key("server", i) for i in range(num_servers)]
        try:
            self.store.wait(keys, timedelta(seconds=wait))
        except DistStoreError as exc:
            missing = [i for i, k in enumerate(keys) if not self.store.check([k])]
            ranks = ", ".join(str(i) for i in missing)
            raise RendezvousError(
                f"rendezvous incomplete after {wait:g}s: server rank(s) {ranks} (of "
                f"{num_servers}) published no address to the store at {self.env.store}. Are "
                f"all {self.env.world_size} ranks started, with the same --num-servers? Did "
                f"those servers fail to bind (see their output)?"
            ) from exc
        except DistError as exc:
            raise RendezvousError(f"lost the rendezvous store at {self.env.store}: {exc}") \
                from exc
        return [self.store.get(k).decode() for k in keys]

    def worker_done(self, num_workers: int,
                    before_finish: Callable[[], None] | None = None) -> bool:
        """Count this worker as done; True if it was the last one (then servers stop,
        after ``before_finish``: the last chance to reach them)."""
        count = self.store.add(self._key("done"), 1)
        if count >= num_workers:
            try:
                if before_finish is not None:
                    before_finish()
            finally:
                self.store.set(self._key("finished"), "1")
            return True
        return False

    # everyone -----------------------------------------------------------------

    def leave(self, timeout: float = 30.0) -> None:
        """Check out; the store's host waits (up to ``timeout``) until every rank that
        joined has (a rank that never came is not waited for)."""
        world = self.env.world_size
        try:
            self.store.set(self._key("left", self.env.rank), "1")
            if self.store.add(self._key("left"), 1) >= self.store.add(self._key("joined"), 0):
                self.store.set(self._key("all_left"), "1")
            if self.env.hosts_store:
                try:
                    self.store.wait([self._key("all_left")], timedelta(seconds=timeout))
                except DistError:
                    missing = [r for r in range(world)
                               if not self.store.check([self._key("left", r)])]
                    log.warning("closing the rendezvous store although rank(s) %s did not "
                                "check out within %gs", ", ".join(map(str, missing)), timeout)
        except DistError as exc:
            log.debug("rank %d: store gone while leaving (%s)", self.env.rank, exc)


# --------------------------------------------------------------------------- running a rank


def run_server_rank(config: ServerConfig, rdzv: Rendezvous,
                    on_ready: Callable[[Ready], None] | None = None) -> int:
    """Serve one shard: publish its address, stop when the last worker is done.

    The store's ``finished`` (or losing the store) only tells the shard the job is
    over: under CURVE anyone who reaches the store can set it, so a CURVE shard stops
    once its own authenticated records agree (every worker said BYE or died; see
    ``ShardServer._job_over``), and serves on otherwise.

    Returns :func:`~paramserver.server.entry.run_server`'s exit code."""
    stopping = threading.Event()
    job_done = threading.Event()

    def watch() -> None:
        rdzv.wait_finished(stopping)  # the last worker is done, or the store is gone
        if not stopping.is_set():
            log.info("shard %d: the rendezvous store says every worker is done", config.shard)
            job_done.set()

    peers: list[str] = []
    if config.replicas and config.replica == 0 and not config.replacement:
        # the first primary: its backups listen first
        peers = rdzv.wait_replicas(config.shard, config.replicas)
        config = dataclasses.replace(config, replica_peers=peers)

    def ready(listening: Ready) -> None:
        address = listening.address
        if config.replacement:
            pass  # at the dead replica's address, which the store holds already
        elif config.replica:
            rdzv.publish_replica(config.shard, config.replica, address)
        else:  # workers are given the shard's replicas, the primary first
            rdzv.publish_server(config.shard, join_replicas([address, *peers]))
        threading.Thread(target=watch, name="rendezvous-watch", daemon=True).start()
        if on_ready is not None:
            on_ready(listening)

    try:
        return run_server(config, ready, job_done)
    finally:
        stopping.set()
        rdzv.leave()


def run_worker_rank(config: WorkerConfig, rdzv: Rendezvous, num_servers: int,
                    timeout: float | None = None, out: Path | None = None) -> WorkerResult:
    """Wait for every server's address, train, and count this worker done, even when it
    fails, so that the servers never wait for a worker that is gone. The last worker
    done saves the servers' final weights as ``out/final_model.safetensors``."""
    addresses: list[str] = []
    try:
        addresses = rdzv.wait_servers(num_servers, timeout)
        worker_title(config)
        return run_worker(dataclasses.replace(config, servers=addresses))
    finally:
        _done(rdzv, config.rank, config.world_size, addresses, out,
              lambda: ShardPlan.from_module(build_task(config).model, num_servers,
                                            config.chunk_bytes),
              CurveKeys.load(config.curve_key, config.curve_server_key)
              if config.curve_key else None)


def run_command_rank(command: list[str], rdzv: Rendezvous, num_servers: int, rank: int,
                     world_size: int, local_rank: int, out: Path | None = None,
                     timeout: float | None = None,
                     extra_env: Mapping[str, str] | None = None) -> int:
    """Run the user's ``command`` as worker ``rank`` (its script builds a
    DistributedOptimizer from the environment set here, ``extra_env`` included: the
    launcher's worker options); returns its exit code."""
    addresses: list[str] = []
    try:
        addresses = rdzv.wait_servers(num_servers, timeout)
        env = {**os.environ, "PARAMSERVER_SERVERS": ",".join(addresses), "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank), **(extra_env or {})}
        if out is not None:  # without one there is no final model, so no plan either
            env.update(PARAMSERVER_EVENT_LOG=str(out / "events" / f"worker{rank}.jsonl"),
                       PARAMSERVER_RESULT_FILE=str(out / "results" / f"worker{rank}.json"),
                       PARAMSERVER_PLAN_FILE=str(out / "plan.json"))
        try:
            return subprocess.run(command, env=env, check=False).returncode
        except OSError as exc:
            raise ConfigError(f"cannot run {' '.join(command)!r}: {exc.strerror or exc}") \
                from None
    finally:
        _done(rdzv, rank, world_size, addresses, out,
              lambda: read_plan(out / "plan.json") if out is not None else None, None)


def _done(rdzv: Rendezvous, rank: int, world_size: int, addresses: list[str],
          out: Path | None, plan: Callable[[], ShardPlan | None],
          curve: CurveKeys | None) -> None:
    def save() -> None:
        # every other worker is done: the servers' weights are the final ones
        if out is None or not addresses:
            return
        try:
            the_plan = plan()
            if the_plan is not None:
                path = save_final_model(addresses, the_plan, out / "final_model.safetensors",
                                        curve=curve)
                log.info("worker %d: the servers' final weights are in %s", rank, path)
        except ParamServerError as exc:
            log.warning("worker %d: could not save the final model: %s", rank, exc)

    try:
        rdzv.worker_done(world_size, before_finish=save)
    except DistError as exc:
        log.warning("worker %d: could not report done to the store: %s", rank, exc)
    finally:
        rdzv.leave()
