"""Pulled weights into the model: from a reply's frames, or from a shard's
shared-memory weight board through the ticket the reply carries (paramserver/shm/link.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from paramserver.core.sharding import ShardPlan
from paramserver.shm.link import ShmLink
from paramserver.wire.messages import PullReply, replace
from paramserver.wire.protocol import Message
from paramserver.wire.transport import Channel

__all__ = ["land", "land_over_tcp", "ticket_bytes"]

log = logging.getLogger(__name__)


def land(plan: ShardPlan, channel: Channel[ShmLink], params: Mapping[str, torch.Tensor],
         rep: Message) -> bool:
    """Copy one shard's weights from its reply into ``params``. A reply through
    shared memory is a ticket to the shard's board: copied under its seqlock, the
    version read (never older than the ticket's) replaces the reply's. False:
    every copy was overlapped by a write; pull that shard over TCP."""
    body: PullReply = rep.body
    ticket = body.shm
    if ticket is None:
        plan.assemble_into(params, rep.tensors)
        return True
    link = channel.shm
    version = None if link is None else link.read(
        ticket, lambda tensors: plan.assemble_into(params, tensors), channel.limits)
    if version is None:
        return False
    rep.body = replace(body, version=version)
    return True


def land_over_tcp(plan: ShardPlan, params: Mapping[str, torch.Tensor],
                  replies: Sequence[Message], pulled: Sequence[Message]) -> None:
    """The weights of ``pulled`` (PULL replies over TCP, asked for because the board
    copies of ``replies`` kept being overwritten) into ``params``; each reply takes
    the version and clock it answered with."""
    log.info("%d shard(s): weight board copies kept being overwritten; pulled over TCP",
             len(pulled))
    for rep, got in zip(replies, pulled, strict=True):
        plan.assemble_into(params, got.tensors)
        fresh: PullReply = got.body
        rep.body = replace(rep.body, version=fresh.version, clock=fresh.clock, shm=None, lent=0)
        rep.tensors = got.tensors


def ticket_bytes(rep: Message) -> int:
    """The bytes of weights a reply lent through shared memory (0: none)."""
    body = rep.body
    return body.lent if isinstance(body, PullReply) else 0
