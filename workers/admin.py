"""Requests to shard servers outside a training session: STATS, SHUTDOWN, the
final weights, a worker's reported death. Each opens fresh channels, asks, and
closes them; none registers as a worker (the final weights are pulled as an
observer)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from paramserver.core.sharding import DTYPES, ShardPlan
from paramserver.errors import RemoteError, TransportError
from paramserver.wire.curve import CurveKeys
from paramserver.wire.protocol import Message, Op
from paramserver.wire.retry import Retry
from paramserver.wire.stats import ShardStats
from paramserver.wire.transport import Channel, SideChannel, request_all

from .client import PSClient

__all__ = ["pull_weights", "report_dead", "save_final_model", "server_stats", "shutdown_servers"]

log = logging.getLogger(__name__)


def pull_weights(addresses: Sequence[str], plan: ShardPlan, timeout: float = 60.0,
                 curve: CurveKeys | None = None) -> dict[str, torch.Tensor]:
    """The servers' current weights of every parameter of ``plan``, as an observer
    (no clock, never gated): what a launcher saves as the final model. Sparse
    tables are included whole, as ``<module>.weight`` (nn.Embedding's name)."""
    params = {p.name: torch.zeros(p.shape, dtype=DTYPES[p.dtype]) for p in plan.params}
    with PSClient(addresses, plan, worker=0, role="observer", heartbeat_interval=0,
                  timeout=timeout, curve=curve) as client:
        client.connect()
        client.pull(params)
        if plan.sparse:  # each table under its parameter's name, read in parts of rows
            from paramserver.workers.embedding import pull_tables
            params.update(pull_tables(client, plan.sparse))
    return params


def save_final_model(addresses: Sequence[str], plan: ShardPlan, path: str | Path,
                     timeout: float = 60.0, curve: CurveKeys | None = None) -> Path:
    """``pull_weights`` saved as safetensors (a state_dict of the parameters)."""
    from safetensors.torch import save_file

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    weights = pull_weights(addresses, plan, timeout, curve)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(target))
    return target


def shutdown_servers(addresses: Sequence[str], timeout: float = 10.0,
                     curve: CurveKeys | None = None) -> list[str]:
    """Ask each server to stop; returns the addresses that did not answer."""
    failed = []
    for i, addr in enumerate(addresses):
        ch: Channel[SideChannel] = Channel(addr, peer=f"shard {i}", curve=curve)
        try:
            ch.request(Message(Op.SHUTDOWN), timeout)
        except (TransportError, RemoteError) as exc:
            log.warning("shard %d at %s: %s", i, addr, exc)
            failed.append(addr)
        finally:
            ch.close()
    return failed


def _ask_all(addresses: Sequence[str], make: Callable[[], Message], timeout: float,
             curve: CurveKeys | None, retries: int = 0) -> list[Message]:
    """One request to every server on fresh channels, without registering; the replies."""
    chans: list[Channel[SideChannel]] = [Channel(a, peer=f"shard {i}", curve=curve)
                                         for i, a in enumerate(addresses)]
    try:
        msgs = [make() for _ in chans]
        replies = request_all(chans, msgs, Retry(timeout, retries),
                              msgs[0].op.value.upper() if msgs else None)
        return replies
    finally:
        for ch in chans:
            ch.close()


def server_stats(addresses: Sequence[str], timeout: float = 10.0,
                 curve: CurveKeys | None = None) -> list[ShardStats]:
    """STATS from each server, without registering (for status tools): each reply
    decoded once, at the wire (wire/stats.py)."""
    return [r.body for r in _ask_all(addresses, lambda: Message(Op.STATS), timeout, curve)]


def report_dead(addresses: Sequence[str], worker: int, timeout: float = 2.0,
                curve: CurveKeys | None = None) -> None:
    """Tell every server that ``worker``'s process died (a supervisor saw it exit), so
    that no sync round or SSP gate waits out its heartbeat timeout."""
    _ask_all(addresses, lambda: Message(Op.BYE, 0, {"worker": worker, "dead": True}),
             timeout, curve, retries=1)
