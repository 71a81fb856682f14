"""Overlap of communication with backward, measured on a synthetic model.

One sync shard server and one worker. The worker's model is an MLP whose
backward takes a measurable time; it times, per step (medians over repeats):

* ``compute``: forward + backward alone;
* ``comm``: push + pull of the same gradients alone (one ``push_pull``);
* ``sequential``: compute, then ``push_pull`` (what a worker does without overlap,
  already with the pull riding on the push);
* ``overlap``: the worker's ``overlap=True`` path: buckets pushed from
  post-accumulate-grad hooks during backward, the next weights prefetched
  with the last part (:class:`paramserver.workers.overlap.BucketPusher`).

With ``tcp`` the worker takes its weights over TCP even on the shard's host,
as a worker on another host does, and ``overlap_late`` is timed beside
``overlap``, interleaved: the same path without early weights (each bucket's
next weights come with the round's answer instead of with the bucket's).

The goal is ``overlap <= 1.15 x max(compute, comm)``. The same code runs on a
CUDA device (``device``): gradients then go through pinned host buffers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paramserver.core.sharding import ShardPlan
from paramserver.util.jsontypes import JSONObject
from paramserver.workers.client import PSClient
from paramserver.workers.overlap import BucketPusher
from paramserver.workers.stragglers import Straggler, StragglerSpec
from paramserver.workers.tasks import Task

from .common import Announce, Stats, flag, integer, strings, text
from .records import OverlapResult

__all__ = ["build_model", "run"]


@dataclass
class _State:
    clock: int
    versions: tuple[int, ...]

    def advance(self, versions: tuple[int, ...]) -> None:
        self.clock += 1
        self.versions = versions


def build_model(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_step(fn: Callable[[], None], steps: int, repeats: int, device: torch.device
                 ) -> Stats:
    fn()  # warm-up: allocations, connections, page faults
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / steps)
    return Stats.of(times)


def _paired(fns: dict[str, Callable[[], None]], steps: int, repeats: int,
            device: torch.device) -> dict[str, Stats]:
    """:func:`_median_step` of several ways of taking a step, interleaved repeat by
    repeat, so that a change in the machine's load falls on all of them."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / steps)
    return {name: Stats.of(t) for name, t in times.items()}


def run(args: JSONObject, announce: Announce) -> JSONObject:
    """``args``: addresses (one sync shard), width, depth, batch, steps, repeats,
    bucket_bytes, device ("cpu" or "cuda[:N]"), wire_dtype (optional), threads,
    tcp (optional: weights over TCP, and ``overlap_late`` timed too)."""
    device = torch.device(text(args, "device", "cpu"))
    if args.get("threads"):
        torch.set_num_threads(integer(args, "threads"))
    width, depth = integer(args, "width"), integer(args, "depth")
    batch = integer(args, "batch")
    steps, repeats = integer(args, "steps", 3), integer(args, "repeats", 5)
    addresses = strings(args, "addresses")
    wire_dtype = args.get("wire_dtype")
    model = build_model(width, depth).to(device)
    params = dict(model.named_parameters())
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, 1, device=device)
    loss_fn = nn.functional.mse_loss
    task = Task(model=model, batches=[(x, y)], loss_fn=loss_fn)
    plan = ShardPlan.from_module(model, len(addresses))
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    tcp = flag(args, "tcp", False)
    client = PSClient(addresses, plan, 0, timeout=300.0, request_timeout=120.0,
                      wire_dtype=wire_dtype if isinstance(wire_dtype, str) else None,
                      shm=not tcp)
    with client:
        clock = client.connect()
        client.initialize(params)
        pulled = client.pull(params, clock)
        state = _State(clock, pulled.versions)

        def compute() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()

        compute()
        grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}

        def comm() -> None:
            _, pulled = client.push_pull(grads, state.versions, batch, state.clock, params)
            state.advance(pulled.versions)

        def sequential() -> None:
            compute()
            g = {n: p.grad for n, p in params.items() if p.grad is not None}
            _, pulled = client.push_pull(g, state.versions, batch, state.clock, params)
            state.advance(pulled.versions)

        pusher = BucketPusher(model, integer(args, "bucket_bytes", 4 << 20))
        straggler = Straggler(StragglerSpec(), seed=(0, 0))

        def forever() -> Any:
            while True:
                yield (x, y)

        batches = forever()

        def overlapped(early: bool = True) -> None:
            model.zero_grad(set_to_none=True)
            step = pusher.step(client, task, model, batches, device, 1, state.versions,
                               state.clock, straggler, early=early)
            state.advance(step.pulled.versions)

        # the overlapped steps first: a push_pull's parts come back to back, and a
        # shard that found itself busy stepping ahead rests for some rounds after
        late: Stats | None = None
        if tcp:
            paired = _paired({"overlap": overlapped,
                              "overlap_late": lambda: overlapped(early=False)},
                             steps, repeats, device)
            over, late = paired["overlap"], paired["overlap_late"]
        else:
            over = _median_step(overlapped, steps, repeats, device)
        comp, com, seq = (_median_step(fn, steps, repeats, device)
                          for fn in (compute, comm, sequential))
        stats = client.stats()[0]
        counters, core = stats.counters, stats.figures
        pusher.close()
        client.bye()
    bound = max(comp.median, com.median)
    return OverlapResult(
        str(device), nbytes, sum(p.numel() for p in params.values()), width, depth, batch,
        overlap=over, compute=comp, comm=com, sequential=seq, tcp=tcp,
        rounds_ahead=core.rounds_ahead if core else 0,
        ahead_found_busy=core.ahead_found_busy if core else 0,
        # how many parts came back with their next weights, and rounds that used them
        early_parts=int(counters.get("early_parts", 0)),
        early_answers=int(counters.get("early_answers", 0)),
        buckets=len(pusher.buckets), overlap_vs_bound=over.median / bound,
        sequential_vs_bound=seq.median / bound, gain=seq.median / over.median,
        overlap_late=late, early_gain=None if late is None else late.median / over.median,
    ).to_json()
