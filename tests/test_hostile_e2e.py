"""A hostile peer against real shard processes (issue 12).

Not the fuzzer (tests/test_fuzz.py): a hand-built pyzmq/msgpack client sends
messages that *decode cleanly* but carry a wrong shape, a hostile plan, partial
state for an unregistered id, a flood of ids, or a forged push id. After each,
the server must be alive, its weights and version unchanged where they must
be, its memory bounded, and a legitimate worker must still seed, push and pull.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.server.loop import ServerConfig
from paramserver.wire.protocol import PROTOCOL_VERSION
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.worker import WorkerConfig

PLAN = ShardPlan([ParamSpec("w", (128,), "float32"), ParamSpec("b", (16,), "float32")], 1)
MiB = 1 << 20


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Hostile:
    """A raw DEALER speaking the wire format by hand."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.seq = 0

    def send(self, op: str, fields: dict[str, Any],
             tensors: list[tuple[str, str, list[int], bytes]] = (), v: Any = PROTOCOL_VERSION
             ) -> int:
        self.seq += 1
        header = {"v": v, "op": op, "seq": self.seq, "f": fields,
                  "t": [[k, d, s] for k, d, s, _ in tensors]}
        self.sock.send_multipart([msgpack.packb(header), *[b for *_, b in tensors]])
        return self.seq

    def recv(self, timeout: float = 20.0) -> dict[str, Any]:
        assert self.sock.poll(int(timeout * 1000)), "the server did not answer"
        frames = self.sock.recv_multipart()
        head: dict[str, Any] = msgpack.unpackb(frames[0], raw=False)
        return head

    def ask(self, op: str, fields: dict[str, Any], tensors: list[Any] = (), **kw: Any
            ) -> dict[str, Any]:
        self.send(op, fields, tensors, **kw)
        return self.recv()

    def code(self, op: str, fields: dict[str, Any], tensors: list[Any] = (), **kw: Any) -> str:
        head = self.ask(op, fields, tensors, **kw)
        return str(head["f"]["code"]) if head["op"] == "error" else "ok"

    def hello(self, worker: int, plan: ShardPlan | dict[str, Any] = PLAN, **over: Any) -> str:
        desc, digest = (plan.describe(), plan.hash) if isinstance(plan, ShardPlan) else (plan, "")
        fields = {"worker": worker, "role": "worker", "protocol": PROTOCOL_VERSION,
                  "plan_hash": digest, "plan": desc, "incarnation": f"h{worker}"}
        fields.update(over)
        return self.code("hello", fields)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _f32(n: int, value: float = 0.5) -> bytes:
    return torch.full((n,), value).numpy().tobytes()


class Legit:
    """The project's own client with a two-tensor model."""

    def __init__(self, address: str, worker: int = 0) -> None:
        self.params = {"w": torch.linspace(-1, 1, 128), "b": torch.zeros(16)}
        self.client = PSClient([address], PLAN, worker=worker, heartbeat_interval=0.2,
                               timeout=20)
        self.clock = self.client.connect()

    def seed(self) -> None:
        self.client.initialize(self.params)

    def step(self) -> Any:
        pulled = self.client.pull(self.params, self.clock)
        grads = {k: torch.full_like(v, 0.01) for k, v in self.params.items()}
        out = self.client.push(grads, pulled.versions, 4, self.clock)
        self.clock += 1
        return out

    def close(self) -> None:
        self.client.close()


def _weights(address: str) -> tuple[dict[str, torch.Tensor], int]:
    params = {"w": torch.zeros(128), "b": torch.zeros(16)}
    with PSClient([address], PLAN, worker=999, role="observer", heartbeat_interval=0,
                  timeout=20) as obs:
        obs.connect()
        version = obs.pull(params).versions[0]
    return params, version


def _cluster(tmp_path: Path, workers: int = 1, **server: Any) -> LocalCluster:
    spec = ClusterSpec(num_servers=1, num_workers=workers, server=ServerConfig(**server),
                       worker=WorkerConfig(), evaluate=False)
    return LocalCluster(spec, tmp_path)


@contextmanager
def _two_peers(address: str) -> Iterator[tuple[Legit, Hostile]]:
    """The project's own worker and a hand-built hostile one, both closed at the end."""
    legit = Legit(address)
    bad = Hostile(address)
    try:
        yield legit, bad
    finally:
        bad.close()
        legit.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_wrong_shape_is_refused_and_a_round_closed_by_timeout_steps(tmp_path: Path,
                                                                    mode: str) -> None:
    """Defect 1: a [16, 8] gradient for a [128] slice."""
    ckpt = tmp_path / "ckpt"
    with _cluster(tmp_path, workers=2, mode=mode, heartbeat_timeout=2.0,
                  checkpoint_dir=str(ckpt)) as cluster:
        (address,) = cluster.start_servers()
        proc = cluster.servers[0].popen
        with _two_peers(address) as (legit, bad):
            assert bad.hello(1) == "ok"
            legit.seed()
            before, version = _weights(address)
            wrong = [("w", "float32", [16, 8], _f32(128)), ("b", "float32", [16], _f32(16))]
            push = {"worker": 1, "push_id": 1, "clock": 0, "read_version": version,
                    "num_samples": 4}
            assert bad.code("push", push, wrong) == "bad_tensor"
            assert bad.code("init", {"worker": 1}, wrong) in ("ok", "bad_tensor")
            after, version_after = _weights(address)
            assert version_after == version
            assert all(torch.equal(before[k], after[k]) for k in before)
            # the hostile worker goes quiet: in sync the round closes by its timeout,
            # in the serve loop's periodic work, and the legitimate push is stepped
            out = legit.step()
            assert out.accepted
            for _ in range(3):
                assert legit.step().accepted
            assert proc.poll() is None
            stats = server_stats([address])[0]
            assert stats.version == version + 4
            assert "error_internal" not in stats.counters
            assert "error_periodic" not in stats.counters
        # it stops cleanly, with its checkpoint written
        from paramserver.workers.admin import shutdown_servers
        assert shutdown_servers([address]) == []
        assert proc.wait(timeout=30) == 0
        assert (ckpt / "shard0" / "LATEST").exists()


def test_plan_from_a_refused_hello_is_not_adopted(tmp_path: Path) -> None:
    """Defect 2, and the plan bombs of defect 3, on a server started without a plan."""
    with _cluster(tmp_path, max_model_bytes=64 * MiB) as cluster:
        (address,) = cluster.start_servers()
        pid = cluster.servers[0].popen.pid
        bad = Hostile(address)
        try:
            rss0 = _rss(pid)
            other = ShardPlan([ParamSpec("x", (4,), "float32")], 1)
            # a wrong hash for the plan it carries: refused, and nothing adopted
            assert bad.hello(5, other, plan_hash="0" * 64) == "plan_mismatch"
            # 227 bytes declaring 10^6 one-byte chunks, and 1 GiB / 8 GiB parameters
            bomb = {"params": [{"name": "x", "shape": [10 ** 6], "dtype": "float32"}],
                    "num_shards": 1, "chunk_bytes": 1, "split": True}
            t0 = time.monotonic()
            assert bad.hello(5, bomb, plan_hash="0" * 64) == "bad_field"
            for shape in ([1 << 28], [1 << 31], [1 << 40, 1 << 40]):
                big = {**bomb, "params": [{"name": "x", "shape": shape, "dtype": "float32"}],
                       "chunk_bytes": 2 * MiB}
                real_hash = ShardPlan.description_hash(
                    [ParamSpec("x", tuple(shape), "float32")], 1, 2 * MiB, True)
                assert bad.hello(5, big, plan_hash=real_hash) == "bad_field"
            int8 = ShardPlan([ParamSpec("q", (8,), "int8")], 1)
            assert bad.hello(5, int8) == "bad_field"
            assert time.monotonic() - t0 < 2.0
            assert _rss(pid) - rss0 < 32 * MiB
            assert bad.code("hello", {"worker": 5, "role": "worker", "protocol": 1,
                                      "plan_hash": PLAN.hash, "incarnation": "x"},
                            v=True) == "protocol_version"
            assert bad.code("stats", {}, v=1.0) == "protocol_version"
            # the real worker is the first to bring a plan that holds
            legit = Legit(address)
            legit.seed()
            assert legit.step().accepted
            # a mismatching bomb against the adopted plan: diff() costs no more
            t0 = time.monotonic()
            assert bad.hello(6, bomb, plan_hash="1" * 64) == "plan_mismatch"
            assert time.monotonic() - t0 < 1.0
            assert legit.step().accepted
            legit.close()
            assert cluster.servers[0].popen.poll() is None
        finally:
            bad.close()


def test_no_state_for_unregistered_peers_and_parts_are_bounded(tmp_path: Path) -> None:
    """Defect 4: parts and INIT from ids that never said HELLO."""
    plan = ShardPlan([ParamSpec("w", (1 << 20,), "float32")], 1, chunk_bytes=MiB)
    keys = [s.key for s in plan.slices]
    assert len(keys) == 4
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        pid = cluster.servers[0].popen.pid
        bad = Hostile(address)
        try:
            assert bad.hello(1, plan) == "ok"  # the plan is adopted: 4 slices of 1 MiB
            rss0 = _rss(pid)
            part = _f32(1 << 18)
            # an unregistered id may not own INIT (it would never time out)
            init = {"worker": 77, "part": 0, "parts": 4}
            assert bad.code("init", init, [(keys[0], "float32", [1 << 18], part)]) \
                == "not_registered"
            # 300 parts of 1 MiB from unregistered ids: nothing kept
            for i in range(300):
                bad.send("push", {"worker": 1000 + i, "push_id": 1, "clock": 0,
                                  "read_version": 0, "num_samples": 1, "part": 0, "parts": 4},
                         [(keys[0], "float32", [1 << 18], part)])
            codes = {str(bad.recv()["f"].get("code")) for _ in range(300)}
            assert codes == {"not_registered"}
            # a registered peer: bounded parts count, known keys only
            assert bad.code("push", {"worker": 1, "push_id": 1, "clock": 0, "read_version": 0,
                                     "num_samples": 1, "part": 0, "parts": 10 ** 6},
                            [(keys[0], "float32", [1 << 18], part)]) == "bad_field"
            assert bad.code("push", {"worker": 1, "push_id": 1, "clock": 0, "read_version": 0,
                                     "num_samples": 1, "part": 0, "parts": 4},
                            [("bogus", "float32", [1 << 18], part)]) == "unknown_key"
            assert _rss(pid) - rss0 < 64 * MiB
            # the legitimate worker seeds in parts and trains
            params = {"w": torch.ones(1 << 20)}
            with PSClient([address], plan, worker=0, heartbeat_interval=0.2, timeout=20,
                          part_bytes=MiB) as client:
                clock = client.connect()
                client.initialize(params)
                pulled = client.pull(params, clock)
                assert client.push({"w": torch.full((1 << 20,), 0.1)}, pulled.versions, 1,
                                   clock).accepted
            assert server_stats([address])[0].version == 1
        finally:
            bad.close()


def test_hello_flood_leaves_pulls_fast_and_stats_decodable(tmp_path: Path) -> None:
    """Defect 5: a few thousand distinct-id HELLOs."""
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        pid = cluster.servers[0].popen.pid
        legit = Legit(address)
        legit.seed()
        assert legit.step().accepted
        bad = Hostile(address)
        try:
            rss0 = _rss(pid)
            flood = 5000
            hello = {"role": "worker", "protocol": PROTOCOL_VERSION, "plan_hash": PLAN.hash}
            for i in range(flood):
                bad.send("hello", {**hello, "worker": 10 + i, "incarnation": f"f{i}"})
                if i % 500 == 499:  # stay under zmq's high-water mark
                    for _ in range(500):
                        bad.recv()
            rss_growth = _rss(pid) - rss0
            stats = server_stats([address])[0]  # the project's own decoder
            assert stats.core.workers_known <= 64
            assert stats.core.workers_evicted >= flood - 64
            assert "0" in stats.workers
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                legit.client.pull(legit.params, legit.clock)
                times.append(time.perf_counter() - t0)
            assert statistics.median(times) < 0.05, times
            assert legit.step().accepted
            assert rss_growth < 32 * MiB, rss_growth
        finally:
            bad.close()
            legit.close()


def test_a_forged_push_id_cannot_silence_a_worker(tmp_path: Path) -> None:
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        with _two_peers(address) as (legit, bad):
            legit.seed()
            assert legit.step().accepted
            _, version = _weights(address)
            forged = {"worker": 0, "push_id": (1 << 62) - 1, "clock": 5,
                      "read_version": version, "num_samples": 1}
            grads = [("w", "float32", [128], _f32(128)), ("b", "float32", [16], _f32(16))]
            assert bad.code("push", forged, grads) == "bad_field"
            assert _weights(address)[1] == version
            out = legit.step()
            assert out.accepted and not any(o.duplicate for o in out.outcomes if o)


def _start_server(cfg: dict[str, Any], path: Path) -> subprocess.Popen[str]:
    path.write_text(json.dumps(cfg))
    return subprocess.Popen([sys.executable, "-m", "paramserver.server.loop", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_resume_errors_are_one_line(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with _cluster(tmp_path, checkpoint_dir=str(ckpt)) as cluster:
        (address,) = cluster.start_servers()
        legit = Legit(address)
        legit.seed()
        assert legit.step().accepted
        legit.close()
        from paramserver.workers.admin import shutdown_servers
        assert shutdown_servers([address]) == []
        assert cluster.servers[0].popen.wait(timeout=30) == 0
    name = json.loads((ckpt / "shard0" / "LATEST").read_text())["name"]

    from safetensors.torch import load_file, save_file
    tensors = load_file(str(ckpt / "shard0" / f"{name}.safetensors"))
    nan = {k: (torch.full_like(v, math.nan) if k.startswith("param/") else v)
           for k, v in tensors.items()}
    meta = json.loads((ckpt / "shard0" / f"{name}.json").read_text())
    good = (ckpt / "shard0" / f"{name}.safetensors").read_bytes()
    cases: dict[str, Callable[[Path], Any]] = {
        "latest_list": lambda folder: (folder / "LATEST").write_text("[1, 2]"),
        "latest_path": lambda folder: (folder / "LATEST").write_text('{"name": "../../etc/x"}'),
        "truncated": lambda folder: (folder / f"{name}.safetensors").write_bytes(good[:100]),
        "empty": lambda folder: (folder / f"{name}.safetensors").write_bytes(b""),
        "hostile_header": lambda folder: (folder / f"{name}.safetensors").write_bytes(
            (10 ** 12).to_bytes(8, "little") + b"{}"),
        "nan": lambda folder: save_file(nan, str(folder / f"{name}.safetensors")),
        "negative_version": lambda folder: (folder / f"{name}.json").write_text(
            json.dumps({**meta, "version": -3})),
    }
    # each case damages its own copy of the checkpoint, so that their servers (each
    # mostly an interpreter starting) run side by side
    started: dict[str, tuple[Path, subprocess.Popen[str]]] = {}
    try:
        for case, damage in cases.items():
            copy = tmp_path / f"ckpt-{case}"
            shutil.copytree(ckpt, copy)
            damage(copy / "shard0")
            started[case] = (copy, _start_server(
                {"resume": str(copy), "bind": "tcp://127.0.0.1:0"},
                tmp_path / f"server-{case}.json"))
        for case, (copy, proc) in started.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode != 0, case
            err = err.strip()
            assert "Traceback" not in err, (case, err)
            lines = [ln for ln in err.splitlines() if "cannot resume" in ln]
            assert len(lines) == 1 and str(copy) in lines[0], (case, err)
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_packed_frames_from_a_hostile_peer(tmp_path: Path) -> None:
    """Packed frames (several tensors in one frame) over a real socket: each kind of
    bad layout is refused with bad_tensor and changes nothing; a good one is applied,
    and the legitimate worker, whose pushes and pulls travel packed, trains on."""
    keys = [s.key for s in PLAN.shard_slices(0)]
    numel = {s.key: s.numel for s in PLAN.shard_slices(0)}
    with _cluster(tmp_path, mode="async") as cluster:
        (address,) = cluster.start_servers()
        proc = cluster.servers[0].popen
        with _two_peers(address) as (legit, bad):
            assert bad.hello(1) == "ok"
            legit.seed()
            before, version = _weights(address)
            sizes = [numel[k] * 4 for k in keys]
            data = _f32(sum(numel.values()), 0.25)

            def push(entries: list[Any], frame: bytes, push_id: int) -> str:
                bad.seq += 1
                header = {"v": PROTOCOL_VERSION, "op": "push", "seq": bad.seq,
                          "f": {"worker": 1, "push_id": push_id, "clock": 0,
                                "read_version": version, "num_samples": 4},
                          "t": [["float32", entries]]}
                bad.sock.send_multipart([msgpack.packb(header), frame])
                head = bad.recv()
                return str(head["f"]["code"]) if head["op"] == "error" else "ok"

            good = [[keys[0], [numel[keys[0]]], 0], [keys[1], [numel[keys[1]]], sizes[0]]]
            overlap = [good[0], [keys[1], [numel[keys[1]]], sizes[0] - 4]]
            assert push(overlap, data, 1) == "bad_tensor"
            assert push(good, data[:-4], 2) == "bad_tensor"  # the frame cut short
            assert push(good, data + b"\0" * 4, 3) == "bad_tensor"  # bytes left over
            assert push([good[0], good[0]], data, 4) == "bad_tensor"  # a key twice
            after, version_after = _weights(address)
            assert version_after == version
            assert all(torch.equal(before[k], after[k]) for k in before)
            assert push(good, data, 5) == "ok"  # well formed: applied
            assert legit.step().accepted
            assert proc.poll() is None
            stats = server_stats([address])[0]
            assert stats.version == version + 2
            assert "error_internal" not in stats.counters


def test_parts_asking_for_early_weights_in_hostile_orders(tmp_path: Path) -> None:
    """A lone sync worker's parts asking for early weights (the field ``early``), sent
    as a hostile peer would: parts out of order, repeated or missing, a part index
    out of range, a header changed half-way, non-finite values, stale and future read
    versions. The shard answers every message, never with an internal error, steps
    ahead and answers early where it may, and keeps finite weights."""
    rng = random.Random(7)
    with _cluster(tmp_path, mode="sync", expected_workers=1, optimizer="sgd",
                  optimizer_args={"lr": 0.1}) as cluster:
        (address,) = cluster.start_servers()
        bad = Hostile(address)
        try:
            assert bad.hello(0) == "ok"
            assert bad.code("init", {"worker": 0}, [("w", "float32", [128], _f32(128)),
                                                    ("b", "float32", [16], _f32(16))]) == "ok"
            codes: Counter[str] = Counter()
            version, push_id = 0, 0
            for _ in range(150):
                push_id += rng.choice([1, 1, 1, 0, 2])
                parts = rng.choice([2, 2, 2, 1, 3])
                order = list(range(parts))
                if rng.random() < 0.15:
                    rng.shuffle(order)
                if rng.random() < 0.1:
                    order.append(rng.choice(order))  # a part again
                if rng.random() < 0.1:
                    order.pop()  # the push never completes
                header = {"worker": 0, "push_id": push_id, "num_samples": rng.choice([1, 4]),
                          "clock": rng.choice([version, version + 1]),
                          "read_version": rng.choice([version] * 8 + [version - 1, version + 3])}
                for part in order:
                    key, n = ("w", 128) if part % 2 == 0 else ("b", 16)
                    value = rng.choice([0.01] * 12 + [math.nan, math.inf])
                    fields = {**header, "parts": parts, "part": part,
                              "early": rng.random() < 0.8, "pull": rng.random() < 0.5}
                    if rng.random() < 0.03:
                        fields["part"] = rng.choice([-1, 7])
                    if rng.random() < 0.03:
                        fields["clock"] += 1  # differs from the push's first part
                    head = bad.ask("push", fields, [(key, "float32", [n], _f32(n, value))])
                    if head["op"] == "error":
                        codes[str(head["f"]["code"])] += 1
                    else:
                        f = head["f"]
                        # a part answered with its next weights, or a round's answer
                        # that leaves out those that went back early
                        kind = "ok" if "early" not in f else "early" if f.get("partial") \
                            else "rest"
                        codes[kind] += 1
                        version = max(version, int(head["f"].get("version", version)))
            assert cluster.servers[0].popen.poll() is None
            stats = server_stats([address])[0]
            assert "internal" not in codes and "error_internal" not in stats.counters
            assert codes["early"] and stats.counters["early_parts"] == codes["early"]
            assert stats.counters.get("early_answers", 0) == codes["rest"]
            assert stats.version > 5  # the well-formed pushes stepped
            weights, _ = _weights(address)
            assert all(bool(torch.isfinite(t).all()) for t in weights.values())
        finally:
            bad.close()
