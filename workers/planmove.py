"""A client's side of a live reshard (issue 47, item 2): the plan's epoch, learned as a
new primary is (failover.py), without restarting.

A shard that was moved answers a request of the old plan ``plan_moved``, with the
new plan's epoch and servers (server/elastic.py). :func:`follow_moves` catches it
around one request (a push, a pull, a BYE): the client closes its channels and
heartbeat, opens those of the new plan (the same parameters, cut by the same
``chunk_bytes``, on the new number of shards: core/reshard.py's rule), says HELLO
there (the shards know the worker: its record moved with the state, incarnation
and clock included) and sends the request again, built anew for the new plan.

A push goes again with its push id: a move happens at a cut where no shard took
it, or every shard did (the admin aligned them), and the push-id windows moved with
the state, so a shard that took it counts it once (a duplicate). Read versions
move too: every shard of a cut holds one version, so the push's is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from paramserver.core.sharding import ShardPlan
from paramserver.errors import ConfigError, PlanMovedError

if TYPE_CHECKING:
    from paramserver.workers.client import PSClient

__all__ = ["MAX_MOVES", "follow_moves", "move_client", "resend_on"]

log = logging.getLogger(__name__)

#: moves one request follows before it gives up (each is a whole reshard)
MAX_MOVES = 8

T = TypeVar("T")


def moved_plan(plan: ShardPlan, num_shards: int) -> ShardPlan:
    """``plan`` on ``num_shards`` shards (its slices do not depend on the count)."""
    return ShardPlan(plan.params, num_shards, plan.chunk_bytes, plan.split, plan.sparse)


def move_client(client: PSClient, moved: PlanMovedError) -> bool:
    """Point ``client`` at the plan ``moved`` names and say HELLO there; False when it
    is there already (an answer of an older move)."""
    if moved.epoch <= client.epoch:
        return False
    if client.failover is not None:
        raise ConfigError("a live reshard of replicated shards is not supported")
    servers = list(moved.servers)
    log.warning("worker %d: the plan moved to %d shard(s) (epoch %d): %s", client.worker,
                len(servers), moved.epoch, ", ".join(servers))
    client.close()  # the old plan's channels and heartbeat; _open makes the new plan's
    client._open(servers, moved_plan(client.plan, len(servers)))
    client.epoch = moved.epoch
    client.moves += 1
    client.connect()  # (an observer's HELLO says so: it registers nothing)
    return True


def follow_moves(client: PSClient, send: Callable[[Sequence[int]], T],
                 read_versions: Sequence[int] = ()) -> T:
    """``send(read_versions)``, sent again on the new plan each time the shards answer
    that the plan moved (at most MAX_MOVES times), with its push id."""
    push_id = client._push_id
    # a compressed push is encoded anew for the new plan: from the residuals it began
    # with, or what it left out would be added twice (the shards took none of it, or
    # every one did: the same push again)
    mark = client.encoder.mark() if client.encoder is not None else None
    for _ in range(MAX_MOVES):
        try:
            return send(read_versions)
        except PlanMovedError as moved:
            read_versions = resend_on(client, moved, push_id, mark, read_versions)
    raise ConfigError(f"worker {client.worker}: the plan moved {MAX_MOVES} times during "
                      "one request")


def resend_on(client: PSClient, moved: PlanMovedError, push_id: int, mark: Any,
              read_versions: Sequence[int]) -> list[int]:
    """After ``moved``: ``client`` on the new plan, its push id and its encoder (``mark``,
    None: none) back where the request began, so that it goes again as it went first;
    returns the read versions to send it with (one at a cut: every shard's)."""
    move_client(client, moved)
    client._push_id = push_id  # the same push again, with its id
    if mark is not None and client.encoder is not None:
        client.encoder.rewind(mark)
    return [min(read_versions)] * client.plan.num_shards if read_versions else []
