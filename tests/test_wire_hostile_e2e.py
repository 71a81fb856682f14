"""A hostile peer on the wire against real shard processes (issue 29, items 4, 10, 11).

* a multipart message that never ends: what bounds the frames zmq queues for it;
* pushes at thousands of staleness values: STATS must still decode (every map a
  shard puts in a reply is bounded below the decoder's limits);
* a NaN push under ``--on-divergence stop``: refused and alarmed as that peer's
  fault; only the model's own divergence stops a shard.

The raw-wire helpers (Hostile, Legit, the one-shard cluster) are the issue-12 ones.
"""

from __future__ import annotations

import io
import socket
import struct
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import torch
from msgspec.structs import replace
from rich.console import Console

from paramserver.cli.statusview import collect, render
from paramserver.core.records import MAX_REASONS, OTHER_REASONS, STATS_WORKERS, WorkerState
from paramserver.core.report import worker_stats
from paramserver.errors import RemoteError
from paramserver.policies import Decision
from paramserver.server.loop import DIVERGED_EXIT_CODE, ServerConfig
from paramserver.wire.curve import generate_curve_keys
from paramserver.wire.protocol import DEFAULT_LIMITS, MAX_HEADER_BYTES, Message, Op, decode, encode
from paramserver.wire.stats import STATS_BYTES, LastPush, ObservedStats, fields, fit
from paramserver.workers.admin import server_stats
from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster
from paramserver.workers.worker import WorkerConfig
from tests.stats_fixture import shard_stats
from tests.test_hostile_e2e import Legit, MiB, _cluster, _f32, _rss, _two_peers, _weights

# ----------------------------------------------------------------------- item 4: a message
# that never ends. A pyzmq DEALER cannot send one: libzmq holds an unfinished message's
# frames on the sending side until the last one. So the peer speaks ZMTP 3.1 itself.


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the shard closed the connection")
        data += chunk
    return data


def _zmtp_dealer(address: str) -> socket.socket:
    """A TCP connection that has done a ZMTP 3.1 NULL handshake as a DEALER (raises
    ConnectionError where the shard refuses it)."""
    host, port = address.split("://", 1)[-1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"\xff" + bytes(7) + b"\x01\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0")
                 + bytes(32))
    _recv_exact(sock, 64)  # the shard's greeting

    def prop(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

    ready = b"\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Identity", b"")
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    _, size = _recv_exact(sock, 2)  # its READY (or, under CURVE, nothing: closed)
    _recv_exact(sock, size)
    return sock


def _send_unfinished(sock: socket.socket, total: int, frame: int = 64 * 1024) -> int:
    """Frames flagged MORE, ``total`` bytes of them, and never a last one; the bytes
    the kernel took before the shard dropped the connection."""
    more = b"\x03" + struct.pack(">Q", frame) + b"x" * frame  # MORE | LONG
    sent = 0
    try:
        while sent < total:
            sock.sendall(more)
            sent += frame
    except OSError:  # reset or broken pipe: the shard dropped us
        pass
    return sent


def test_an_unfinished_multipart_message_reaches_no_shard_that_admits_only_its_keys(
        tmp_path: Path) -> None:
    """The reachable bound: with CURVE and an allow-list, a peer without an admitted key
    is disconnected at the handshake and not one frame of its message is queued.
    (Without them libzmq queues every frame; docs/reliability.md has the figures.)"""
    keys = generate_curve_keys(tmp_path / "keys")
    spec = ClusterSpec(
        num_servers=1, num_workers=1, evaluate=False,
        server=ServerConfig(curve_secret_key=str(keys.server_secret),
                            curve_clients_dir=str(keys.authorized_dir)),
        worker=WorkerConfig(curve_key=str(keys.clients["client"][1]),
                            curve_server_key=str(keys.server_public)))
    with LocalCluster(spec, tmp_path / "run") as cluster:
        (address,) = cluster.start_servers()
        pid = cluster.servers[0].popen.pid
        rss0 = _rss(pid)
        total = 256 * MiB
        dropped = 0
        for _ in range(2):  # a plain-text DEALER, twice
            try:
                sock = _zmtp_dealer(address)
            except (ConnectionError, OSError):
                dropped += 1  # refused at the handshake
                continue
            with sock:
                sent = _send_unfinished(sock, total)
                assert sent < total, "the shard took 256 MiB of an unfinished message"
                dropped += 1
        assert dropped == 2
        growth = _rss(pid) - rss0
        assert growth < 16 * MiB, growth
        assert cluster.servers[0].popen.poll() is None


# ---------------------------------------------------------------- item 10: STATS that decode


def test_stats_decode_after_pushes_at_thousands_of_staleness_values(tmp_path: Path) -> None:
    """4,200 pushes at read version 0 (staleness 1 to 4,200): each worker's histogram
    stays a few buckets, and STATS decodes, with `paramserver status` rendering it."""
    pushes = 4200
    with _cluster(tmp_path) as cluster:
        (address,) = cluster.start_servers()
        with _two_peers(address) as (legit, bad):
            assert bad.hello(1) == "ok"
            legit.seed()
            _, version0 = _weights(address)
            grads = [("w", "float32", [128], _f32(128, 1e-6)), ("b", "float32", [16], _f32(16))]
            window = 500  # replies read in batches: under zmq's high-water marks
            codes: Counter[str] = Counter()
            for i in range(pushes):
                bad.send("push", {"worker": 1, "push_id": i + 1, "clock": i, "read_version": 0,
                                  "num_samples": 1}, grads)
                if i % window == window - 1 or i == pushes - 1:
                    for _ in range(window if i % window == window - 1 else pushes % window):
                        head = bad.recv()
                        codes[head["op"] if head["op"] != "error" else head["f"]["code"]] += 1
            assert codes == {"reply": pushes}
            stats = server_stats([address])[0]  # the project's own decoder
            mine = stats.workers["1"]
            assert mine.pushes == pushes
            assert sum(mine.staleness.values()) == pushes
            assert len(mine.staleness) <= 32
            assert mine.staleness_max == version0 + pushes - 1
            assert mine.staleness_sum == sum(range(version0, version0 + pushes))
            # the readers: `paramserver status` and the launcher's live tables
            rows, problems = collect([address], 20)
            assert problems == [] and rows[0] is not None
            console = Console(file=io.StringIO(), width=250)
            console.print(render([address], rows, problems, console))
            text = console.file.getvalue()
            assert str(version0 + pushes - 1) in text  # the exact max staleness
            assert legit.step().accepted


def _pushed(state: WorkerState, tau: int, reason: str) -> None:
    state.opened(tau, tau)
    state.count(Decision(False, 0.0, reason))


def test_worker_records_stay_bounded_whatever_is_pushed() -> None:
    state = WorkerState(1, "i", 0.0)
    for tau in range(0, 1 << 20, 7):
        _pushed(state, tau, f"staleness {tau} > 0")
    _pushed(state, (1 << 62) - 1, "staleness huge")
    assert len(state.staleness) <= 16 + 62 - 4 + 1
    assert state.staleness_max == (1 << 62) - 1
    assert len(state.rejected) == MAX_REASONS + 1 and state.rejected[OTHER_REASONS] > 0
    assert sum(state.rejected.values()) == state.pushes
    # a push counted, then left out of its round: taken back under the same key
    state.uncount(Decision(False, 0.0, "staleness 999999 > 0"), "dropped")
    assert sum(state.rejected.values()) == state.pushes
    # a checkpoint from before the buckets (one key per value) loads bounded
    old = {**state.record(), "staleness": {str(t): 1 for t in range(6000)}}
    del old["staleness_max"], old["staleness_sum"]
    back = WorkerState.from_record(1, old, 0.0)
    assert len(back.staleness) <= 32 and back.staleness_max == 5999
    assert back.staleness_sum == sum(range(6000))


def test_a_full_stats_reply_fits_the_decoder() -> None:
    """STATS_WORKERS workers at their largest (every staleness bucket, every reason a
    worker's counts name, a 253-character host): fit() trims the listing until the
    reply encodes in STATS_BYTES, and the project's decoder takes it."""
    workers = {}
    for w in range(STATS_WORKERS):
        state = WorkerState(w, "i", 0.0)
        for tau in [*range(16), *(1 << b for b in range(4, 62))]:
            _pushed(state, tau, f"a policy's reason that names its staleness, {tau:>20}")
        workers[str(w)] = replace(worker_stats(state), host="h" * 253, pid=1 << 30)
    reply = shard_stats(0, workers, version=1, observed=ObservedStats(workers={
        str(w): LastPush(1, loss=0.5) for w in range(10 * STATS_WORKERS)}))
    fitted = fit(reply)
    assert len(msgpack.packb(fields(fitted))) <= STATS_BYTES < MAX_HEADER_BYTES
    assert fitted.figures is not None
    assert 0 < fitted.figures.workers_listed == len(fitted.workers) < STATS_WORKERS
    assert set(fitted.observed.workers) == set(fitted.workers)
    frames = encode(Message(Op.REPLY, 1, {"re": "stats", **fields(fitted)}))
    back = decode([bytes(f) for f in frames], DEFAULT_LIMITS)
    assert back.body == fitted


# ------------------------------------------------------- item 11: a refused push is no divergence


def test_a_refused_nan_push_does_not_stop_a_shard_that_stops_on_divergence(
        tmp_path: Path) -> None:
    with _cluster(tmp_path, on_divergence="stop", heartbeat_timeout=2.0) as cluster:
        (address,) = cluster.start_servers()
        proc = cluster.servers[0].popen
        with _two_peers(address) as (legit, bad):
            assert bad.hello(1) == "ok"
            legit.seed()
            assert legit.step().accepted
            _, version = _weights(address)
            nan = [("w", "float32", [128], _f32(128, float("nan"))),
                   ("b", "float32", [16], _f32(16))]
            push = {"worker": 1, "push_id": 1, "clock": 0, "read_version": version,
                    "num_samples": 4, "loss": float("nan")}
            assert bad.code("push", push, nan) == "nonfinite"
            # the shard serves on: the real worker trains, its weights untouched by the NaN
            for _ in range(3):
                assert legit.step().accepted
            assert proc.poll() is None
            stats = server_stats([address])[0]
            assert stats.counters["error_nonfinite"] == 1
            found = {a.signal: a for a in stats.observed.alarms}
            assert found["nonfinite_gradient"].worker == 1  # counted and alarmed ...
            assert "it was refused" in found["nonfinite_gradient"].message
            assert "nonfinite_loss" in found  # ... as that peer's fault, not divergence
            assert stats.version == version + 3
            after, _ = _weights(address)
            assert all(bool(torch.isfinite(t).all()) for t in after.values())


def test_a_shard_that_stops_on_divergence_still_stops_when_the_model_diverges(
        tmp_path: Path) -> None:
    """The same shard, with a learning rate that makes each step rewrite the weights:
    update_ratio_high is about the model, and stops it."""
    with _cluster(tmp_path, on_divergence="stop", heartbeat_timeout=2.0, optimizer="sgd",
                  optimizer_args={"lr": 1000.0}) as cluster:
        (address,) = cluster.start_servers()
        proc = cluster.servers[0].popen
        legit = Legit(address)
        try:
            legit.seed()
            with pytest.raises(RemoteError, match="divergence watchdog stopped training"):
                for _ in range(20):
                    legit.step()
        finally:
            legit.close()
        assert proc.wait(timeout=60) == DIVERGED_EXIT_CODE
