"""A few-minute check of a worker on a CUDA device: pinned buffers, device copies, overlap.

    python -m paramserver.benchmarks.gpu_check                 # on cuda (the default device)
    python -m paramserver.benchmarks.gpu_check --device cpu    # the same code path on the CPU

It starts one sync shard server (a real process) and, in this process:

1. measures device-to-host bandwidth of a 64 MiB gradient into pageable and
   into pinned memory (pinned: only on CUDA);
2. checks one push + pull from a model on the device: the weights that come
   back equal ``w - lr * g`` computed on the device, with gradients sent as
   they are and in bfloat16 (through the client's pinned staging buffers);
3. times compute, communication, the sequential step and the overlapped step
   (buckets pushed from backward hooks, next pull prefetched) as
   :mod:`paramserver.benchmarks.overlap` does.

It prints a table and writes the figures as JSON (``--out``). The test suite
runs it on the CPU with ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from paramserver.util.jsontypes import JSONObject
from paramserver.workers.admin import shutdown_servers
from paramserver.workers.client import PSClient

from . import overlap
from .common import Agent, close_all, text
from .ps import flat_plan
from .records import OverlapResult

__all__ = ["CopyBandwidth", "GpuCheck", "RoundTrip", "check_round_trip", "copy_bandwidth",
           "main", "run_check"]


@dataclass(frozen=True)
class CopyBandwidth:
    """GB/s of device-to-host copies into pageable and (on CUDA) pinned host memory."""

    bytes: int
    pageable_gbps: float
    pinned_gbps: float | None = None  # CUDA only

    def to_json(self) -> JSONObject:
        out: JSONObject = {"bytes": self.bytes, "pageable_gbps": self.pageable_gbps}
        if self.pinned_gbps is not None:
            out["pinned_gbps"] = self.pinned_gbps
        return out


@dataclass(frozen=True)
class RoundTrip:
    """One push + pull of a device tensor, and whether the weights came back exact."""

    wire_dtype: str
    device: str
    max_abs_error: float
    ok: bool

    def to_json(self) -> JSONObject:
        return {"wire_dtype": self.wire_dtype, "device": self.device,
                "max_abs_error": self.max_abs_error, "ok": self.ok}


@dataclass(frozen=True)
class GpuCheck:
    """The check's JSON file (``--out``)."""

    device: str
    torch: str
    device_name: str | None  # CUDA only
    copy: CopyBandwidth
    round_trip: tuple[RoundTrip, ...]
    overlap: OverlapResult

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.round_trip)

    def to_json(self) -> JSONObject:
        out: JSONObject = {"device": self.device, "torch": self.torch}
        if self.device_name is not None:
            out["device_name"] = self.device_name
        out.update({"copy": self.copy.to_json(),
                    "round_trip": [r.to_json() for r in self.round_trip],
                    "overlap": self.overlap.to_json(), "ok": self.ok})
        return out


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> CopyBandwidth:
    """GB/s of device-to-host copies into pageable and (on CUDA) pinned host memory."""
    src = torch.randn(nbytes // 4, device=device)
    gbps: dict[str, float] = {}
    targets = {"pageable": torch.empty(nbytes // 4)}
    if device.type == "cuda":
        targets["pinned"] = torch.empty(nbytes // 4, pin_memory=True)
    for name, dst in targets.items():
        dst.copy_(src, non_blocking=name == "pinned")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=name == "pinned")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        gbps[name] = nbytes * repeats / (time.perf_counter() - t0) / 1e9
    return CopyBandwidth(nbytes, gbps["pageable"], gbps.get("pinned"))


def check_round_trip(addresses: list[str], device: torch.device, numel: int, lr: float,
                     wire_dtype: str | None) -> RoundTrip:
    """One push + pull of a device tensor; the result must be ``w - lr * g`` exactly
    (with ``wire_dtype``: with ``g`` rounded to it, as the wire carries it)."""
    plan = flat_plan(numel, len(addresses))
    torch.manual_seed(1)
    w = torch.randn(numel, device=device)
    g = torch.randn(numel, device=device)
    params = {"w": w.clone()}
    with PSClient(addresses, plan, 0, timeout=120.0, wire_dtype=wire_dtype) as client:
        clock = client.connect()
        client.initialize(params)
        pulled = client.pull(params, clock)
        _, pulled = client.push_pull({"w": g}, pulled.versions, 1, clock, params)
        client.bye()
    sent = g.to(getattr(torch, wire_dtype)).float() if wire_dtype else g
    expected = w.clone().add_(sent, alpha=-lr)  # what torch.optim.SGD computes
    got = params["w"]
    err = float((got - expected).abs().max())
    return RoundTrip(wire_dtype or "float32", str(got.device), err,
                     err <= 1e-6 * max(1.0, float(expected.abs().max())))


def _server(label: str, lr: float) -> tuple[Agent, str]:
    agent = Agent(label)
    try:
        agent.send("ps_serve", config={"mode": "sync", "expected_workers": 1,
                                       "optimizer": "sgd", "optimizer_args": {"lr": lr},
                                       "heartbeat_timeout": 60.0})
        return agent, text(agent.read(120), "address")
    except BaseException:
        close_all([agent])
        raise


def run_check(device: str = "cuda", quick: bool = False, lr: float = 1e-2) -> GpuCheck:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; use --device cpu to run the same code "
                         "path on the CPU")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    copy = copy_bandwidth(dev, (4 if quick else 64) << 20)
    round_trip = []
    for wire in (None, "bfloat16"):
        agent, addr = _server(f"gpu-check-{wire or 'f32'}", lr)
        try:
            round_trip.append(
                check_round_trip([addr], dev, (1 << 14) if quick else (1 << 22), lr, wire))
            shutdown_servers([addr])
            agent.read(60)
        finally:
            close_all([agent])
    agent, addr = _server("gpu-check-overlap", lr)
    try:
        size: JSONObject = (
            {"width": 256, "depth": 3, "batch": 32, "steps": 2, "repeats": 2,
             "bucket_bytes": 256 << 10} if quick else
            {"width": 4096, "depth": 8, "batch": 256, "steps": 3, "repeats": 5,
             "bucket_bytes": 4 << 20})
        ov = OverlapResult.from_json(overlap.run({"addresses": [addr], "device": str(dev),
                                                  **size}, lambda _: None))
        shutdown_servers([addr])
        agent.read(60)
    finally:
        close_all([agent])
    return GpuCheck(str(dev), torch.__version__, name, copy, tuple(round_trip), ov)


def _print(result: GpuCheck, console: Console) -> None:
    t = Table(title=f"gpu check on {result.device_name or result.device}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    copy = result.copy
    for kind, gbps in (("pageable", copy.pageable_gbps), ("pinned", copy.pinned_gbps)):
        if gbps is not None:
            t.add_row(f"device-to-host {kind} GB/s", f"{gbps:.2f}")
    for rt in result.round_trip:
        t.add_row(f"push+pull exact ({rt.wire_dtype} gradients)",
                  f"{'ok' if rt.ok else 'WRONG'} (max err {rt.max_abs_error:.1e})")
    ov = result.overlap
    for key, stats in (("compute", ov.compute), ("comm", ov.comm),
                       ("sequential", ov.sequential), ("overlap", ov.overlap)):
        t.add_row(f"{key} ms per step", f"{stats.median * 1e3:.1f}")
    t.add_row("overlap / max(compute, comm)", f"{ov.overlap_vs_bound:.2f}")
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paramserver.benchmarks.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check.json"))
    args = parser.parse_args(argv)
    result = run_check(args.device, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result.to_json(), indent=2))
    _print(result, Console())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
