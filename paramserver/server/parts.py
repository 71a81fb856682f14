"""Pushes sent in parts, on the server's side of the core.

A large push may come as several PUSH messages, each holding some of the
shard's keys. A sync shard without a rewriting policy adds each part into its
round as it arrives (:attr:`~paramserver.core.shard.ShardCore.streams_parts`); the
server then only tallies what the answer needs of the earlier parts
(:class:`StreamedParts`). Any other shard takes pushes whole: the server keeps
the parts' frames as they arrived, within a byte budget, and hands the core the
joined push once its last part is in (:class:`JoinedParts`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

import torch

from paramserver.core.shard import ShardCore
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire.messages import Push, replace
from paramserver.wire.protocol import Message, Op

__all__ = ["JoinedParts", "StreamedParts"]


class JoinedParts:
    """Pushes in parts for a shard that takes them whole, until their last part is in."""

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        # worker -> (push id, {part: asked for the pull}, tensors so far)
        self.pending: dict[int, tuple[int, dict[int, bool], dict[str, torch.Tensor]]] = {}
        self.nbytes = 0  # held in pending, over every worker
        self.budget = 0  # set with the plan: what the expected workers need at once

    def join(self, core: ShardCore, msg: Message) -> Message | None:
        """Collect a push sent in parts; the whole push once its last part is in.

        The parts' frames are kept as they arrived (no copy) until then; a
        worker has at most one push in the making, a newer push id drops an
        unfinished older one. A part of a push the core already decided is
        passed through: the core answers it as the duplicate it is.
        """
        b: Push = msg.body
        worker, push_id, part, parts = b.worker, b.push_id, b.part, b.parts
        # every part has a key of the shard's, so a push has at most that many parts
        # (0 <= part < parts held at the wire, wire/messages.py)
        most = max(1, len(core.specs))
        if parts > most:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"push part {part} of {parts}: need "
                                f"0 <= part < parts <= {most} (the shard's slices)")
        # held only for a registered, live worker, within its push id window: nothing
        # is kept for a peer that never said HELLO
        state = core.check_push_id(worker, push_id)
        if push_id <= state.last_push_id:
            return msg
        entry = self.pending.get(worker)
        if entry is None or entry[0] != push_id:
            self.drop(worker)
            entry = (push_id, {}, {})
        _, received, tensors = entry
        if part in received:
            return None  # sent again after a lost reply
        # each key of the shard at most once, with its slice's shape and dtype: one
        # worker holds at most its share of a push
        core.check_part(msg.tensors, seen=tensors.keys())
        nbytes = msg.nbytes
        if self.nbytes + nbytes > self.budget:
            self.counters["parts_over_budget"] += 1
            raise ProtocolError(ErrorCode.BUSY, f"pushes in parts hold {self.nbytes} "
                                f"bytes of {self.budget}: retry later")
        self.pending[worker] = entry
        self.nbytes += nbytes
        received[part] = b.pull
        tensors.update(msg.tensors)
        if len(received) < parts:
            return None
        self.drop(worker)
        whole = replace(b, part=0, parts=1, pull=any(received.values()))
        return Message(Op.PUSH, msg.seq, msg.fields, tensors, None, whole)

    def drop(self, worker: int) -> None:
        """Give up ``worker``'s unfinished push (it left, died or restarted)."""
        entry = self.pending.pop(worker, None)
        if entry is not None:
            self.nbytes -= sum(t.numel() * t.element_size() for t in entry[2].values())

    def forget(self, known: Collection[int]) -> None:
        for worker in [w for w in self.pending if w not in known]:
            self.drop(worker)


class StreamedParts:
    """What the answer to a streamed push needs of its earlier parts: whether any
    part asked for the pull, and the bytes of all of them."""

    def __init__(self) -> None:
        # worker -> (push id, a part asked for the pull, bytes so far)
        self.pending: dict[int, tuple[int, bool, int]] = {}
        # worker -> (push id, version, keys): next weights that went back with parts
        # of its push before the round closed (StepAhead.ready)
        self.early: dict[int, tuple[int, int, frozenset[str]]] = {}

    def sent_early(self, msg: Message, version: int, keys: Collection[str]) -> None:
        """The answer to this part of ``msg``'s push carried the next weights of
        ``keys``, those the round makes at ``version`` if it commits ahead."""
        b: Push = msg.body
        worker, push_id = b.worker, b.push_id
        prior = self.early.get(worker)
        if prior is None or prior[0] != push_id or prior[1] != version:
            prior = (push_id, version, frozenset())
        self.early[worker] = (push_id, version, prior[2] | frozenset(keys))

    def sent(self, msg: Message, version: int) -> frozenset[str]:
        """The keys whose next weights at ``version`` went back with ``msg``'s push's
        parts so far."""
        b: Push = msg.body
        prior = self.early.get(b.worker)
        if prior is None or prior[0] != b.push_id or prior[1] != version:
            return frozenset()
        return prior[2]

    def early_of(self, msg: Message) -> tuple[int, frozenset[str]] | None:
        """(version, keys) that went back early with ``msg``'s push's parts; forgotten."""
        b: Push = msg.body
        prior = self.early.pop(b.worker, None)
        if prior is None or prior[0] != b.push_id:
            return None
        return prior[1], prior[2]

    def tally(self, msg: Message, last: bool) -> tuple[bool, int]:
        """Count one part of ``msg``'s push in; (pull asked, bytes) of its parts so far.
        The tally is kept until the ``last`` part."""
        b: Push = msg.body
        key = (b.push_id, b.pull, msg.nbytes)
        prior = self.pending.get(b.worker)
        if prior is not None and prior[0] == key[0]:
            key = (key[0], key[1] or prior[1], key[2] + prior[2])
        if last:
            self.pending.pop(b.worker, None)
        else:
            self.pending[b.worker] = key
        return key[1], key[2]

    def drop(self, worker: int) -> None:
        self.pending.pop(worker, None)
        self.early.pop(worker, None)

    def forget(self, known: Collection[int]) -> None:
        for worker in [w for w in self.pending if w not in known]:
            del self.pending[worker]
        for worker in [w for w in self.early if w not in known]:
            del self.early[worker]
