"""Whether a replica whose connection is down is dead, or only out of reach (issue 32).

A primary whose backup's connection has been down for the failover timeout may go on
without it only if the backup is dead: a backup that lives behind a partition takes
over after the same silence, and a primary that went on alone would accept writes
beside it (split brain). The two look alike from the primary's side but for one
sign: a host that lives answers a connection to a port nobody listens on with a
refusal, at once. A refusal is what a dead process leaves (the launcher's kill, a
crash); a timeout or an unreachable network is what a partition, or a dead host,
leaves, and the primary then keeps waiting (answering no worker) until the link
comes back and it learns whether it was replaced.
"""

from __future__ import annotations

import socket

__all__ = ["refused"]


def refused(address: str, timeout: float) -> bool:
    """Whether a TCP connection to ``address`` (``tcp://host:port``) is refused within
    ``timeout`` seconds: the host is up and nothing listens there. False for any other
    outcome (connected, timed out, unreachable, a name that does not resolve, or an
    address that is not TCP)."""
    if not address.startswith("tcp://"):
        return False
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
