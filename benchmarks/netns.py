"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

A process started with ``ip netns exec NS ...`` sees only its namespace's
interfaces: namespace A holds one end of the pair (``10.x.y.1``), namespace B
the other (``10.x.y.2``), each with its own loopback. Traffic between them
crosses the kernel's veth driver and the whole TCP stack, as between hosts
(without a physical wire). Creating namespaces needs root and iproute2; the
names carry a random tag so that runs (and tests) side by side do not clash,
and :func:`two_namespaces` deletes both, with every process still inside them,
however its block ends (an error, Ctrl-C or SIGTERM included). Hosts on a bridge,
with NIC rates: :mod:`paramserver.workers.launch.netcluster`, whose helpers this
module shares.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from paramserver.workers.launch.netcluster import (
    NetnsUnavailable,
    kill_namespace,
    netns_problem,
    term_unwinds,
)
from paramserver.workers.launch.netcluster import existing_namespaces as existing

__all__ = ["Link", "NetnsUnavailable", "exec_prefix", "existing", "netns_problem",
           "two_namespaces"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """The two namespaces and the addresses of the veth ends inside them."""

    ns_a: str
    ip_a: str
    ns_b: str
    ip_b: str


def exec_prefix(ns: str) -> list[str]:
    """The command prefix that runs a program inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_namespaces() -> Iterator[Link]:
    """Two fresh namespaces joined by a veth pair, deleted on the way out.

    Raises :class:`NetnsUnavailable` (after cleaning up) when a step fails.
    """
    problem = netns_problem()
    if problem:
        raise NetnsUnavailable(problem)
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"psbenchA{tag}", f"psbenchB{tag}"
    va, vb = f"pbA{tag}", f"pbB{tag}"  # interface names: at most 15 characters
    net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    link = Link(ns_a, f"{net}.1", ns_b, f"{net}.2")
    steps = [
        ("netns", "add", ns_a), ("netns", "add", ns_b),
        ("link", "add", va, "type", "veth", "peer", "name", vb),
        ("link", "set", va, "netns", ns_a), ("link", "set", vb, "netns", ns_b),
        ("-n", ns_a, "addr", "add", f"{link.ip_a}/24", "dev", va),
        ("-n", ns_b, "addr", "add", f"{link.ip_b}/24", "dev", vb),
        *[("-n", ns, "link", "set", dev, "up")
          for ns, dev in ((ns_a, va), (ns_b, vb), (ns_a, "lo"), (ns_b, "lo"))],
    ]
    with term_unwinds():
        try:
            for step in steps:
                done = _ip(*step)
                if done.returncode != 0:
                    raise NetnsUnavailable(f"cannot set up network namespaces here: ip "
                                           f"{' '.join(step)}: {done.stderr.strip()}")
            log.info("namespaces %s (%s) and %s (%s) over veth", ns_a, link.ip_a, ns_b,
                     link.ip_b)
            yield link
        finally:
            # deleting a namespace deletes the veth end in it, and with it the peer
            for ns in (ns_a, ns_b):
                kill_namespace(ns)
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _ip("link", "del", va)  # only there if setup stopped before moving it
