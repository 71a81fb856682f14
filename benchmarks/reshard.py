"""A live reshard's pause against a checkpoint and restart (issue 47, item 2).

``paramserver bench --part reshard`` runs it. For each model size (16 MiB and
256 MiB; quick: 1 MiB and 4 MiB) a sync job of one worker (a thread of this
process, pushing and pulling round after round) trains on 2 shard processes
(SGD with momentum: the shards hold twice the model), with a third shard started
empty. Then:

* live: ``paramserver reshard``'s driver (workers/reshard.py) moves the job to 3
  shards while the worker runs. ``pause``: from the last shard frozen to the last
  commit (the shards hold every request meanwhile); ``stall``: the worker's longest
  round less its median round, what the move cost it.
* stop and resume, from those 3 shards back to 2: every shard checkpoints, stops,
  the checkpoint is resharded (``checkpoint reshard``), 2 shard processes start
  resuming it, and a client (already imported: a restarted worker would add its
  own start) connects and completes a round. Its time, from the checkpoint
  request to that round's end, is what the live move stands in for.

The goal: the live pause at least 5x shorter than the stop and resume.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.persist.reshard import reshard_checkpoint
from paramserver.server.config import ServerConfig
from paramserver.server.process import Ready
from paramserver.util.jsontypes import JSON, JSONObject
from paramserver.wire.protocol import Message, Op
from paramserver.wire.transport import Channel, SideChannel, request_all
from paramserver.workers.admin import shutdown_servers
from paramserver.workers.client import PSClient
from paramserver.workers.reshard import live_reshard

from .common import format_size, number

__all__ = ["DEFAULT_SIZES", "QUICK_SIZES", "ReshardRow", "run_reshard"]

_MIB = 1 << 20
DEFAULT_SIZES: tuple[int, ...] = (16 * _MIB, 256 * _MIB)
QUICK_SIZES: tuple[int, ...] = (1 * _MIB, 4 * _MIB)
_TIMEOUT = 600.0


@dataclass(frozen=True)
class ReshardRow:
    """One model size: the live move's pause and the worker's stall (2 -> 3 shards),
    and a checkpoint, reshard and restart's time (3 -> 2), in seconds."""

    bytes: int
    pause_s: float
    stall_s: float
    move_s: float
    restart_s: float

    @property
    def ratio(self) -> float:
        """How many times shorter the live move stopped training (the longer of its pause
        and the worker's stall) than the stop and resume did."""
        return self.restart_s / max(self.pause_s, self.stall_s, 1e-9)

    def to_json(self) -> JSONObject:
        return {"bytes": self.bytes, "pause_s": self.pause_s, "stall_s": self.stall_s,
                "move_s": self.move_s, "restart_s": self.restart_s}

    @classmethod
    def from_json(cls, value: JSON) -> ReshardRow:
        if not isinstance(value, dict):
            raise ValueError(f"a reshard row is an object, not {value!r}")
        return cls(int(number(value, "bytes")), number(value, "pause_s"),
                   number(value, "stall_s"), number(value, "move_s"),
                   number(value, "restart_s"))

    def line(self) -> str:
        return (f"  {format_size(self.bytes):>8}: live pause {self.pause_s:.3f} s (worker "
                f"stall {self.stall_s:.3f} s, move {self.move_s:.2f} s), checkpoint + "
                f"restart {self.restart_s:.2f} s: {self.ratio:.1f}x shorter")


class _Job:
    """Shard processes of one bench job (stopped at the end, whatever happened)."""

    def __init__(self, tmp: Path, log_dir: Path) -> None:
        self.tmp, self.log_dir = tmp, log_dir
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, shards: list[tuple[int, int]], **cfg: Any) -> list[str]:
        """Start one process per (shard, of); their addresses once each is ready."""
        started = []
        for shard, of in shards:
            n = len(self.procs)
            config = ServerConfig(**{
                "shard": shard, "num_shards": of, "mode": "sync", "expected_workers": 1,
                "optimizer": "sgd", "optimizer_args": {"lr": 0.01, "momentum": 0.9},
                "heartbeat_timeout": 120.0, "checkpoint_keep": 1,
                "checkpoint_dir": str(self.tmp / "ckpt"), **cfg})
            path = self.tmp / f"server{n}.json"
            path.write_text(json.dumps(config.to_dict()))
            log = (self.log_dir / f"reshard-server{n}.log").open("w")
            proc = subprocess.Popen([sys.executable, "-m", "paramserver.server.loop", str(path)],
                                    stdout=subprocess.PIPE, stderr=log, text=True)
            log.close()
            self.procs.append(proc)
            started.append(proc)
        out = []
        for proc in started:
            assert proc.stdout is not None
            out.append(Ready.parse(proc.stdout.readline()).address)
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _plan(size: int, shards: int) -> ShardPlan:
    return ShardPlan([ParamSpec("w", (size // 4,), "float32")], shards)


class _Rounds(threading.Thread):
    """The worker: push + pull rounds until stopped, each round's time kept."""

    def __init__(self, client: PSClient, params: dict[str, torch.Tensor]) -> None:
        super().__init__(daemon=True)
        self.client, self.params = client, params
        self.seconds: list[float] = []
        self.stop = threading.Event()
        self.warm = threading.Event()  # a few rounds done
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            grads = {k: torch.full_like(v, 1e-3) for k, v in self.params.items()}
            versions = self.client.pull(self.params, 0, wait_init=True).versions
            clock = 0
            while not self.stop.is_set():
                t0 = time.perf_counter()
                _, pulled = self.client.push_pull(grads, versions, 1, clock, self.params)
                self.seconds.append(time.perf_counter() - t0)
                versions, clock = pulled.versions, clock + 1
                if len(self.seconds) >= 3:
                    self.warm.set()
        except BaseException as exc:  # (told to the caller, which stops the bench)
            self.error = exc
            self.warm.set()


def _checkpoint(addresses: list[str]) -> None:
    chans: list[Channel[SideChannel]] = [Channel(a, peer=a) for a in addresses]
    try:
        request_all(chans, [Message(Op.CHECKPOINT) for _ in chans], _TIMEOUT, "CHECKPOINT")
    finally:
        for ch in chans:
            ch.close()


def _one(size: int, log_dir: Path) -> ReshardRow:
    tmp = Path(tempfile.mkdtemp(prefix="ps-bench-reshard-"))
    job = _Job(tmp, log_dir)
    try:
        servers = job.start([(0, 2), (1, 2)])
        (added,) = job.start([(2, 3)])
        params = {"w": torch.linspace(-1, 1, size // 4)}
        client = PSClient(servers, _plan(size, 2), worker=0, heartbeat_interval=1.0,
                          timeout=_TIMEOUT)
        client.connect()
        client.initialize(params)
        worker = _Rounds(client, params)
        worker.start()
        worker.warm.wait(_TIMEOUT)
        moved = live_reshard(servers, 3, [added], timeout=_TIMEOUT)
        done = len(worker.seconds)
        while worker.error is None and len(worker.seconds) < done + 3 and worker.is_alive():
            worker.warm.clear()
            worker.warm.wait(1.0)  # (set again by each round past the third)
        worker.stop.set()
        worker.join(_TIMEOUT)
        if worker.error is not None:
            raise worker.error
        stall = max(worker.seconds) - statistics.median(worker.seconds)
        client.close()
        # stop and resume: checkpoint, stop, reshard the checkpoint, start, first round
        t0 = time.perf_counter()
        three = list(moved.servers)
        _checkpoint(three)
        shutdown_servers(three, timeout=_TIMEOUT)
        for proc in job.procs:
            proc.wait(_TIMEOUT)
        reshard_checkpoint(tmp / "ckpt", 2, tmp / "ckpt2")
        back = job.start([(0, 2), (1, 2)], resume=str(tmp / "ckpt2"),
                         checkpoint_dir=str(tmp / "ckpt2"))
        again = PSClient(back, _plan(size, 2), worker=0, heartbeat_interval=1.0,
                         timeout=_TIMEOUT)
        clock = again.connect()
        grads = {k: torch.full_like(v, 1e-3) for k, v in params.items()}
        versions = again.pull(params, clock).versions
        again.push_pull(grads, versions, 1, clock, params)
        restart = time.perf_counter() - t0
        again.close()
        shutdown_servers(back, timeout=_TIMEOUT)
        return ReshardRow(size, moved.pause_s, stall, moved.total_s, restart)
    finally:
        job.close()
        shutil.rmtree(tmp, ignore_errors=True)


def run_reshard(sizes: tuple[int, ...] = DEFAULT_SIZES, log_dir: Path | None = None,
                on_row: Any = None) -> tuple[ReshardRow, ...]:
    """One row per model size (see the module's docstring)."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="ps-bench-reshard-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in sizes:
        row = _one(size, log_dir)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return tuple(rows)
