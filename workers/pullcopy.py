"""A worker's side of compressed pulls (DoubleSqueeze; the shard's side is
paramserver/core/pullsqueeze.py): its copy of each shard's slices, which every
compressed answer moves on by the change it carries, decoded and bounded here.

A shard that compresses pulls says so at HELLO (``squeeze``). From then on every
pull to it names ``base``, the answers this copy holds (-1: none yet), and its
answer is either a whole copy (the shard's reconstruction for this worker, or the
weights for a worker it never saw: the copy starts again from it) or the change
since ``base``, in one of paramserver/compress/formats.py's formats. The
change is decoded against the plan's slices with every bound checked, as a shard
checks a compressed push, and added to the copy with the same float additions the
shard made to its own reconstruction; the copy then goes into the model. So the
model holds exactly what the shard believes it holds, whatever the worker did to
its weights in between (local steps included).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from paramserver.core.records import SliceSpec
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.wire.compressed import expand
from paramserver.wire.messages import PullReply
from paramserver.wire.protocol import Message

__all__ = ["PullCopies"]


class PullCopies:
    """Per shard: whether it compresses pulls, this worker's copy of its slices and
    the count of answers in that copy."""

    def __init__(self, plan: ShardPlan) -> None:
        self.plan = plan
        n = plan.num_shards
        self.on = [False] * n
        self.held: list[dict[str, torch.Tensor] | None] = [None] * n
        self.counts = [0] * n
        self.specs = [{s.key: SliceSpec(s.key, s.numel, s.dtype) for s in plan.shard_slices(i)}
                      for i in range(n)]

    def enable(self, shard: int, on: bool) -> None:
        """What ``shard`` said at HELLO (a shard restarted may say otherwise)."""
        self.on[shard] = on

    def base(self, shard: int) -> int | None:
        """The ``base`` a pull to ``shard`` names (None: it does not compress pulls)."""
        if not self.on[shard]:
            return None
        return -1 if self.held[shard] is None else self.counts[shard]

    def based(self, fields: Mapping[str, Any], shard: int) -> dict[str, Any]:
        """A pull's ``fields`` to ``shard``, with its ``base`` if it compresses pulls."""
        base = self.base(shard)
        return dict(fields) if base is None else {**fields, "base": base}

    def land(self, params: Mapping[str, torch.Tensor], shard: int, rep: Message) -> None:
        """A compressed pull's answer from ``shard`` into the copy, then ``params``;
        ProtocolError (and the copy as it was) for one that does not fit it."""
        body: PullReply = rep.body
        count = body.squeeze
        assert count is not None
        specs = self.specs[shard]
        got = expand(rep.tensors, specs)  # (each part's bounds checked: wire/compressed.py)
        held = self.held[shard]
        # a change to the answer it holds, or (empty, the count kept) nothing moved since
        still = body.delta and held is not None and count == self.counts[shard] and not got
        if got.keys() != specs.keys() and not still:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"shard {shard}'s compressed pull answer "
                                f"holds {len(got)} of its {len(specs)} slices")
        if body.delta and not still:
            if held is None or count != self.counts[shard] + 1:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"shard {shard} sent the change to "
                                    f"answer {count - 1}; this worker holds "
                                    f"{self.counts[shard] if held is not None else 'none'}")
            for key, change in got.items():
                held[key].add_(change)  # (the shard's own addition, to the bit)
        elif not body.delta:
            held = self.held[shard] = {k: t.reshape(-1).clone() for k, t in got.items()}
        assert held is not None
        self.counts[shard] = count
        with torch.no_grad():
            self.plan.assemble_into(params, held)
