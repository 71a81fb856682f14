"""Who may do what on a shard server: the per-message access check under CURVE.

With CURVE each client key has a :class:`~paramserver.wire.curve.KeyGrant`
(from the allow-list, and ``admin`` for ``--admin-key`` keys). :class:`Access`
holds those grants and the binding of each worker id to the key whose HELLO
registered it, and :meth:`Access.check` refuses, before a message reaches the
core, a key acting for a worker id another key registered or outside its
allow-listed ranks, and a non-admin key running an administrative op
(SHUTDOWN, CHECKPOINT, RESHARD, BYE dead=true). Without CURVE no key is known and
every peer is trusted with everything.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire.curve import ANY_KEY, CurveKeys, KeyGrant, load_allow_list, public_key
from paramserver.wire.messages import Bye, Hello, Pull
from paramserver.wire.protocol import Message, Op
from paramserver.wire.transport import RouterSocket

if TYPE_CHECKING:
    from paramserver.server.config import ServerConfig

__all__ = ["ADMIN_OPS", "AS_WORKER", "Access", "admitted", "is_loopback", "load_grants",
           "open_socket"]

log = logging.getLogger(__name__)

#: administrative ops: under CURVE, for admin keys only (BYE dead=true too)
ADMIN_OPS = frozenset({Op.SHUTDOWN, Op.CHECKPOINT, Op.RESHARD})
#: ops that act as the worker id they name: under CURVE, for its registering key only
AS_WORKER = frozenset({Op.INIT, Op.PULL, Op.PUSH, Op.HEARTBEAT, Op.BYE, Op.SPULL, Op.SPUSH,
                       Op.SINIT})


def load_grants(curve_clients_dir: str | None, admin_keys: Iterable[str]) -> dict[str, KeyGrant]:
    """Each listed CURVE key's grant: the allow-list's, with admin added for
    ``admin_keys`` (which are admitted even when the list does not name them)."""
    # a bad list or key file is a TransportError, as an unreadable key was before
    grants = load_allow_list(curve_clients_dir) if curve_clients_dir else {}
    for key in (public_key(k) for k in admin_keys):
        grants[key] = dataclasses.replace(grants.get(key, ANY_KEY), admin=True)
    return grants


def admitted(grants: dict[str, KeyGrant] | None, replica_key: str | None
             ) -> dict[str, KeyGrant] | None:
    """The keys a shard's socket lets in (None: any): an allow-list's, plus with replicas
    the servers' own key, which the shard's other replicas connect with."""
    if grants is None or replica_key is None:
        return grants
    return {**grants, replica_key: ANY_KEY}


def is_loopback(address: str) -> bool:
    """Whether a bound address is reachable from this host only."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


class Access:
    """The grants of a shard's CURVE keys (None: no CURVE, everyone is trusted) and
    which key registered each worker id."""

    def __init__(self, grants: dict[str, KeyGrant] | None) -> None:
        self.grants = grants
        # worker id -> the public key whose HELLO registered it; only that key may act
        # as the worker (bounded with the core's worker table, see forget)
        self.owners: dict[int, str] = {}

    @property
    def has_admin(self) -> bool:
        return self.grants is not None and any(g.admin for g in self.grants.values())

    def may_stop(self, key: str | None) -> bool:
        """Whether figures ``key`` claims (a push's training loss) may stop the shard under
        --on-divergence: without CURVE everyone is trusted; under it, as SHUTDOWN, only an
        admin key. Any key's claims still raise alarms."""
        if self.grants is None:
            return True
        return key is not None and self.grants.get(key, ANY_KEY).admin

    def check(self, msg: Message, key: str | None) -> None:
        """Under CURVE, refuse (``forbidden``) a key acting for a worker id another key
        registered, or outside its allow-listed ranks, and a non-admin key running
        SHUTDOWN, CHECKPOINT or BYE dead=true. Without CURVE everyone is trusted."""
        if self.grants is None:
            return
        if key is None:  # every CURVE message passes the ZAP handler, which names its key
            raise ProtocolError(ErrorCode.FORBIDDEN, "the message carries no CURVE key")
        grant = self.grants.get(key, ANY_KEY)
        body = msg.body
        if msg.op in ADMIN_OPS or (isinstance(body, Bye) and body.dead):
            if not grant.admin:
                what = "BYE dead=true" if msg.op is Op.BYE else msg.op.value.upper()
                raise ProtocolError(ErrorCode.FORBIDDEN,
                                    f"{what} needs an admin key; key {key} is not one")
            return
        if isinstance(body, Hello):
            if body.role != "worker":
                return  # an observer acts for no worker
        elif msg.op not in AS_WORKER or (isinstance(body, Pull) and body.observer):
            return
        worker: int = body.worker
        if grant.ranks is not None and worker not in grant.ranks:
            raise ProtocolError(ErrorCode.FORBIDDEN, f"key {key} may act as worker(s) "
                                f"{sorted(grant.ranks)} only, not {worker}")
        owner = self.owners.get(worker)
        if owner is None and msg.op is not Op.HELLO:
            # e.g. a worker restored from a checkpoint: it says HELLO again first
            raise ProtocolError(ErrorCode.NOT_REGISTERED,
                                f"worker {worker} has not said HELLO to this shard with its key")
        if owner is not None and owner != key:
            raise ProtocolError(ErrorCode.FORBIDDEN, f"worker {worker} was registered by "
                                f"another key; key {key} may not act for it")

    def handled(self, msg: Message, key: str | None) -> None:
        """``msg`` was handled without error: a worker's HELLO binds its id to ``key``."""
        body = msg.body
        if key is not None and isinstance(body, Hello) and body.role == "worker":
            self.owners[body.worker] = key  # registered: the id is this key's now

    def forget(self, known: Collection[int]) -> None:
        """Unbind worker ids the core no longer knows: a key may register them anew."""
        for worker in [w for w in self.owners if w not in known]:
            del self.owners[worker]


def open_socket(config: ServerConfig, access: Access) -> RouterSocket:
    """The shard's socket, bound: under CURVE with its secret key, admitting the
    allow-listed keys (and, with replicas, its own), their grants put in ``access``."""
    curve = CurveKeys.load(config.curve_secret_key) if config.curve_secret_key else None
    if curve is not None:
        access.grants = load_grants(config.curve_clients_dir, config.admin_keys)
        if not access.has_admin:
            log.warning("shard %d: no admin key (--admin-key): SHUTDOWN, CHECKPOINT and "
                        "BYE dead=true are refused; stop the shard with SIGTERM", config.shard)
    socket = RouterSocket(config.bind, curve=curve, allowed_clients=admitted(
        access.grants if config.curve_clients_dir else None,
        curve.public_text if curve is not None and config.replicas else None))
    if curve is None and not is_loopback(socket.address):
        log.warning("shard %d binds %s without CURVE: anyone who reaches this port is "
                    "trusted with every operation, SHUTDOWN included (docs/reliability.md)",
                    config.shard, socket.address)
    return socket
