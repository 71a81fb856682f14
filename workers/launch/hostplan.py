"""Which emulated host each process of ``launch --hosts W+S`` runs on, and at what rate.

A pure description (no namespaces are made here: :mod:`.netcluster` makes them,
the launcher starts processes on them). Hosts are numbered as the emulated cluster
numbers them, workers first: worker hosts ``0 .. W-1``, server hosts ``W .. W+S-1``.

* worker ``r`` runs on worker host ``r % W``;
* shard ``i``'s replica ``k`` (0: its first primary) on server host ``(i + k) % S``,
  so a shard's replicas sit on different hosts while there are hosts enough; with
  ``S = 0`` the shards run on the worker hosts instead, shard ``i`` on worker host
  ``(i + k) % W`` (as a job that puts a shard beside each worker: BytePS's
  colocated mode);
* every NIC runs at ``link`` both ways, host ``K`` at ``link_of[K]`` where given
  (a network straggler: the workers on that host push and pull slower).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from paramserver.errors import ConfigError
from paramserver.util.jsontypes import JSON, JSONObject
from paramserver.workers.launch.netcluster import MAX_HOSTS, EmulatedCluster, parse_rate

__all__ = ["DEFAULT_LINK", "HostPlan", "normalize_link_of", "parse_link_items"]

#: every host's NIC rate when --hosts is given without --link
DEFAULT_LINK = "1gbit"
_COUNTS = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")


def parse_link_items(items: Sequence[str]) -> dict[str, str]:
    """``["K=RATE"]`` (``--link-of 2=100mbit``) -> ``{"K": "RATE"}``, each rate checked."""
    out: dict[str, str] = {}
    for item in items:
        host, sep, rate = item.partition("=")
        if not sep or not host.strip().isdigit():
            raise ConfigError(f"--link-of {item!r} must look like HOST=RATE, e.g. 2=100mbit "
                              "(hosts are numbered workers first)")
        parse_rate(rate)
        out[str(int(host))] = rate.strip()
    return out


def normalize_link_of(value: object) -> dict[int, str]:
    """``link_of`` as a spec file or JSON gives it (``{"3": "100mbit"}``) -> ``{3: ...}``."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"link_of must be a table of HOST = RATE, e.g. {{3 = \"100mbit\"}}; "
                          f"got {value!r}")
    out: dict[int, str] = {}
    for host, rate in value.items():
        if isinstance(host, bool) or not str(host).strip().isdigit():
            raise ConfigError(f"link_of: {host!r} is not a host number (0, 1, ...)")
        out[int(host)] = str(rate)
    return out


@dataclass(frozen=True)
class HostPlan:
    """``W`` worker hosts and ``S`` server hosts, their NIC rates, and who runs where."""

    workers: int
    servers: int
    link: str = DEFAULT_LINK
    link_of: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        count = self.workers + self.servers
        if self.workers < 1 or self.servers < 0 or count > MAX_HOSTS:
            raise ConfigError(f"--hosts {self.workers}+{self.servers}: give W+S with at least "
                              f"one worker host and at most {MAX_HOSTS} hosts in all")
        parse_rate(self.link)
        for host, rate in self.link_of.items():
            if not 0 <= host < count:
                raise ConfigError(f"--link-of {host}={rate}: hosts are 0 .. {count - 1} "
                                  f"(worker hosts 0 .. {self.workers - 1} first, then the "
                                  f"server hosts)")
            parse_rate(rate)

    @classmethod
    def parse(cls, hosts: str, link: str | None = None,
              link_of: Mapping[int, str] | None = None) -> HostPlan:
        """``"4+2"`` (4 worker hosts, 2 server hosts) with the rates."""
        m = _COUNTS.match(hosts)
        if m is None:
            raise ConfigError(f"--hosts {hosts!r} must look like W+S, e.g. 4+4 (W worker "
                              "hosts, S server hosts; 4+0 puts the shards on the worker hosts)")
        return cls(int(m.group(1)), int(m.group(2)), link or DEFAULT_LINK, dict(link_of or {}))

    def check(self, num_workers: int, num_servers: int) -> None:
        """Refuse a host that would run nothing: more worker hosts than workers, more
        server hosts than shards."""
        if self.workers > num_workers:
            raise ConfigError(f"--hosts {self.workers}+{self.servers}: {self.workers} worker "
                              f"hosts for {num_workers} worker(s); give at most one host a "
                              f"worker")
        if self.servers > num_servers:
            raise ConfigError(f"--hosts {self.workers}+{self.servers}: {self.servers} server "
                              f"hosts for {num_servers} shard(s); give at most one host a "
                              f"shard (or 0: the shards on the worker hosts)")

    @property
    def count(self) -> int:
        return self.workers + self.servers

    def worker_host(self, rank: int) -> int:
        return rank % self.workers

    def server_host(self, shard: int, replica: int = 0) -> int:
        if self.servers:
            return self.workers + (shard + replica) % self.servers
        return (shard + replica) % self.workers

    def rate(self, host: int) -> str:
        return self.link_of.get(host, self.link)

    def describe(self) -> str:
        """``4+2 hosts at 400mbit (w3 at 100mbit)``: for a summary line or a report."""
        slow = ", ".join(f"{self.name(h)} at {r}" for h, r in sorted(self.link_of.items()))
        return (f"{self.workers}+{self.servers} hosts at {self.link}"
                + (f" ({slow})" if slow else ""))

    def name(self, host: int) -> str:
        """``w0`` .. for worker hosts, ``s0`` .. for server hosts (the cluster's names)."""
        return f"w{host}" if host < self.workers else f"s{host - self.workers}"

    def records(self, net: EmulatedCluster, workers: int, shards: int,
                replicas: int = 0) -> tuple[JSONObject, ...]:
        """Each host of ``net`` (made from this plan): its name, namespace, role,
        address, NIC rate and the processes this plan puts on it."""
        on: dict[int, list[JSON]] = {}
        for rank in range(workers):
            on.setdefault(self.worker_host(rank), []).append(f"worker{rank}")
        for shard in range(shards):
            for k in range(replicas + 1):
                on.setdefault(self.server_host(shard, k), []).append(
                    f"server{shard}" + (f"r{k}" if k else ""))
        return tuple({"host": h.index, "name": h.name, "namespace": h.ns, "role": h.role,
                      "address": h.ip, "rate": self.rate(h.index), "rate_bits": net.rate(h),
                      "processes": on.get(h.index, [])} for h in net.hosts)

    def to_json(self) -> JSONObject:
        return {"workers": self.workers, "servers": self.servers, "link": self.link,
                "link_of": {str(k): v for k, v in sorted(self.link_of.items())}}
