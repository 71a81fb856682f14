"""A worker of tests/test_reshard_live_e2e.py: PSClient on a small model of several
slices, with gradients that depend on its rank, its step and the weights, so that a
sync run's result is a function of every round's sum. Argv: RANK SERVERS(comma)
MODE STEPS OUT [big]. STEPS: that many rounds, or ``+K``: until it saw two moves of the
plan, then K more. Sync: gradients of the weights; async: each push a gradient of 1
on ``count``. It writes how many pushes the shards acknowledged, the sum of the
weights ``count``'s shard gave them (a staleness policy's), and its weights."""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.workers.client import PSClient


def plan(num_shards: int, big: bool = False) -> ShardPlan:
    """w cut in 16 slices spread over the shards: 16 KiB, or (``big``) 256 KiB, each
    shard's share then large enough for shared memory (paramserver/shm/link.py)."""
    n = 65536 if big else 4096
    return ShardPlan([ParamSpec("w", (n,), "float32"), ParamSpec("count", (8,), "float32"),
                      ParamSpec("b", (300,), "float32")], num_shards, chunk_bytes=n // 4)


def initial(big: bool = False) -> dict[str, torch.Tensor]:
    n = 65536 if big else 4096
    return {"w": torch.linspace(-1, 1, n), "count": torch.zeros(8),
            "b": torch.linspace(0, 0.5, 300)}


def main() -> None:
    rank, servers, mode, out = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[5]
    after_moves = sys.argv[4].startswith("+")
    steps = int(sys.argv[4].lstrip("+"))
    big = sys.argv[6:] == ["big"]
    params = initial(big)
    client = PSClient(servers, plan(len(servers), big), worker=rank, heartbeat_interval=0.5,
                      timeout=120)
    clock = client.connect()
    client.initialize(params)
    versions = client.pull(params, clock, wait_init=True).versions
    acked = done = refused = rounds = 0
    weighted = 0.0
    while client.moves < 2 or done < steps if after_moves else done < steps:
        if mode == "sync":
            grads = {k: torch.sin(v * (rank + 1) + rounds) for k, v in params.items()}
        else:
            grads = {k: torch.zeros_like(v) for k, v in params.items()}
            grads["count"] += 1.0
        pushed, pulled = client.push_pull(grads, versions, 1, clock, params)
        acked += 1  # every shard answered it (policy none: each takes every push)
        # (a push sent again after a move that its shards took before: a duplicate)
        refused += sum(1 for o in pushed.outcomes if not o.accepted and not o.duplicate)
        on_count = pushed.outcomes[client.plan.slices_of("count")[0].shard]
        weighted += on_count.weight if on_count.accepted and not on_count.duplicate else 0.0
        clock = max(clock + 1, pulled.clock)
        versions = pulled.versions
        rounds += 1
        done += 1 if not after_moves or client.moves >= 2 else 0
    save_file({k: v.contiguous() for k, v in params.items()}, f"{out}.safetensors")
    with open(f"{out}.json", "w") as f:
        json.dump({"acked": acked, "refused": refused, "weighted": weighted, "rounds": rounds,
                   "moves": client.moves, "epoch": client.epoch,
                   "servers": client.addresses}, f)
    client.bye()
    client.close()


if __name__ == "__main__":
    main()
