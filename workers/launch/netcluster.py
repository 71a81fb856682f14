"""A cluster on one machine: hosts as network namespaces on one Linux bridge.

Each host is a network namespace holding one end of a veth pair (its NIC, with
the host's address) and its own loopback; the other end of every pair is a port
of one bridge in the initial namespace. A process started with
:meth:`EmulatedCluster.exec_prefix` sees only its host's interfaces, and its
traffic to another host crosses the whole TCP stack, two veth pairs and the
bridge, as between machines on one switch.

Each host's NIC has a rate of its own, both ways, with ``tc ... tbf`` (netem is
not needed): what leaves the host is shaped on the veth end inside its
namespace, what reaches it on the bridge's end (that end's egress). A host can
be cut off (its bridge port goes down: every packet to or from it is dropped,
connections stall as on a pulled cable) and restored, and its rate changed while
processes run.

Hosts are numbered workers first: with W worker and S server hosts, hosts
``0 .. W-1`` are the workers' and ``W .. W+S-1`` the servers'. The addresses
(``10.x.y.1`` up, one /24 per cluster) exist only inside the namespaces: the
bridge has no address, so nothing in the initial namespace routes to them.
With ``reach=True`` the bridge itself gets an address too (``10.x.y.254``): the
initial namespace (a launcher that asks its shards for statistics, the final
weights, to stop) then reaches every host, across that host's shaped NIC. Still
nothing beyond this machine does: a host's namespace has no route but its /24,
so it cannot answer a peer outside the cluster.
Names carry a random tag, so clusters side by side do not clash, and
:func:`emulated_cluster` removes everything it made (the processes still in its
namespaces killed, the namespaces, veths and bridge deleted) however its block
ends: an error, Ctrl-C, or SIGTERM (turned into ``SystemExit`` while the block
runs in the main thread). Making namespaces needs root and iproute2
(:func:`netns_problem` says why not, for a skip).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Literal

from paramserver.errors import ConfigError, ParamServerError

__all__ = ["NIC", "EmulatedCluster", "Host", "NetnsUnavailable", "emulated_cluster",
           "existing_links", "existing_namespaces", "kill_namespace", "netns_problem",
           "parse_rate", "tc_problem", "term_unwinds"]

log = logging.getLogger(__name__)

#: every host's NIC, inside its namespace (e.g. for GLOO_SOCKET_IFNAME)
NIC = "eth0"
#: most hosts in one cluster (one /24, the bridge's ports)
MAX_HOSTS = 200
#: the last byte of the bridge's own address (``reach=True``), above every host's
_BRIDGE_HOST = 254
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)?\s*$", re.IGNORECASE)


class NetnsUnavailable(ParamServerError):
    """The namespaces could not be set up here (a benchmark part or test is skipped)."""


def netns_problem() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def tc_problem() -> str | None:
    """Why NIC rates cannot be shaped here (no ``tc``), or None."""
    return None if shutil.which("tc") else "the `tc` command (iproute2) is not installed"


def parse_rate(text: str) -> int:
    """A NIC rate as ``tc`` writes it (``400mbit``, ``1gbit``, ``2.5gbit``) -> bits/s.

    Raises :class:`ConfigError` with a one-line reason for anything else.
    """
    m = _RATE.match(text)
    if m is None:
        raise ConfigError(f"rate {text!r}: give a number and a unit among "
                          f"{', '.join(_UNITS)}, e.g. 400mbit or 1gbit")
    bits = round(float(m.group(1)) * _UNITS[(m.group(2) or "bit").lower()])
    if bits < 8000:
        raise ConfigError(f"rate {text!r}: at least 8kbit")
    return bits


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def existing_namespaces() -> set[str]:
    """Names of the network namespaces that exist now."""
    out = _ip("netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def existing_links() -> set[str]:
    """Names of the interfaces of the initial namespace (veths, bridges) that exist now."""
    out = _ip("-o", "link", "show").stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.count(":") >= 2}


def kill_namespace(ns: str) -> None:
    """Kill what still runs in ``ns`` (SIGKILL), then delete it; never raises."""
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        for pid in _ip("netns", "pids", ns).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        done = _ip("netns", "del", ns)
        if done.returncode != 0 and "No such file" not in done.stderr:
            log.warning("could not delete network namespace %s: %s", ns, done.stderr.strip())


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def term_unwinds() -> Iterator[None]:
    """SIGTERM unwinds the stack (SystemExit) instead of ending the process on the spot,
    so that ``finally`` blocks delete what was made (main thread only: Python runs
    signal handlers there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: a shaped NIC's token bucket: BURST_SECONDS at the rate, at least BURST_FLOOR bytes (a
#: GSO segment passes whole): enough for the kernel's timer, small beside a round's
#: megabytes (the planner's simulator models the same bucket: launch/simtiming.py)
BURST_FLOOR = 64 << 10
BURST_SECONDS = 0.004


def _burst_bytes(bits: int) -> int:
    return max(BURST_FLOOR, int(bits // 8 * BURST_SECONDS))


def _tbf(bits: int) -> list[str]:
    # the queue holds 100 ms at the rate before it drops (TCP backs off, as at a NIC)
    return ["tbf", "rate", f"{bits}bit", "burst", str(_burst_bytes(bits)), "latency", "100ms"]


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, its NIC's two ends and its address."""

    index: int
    role: Literal["worker", "server"]
    ns: str
    ip: str
    nic: str  # the veth end inside ``ns``: :data:`NIC` on every host, as on machines
    port: str  # its peer: the bridge's port, in the initial namespace

    @property
    def name(self) -> str:
        """``w0``, ``w1``, ... for worker hosts, ``s0``, ... for server hosts."""
        return self.ns.rsplit("-", 1)[1]


HostRef = int | str | Host


class EmulatedCluster:
    """The hosts of a running :func:`emulated_cluster` and what can be done to their links."""

    def __init__(self, tag: str, bridge: str, hosts: Sequence[Host],
                 rates: Mapping[int, int], reach_address: str | None = None) -> None:
        self.tag, self.bridge = tag, bridge
        #: the initial namespace's address on the bridge (``reach=True``), else None
        self.reach_address = reach_address
        self.hosts: tuple[Host, ...] = tuple(hosts)
        self.workers = tuple(h for h in hosts if h.role == "worker")
        self.servers = tuple(h for h in hosts if h.role == "server")
        self._rates = dict(rates)
        self._cut: set[int] = set()
        self._procs: list[subprocess.Popen[bytes]] = []

    def host(self, ref: HostRef) -> Host:
        """A host by index (workers first), by name (``w1``, ``s0``) or itself."""
        if isinstance(ref, Host):
            return ref
        if isinstance(ref, int) and 0 <= ref < len(self.hosts):
            return self.hosts[ref]
        for h in self.hosts:
            if h.name == ref:
                return h
        raise KeyError(f"no host {ref!r}: hosts are 0..{len(self.hosts) - 1} or "
                       f"{', '.join(h.name for h in self.hosts)}")

    def exec_prefix(self, ref: HostRef) -> list[str]:
        """The command prefix that runs a program on host ``ref``."""
        return ["ip", "netns", "exec", self.host(ref).ns]

    def address(self, ref: HostRef) -> str:
        """Host ``ref``'s address, reachable from every other host of the cluster."""
        return self.host(ref).ip

    def rate(self, ref: HostRef) -> int:
        """Host ``ref``'s NIC rate in bits/s (each way)."""
        return self._rates[self.host(ref).index]

    def is_cut(self, ref: HostRef) -> bool:
        return self.host(ref).index in self._cut

    def set_rate(self, ref: HostRef, rate: str | int) -> None:
        """Change host ``ref``'s NIC rate, both ways, while its processes run."""
        h = self.host(ref)
        bits = parse_rate(rate) if isinstance(rate, str) else rate
        _run_steps([("tc", "-n", h.ns, "qdisc", "change", "dev", h.nic, "root", *_tbf(bits)),
                    ("tc", "qdisc", "change", "dev", h.port, "root", *_tbf(bits))])
        self._rates[h.index] = bits

    def cut(self, ref: HostRef) -> None:
        """Cut host ``ref`` off: its bridge port goes down, every packet to or from it
        is dropped (its address and open connections stay, as on a pulled cable)."""
        h = self.host(ref)
        _run_steps([("ip", "link", "set", h.port, "down")])
        self._cut.add(h.index)

    def restore(self, ref: HostRef) -> None:
        """Plug host ``ref`` back in (stalled connections resume as TCP retransmits)."""
        h = self.host(ref)
        _run_steps([("ip", "link", "set", h.port, "up")])
        self._cut.discard(h.index)

    def popen(self, ref: HostRef, argv: Sequence[str],
              **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` on host ``ref`` (``subprocess.Popen``'s keywords apply); it is
        stopped when the cluster closes, if it still runs then."""
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            [*self.exec_prefix(ref), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def _stop_processes(self) -> None:
        """SIGTERM what :meth:`popen` started, a grace, then SIGKILL; reap them all."""
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.terminate()
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    p.kill()
                p.wait()


def _run_steps(steps: Sequence[Sequence[str]]) -> None:
    for step in steps:
        done = subprocess.run(list(step), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise NetnsUnavailable(f"cannot set up the emulated cluster here: "
                                   f"{' '.join(step)}: {done.stderr.strip()}")


def _resolve_rates(count: int, rate: str | int, rates: Mapping[int, str | int]
                   ) -> dict[int, int]:
    default = parse_rate(rate) if isinstance(rate, str) else rate
    bad = sorted(k for k in rates if not 0 <= k < count)
    if bad:
        raise ConfigError(f"a rate for host {bad[0]}: hosts are 0..{count - 1} "
                          "(workers first, then servers)")
    return {i: (parse_rate(r) if isinstance(r, str) else r)
            for i, r in ((i, rates.get(i, default)) for i in range(count))}


@contextlib.contextmanager
def emulated_cluster(workers: int, servers: int = 0, rate: str | int = "1gbit",
                     rates: Mapping[int, str | int] | None = None, reach: bool = False
                     ) -> Iterator[EmulatedCluster]:
    """``workers`` + ``servers`` hosts on one bridge, every NIC at ``rate`` (a ``tc``
    rate such as ``400mbit``, or bits/s) both ways, host ``k`` at ``rates[k]`` where
    given; all of it deleted on the way out. ``reach``: this namespace reaches the
    hosts' addresses too (through the bridge's own address).

    Raises :class:`ConfigError` for bad counts or rates (before making anything) and
    :class:`NetnsUnavailable` (after cleaning up) where a step fails.
    """
    count = workers + servers
    if workers < 0 or servers < 0 or not 1 <= count <= MAX_HOSTS:
        raise ConfigError(f"an emulated cluster has 1 to {MAX_HOSTS} hosts; got "
                          f"{workers} worker and {servers} server hosts")
    bits = _resolve_rates(count, rate, rates or {})
    problem = netns_problem() or tc_problem()
    if problem:
        raise NetnsUnavailable(problem)
    tag = uuid.uuid4().hex[:6]
    net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    bridge = f"pcb{tag}"  # interface names: at most 15 characters
    hosts = [Host(i, "worker" if i < workers else "server",
                  f"pscl{tag}-{'w' if i < workers else 's'}{i if i < workers else i - workers}",
                  f"{net}.{i + 1}", NIC, f"pco{tag}x{i}") for i in range(count)]
    made_ns: list[str] = []
    made_links: list[str] = []
    cluster = EmulatedCluster(tag, bridge, hosts, bits,
                              f"{net}.{_BRIDGE_HOST}" if reach else None)
    with term_unwinds():
        try:
            # a bridge without STP: a port forwards the moment it is up (also on restore)
            _run_steps([("ip", "link", "add", bridge, "type", "bridge", "stp_state", "0",
                         "forward_delay", "0")])
            made_links.append(bridge)
            for h in hosts:
                _run_steps([("ip", "netns", "add", h.ns)])
                made_ns.append(h.ns)
                temp = f"pci{tag}x{h.index}"  # its name until it is in the namespace
                _run_steps([("ip", "link", "add", temp, "type", "veth", "peer", "name",
                             h.port)])
                made_links.append(temp)
                _run_steps([
                    ("ip", "link", "set", temp, "netns", h.ns),
                    ("ip", "-n", h.ns, "link", "set", temp, "name", h.nic),
                    ("ip", "link", "set", h.port, "master", bridge),
                    ("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", h.nic),
                    ("ip", "-n", h.ns, "link", "set", "lo", "up"),
                    ("ip", "-n", h.ns, "link", "set", h.nic, "up"),
                    ("ip", "link", "set", h.port, "up"),
                    # out of the host: its own end; into it: the bridge's end
                    ("tc", "-n", h.ns, "qdisc", "add", "dev", h.nic, "root", *_tbf(bits[h.index])),
                    ("tc", "qdisc", "add", "dev", h.port, "root", *_tbf(bits[h.index])),
                ])
            if cluster.reach_address:
                _run_steps([("ip", "addr", "add", f"{cluster.reach_address}/24", "dev",
                             bridge)])
            _run_steps([("ip", "link", "set", bridge, "up")])
            log.info("emulated cluster %s: %d worker and %d server hosts on %s.0/24", tag,
                     workers, servers, net)
            yield cluster
        finally:
            cluster._stop_processes()
            # a veth pair goes with either end: deleted from here, at once (a deleted
            # namespace takes its end with it, but later, in the kernel's own time)
            for h in hosts[:len(made_ns)]:
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    _ip("link", "del", h.port)
            for ns in made_ns:
                kill_namespace(ns)
            for name in reversed(made_links):  # a veth not yet moved, and the bridge
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    _ip("link", "del", name)
