"""A hostile peer naming another job's shared memory (issue 29), over real sockets.

Two jobs, each a real shard process on loopback. Job 1's legitimate worker
moves its weights through shared memory: its shard's weight board and its own
gradient segment hold job 1's weights. A hand-built client of job 2's shard
then names those segments as its own. A name is no proof of holding a segment
(anyone on the host lists ``/dev/shm``, and one user's jobs pass each other's
owner checks), so the shard challenges it with a nonce the segment must come
to hold: the hostile client cannot write it there, gets FORBIDDEN, and every
later push, INIT or board pull naming that memory is refused. Job 2's shard
never maps job 1's files, none of job 1's bytes reach the hostile client, and
the legitimate same-host workers of both jobs keep using shared memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.shm import link as shm
from paramserver.shm.board import HEADER
from paramserver.wire.protocol import PROTOCOL_VERSION, decode
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient
from tests.test_hostile_e2e import Hostile, _cluster

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm")]

N = 32768  # 128 KiB of float32: over shm.MIN_BYTES, so the project's client uses the path
PLAN = ShardPlan([ParamSpec("w", (N,), "float32"), ParamSpec("b", (16,), "float32")], 1)
SECRET = {"w": 777.0 + torch.arange(float(N)), "b": torch.full((16,), -4242.0)}


def _secret_bytes() -> bytes:
    return SECRET["w"][:64].numpy().tobytes()  # 256 bytes no other weights hold


def _hello(h: Hostile, worker: int, offer: dict[str, Any]) -> dict[str, Any]:
    return h.ask("hello", {"worker": worker, "role": "worker", "protocol": PROTOCOL_VERSION,
                           "plan_hash": PLAN.hash, "plan": PLAN.describe(),
                           "incarnation": f"hostile{worker}", "shm": offer})


def _offer(seg: str, size: int, proved: bool = False) -> dict[str, Any]:
    offer: dict[str, Any] = {"host": shm.host_identity(), "seg": seg, "size": size}
    if proved:
        offer["proved"] = True
    return offer


def _descs(at: int) -> list[list[Any]]:
    """Descriptors of the whole model laid out from byte ``at`` of a segment."""
    return [["w", "float32", [N], at], ["b", "float32", [16], at + N * 4]]


def _code(head: dict[str, Any]) -> str:
    return str(head["f"]["code"]) if head["op"] == "error" else "ok"


def _mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _named_by_hostile(h: Hostile, worker: int, seg: str, size: int) -> list[str]:
    """Job 2's shard is told that ``seg`` is this connection's: the HELLO answers
    with a challenge, not a board; the claimed proof is refused; the segment's
    memory is refused as a push's, an INIT's, and as the board of a pull."""
    first = _hello(h, worker, _offer(seg, size))
    assert first["op"] == "reply", first
    grant = first["f"].get("shm") or {}
    assert "board" not in grant and len(grant.get("prove", "")) == 2 * shm.NONCE_BYTES
    codes = [_code(_hello(h, worker, _offer(seg, size, proved=True)))]
    codes.append(_code(h.ask("init", {"worker": worker, "shm": _descs(HEADER)})))
    codes.append(_code(h.ask("push", {"worker": worker, "push_id": 1, "clock": 0,
                                      "read_version": 0, "num_samples": 1,
                                      "shm": _descs(shm.PROOF_AT + 64)})))
    return codes


def test_a_peer_naming_another_jobs_segments_is_refused_and_reads_none_of_them(
        tmp_path, monkeypatch):
    monkeypatch.setenv(shm.ENV, "1")
    params = {k: v.clone() for k, v in SECRET.items()}
    with _cluster(tmp_path / "job1", mode="async", heartbeat_timeout=60) as job1, \
            _cluster(tmp_path / "job2", mode="async", heartbeat_timeout=60) as job2:
        (a,) = job1.start_servers()
        (b,) = job2.start_servers()
        shard2 = job2.servers[0].popen.pid
        # job 1: a legitimate same-host worker; its weights go into its own segment
        # (INIT) and its shard's board (the pull)
        with PSClient([a], PLAN, 0, timeout=20, heartbeat_interval=0) as victim:
            victim.connect()
            victim.initialize(params)
            victim.pull(params)
            link = victim.channels[0].shm
            assert link is not None and link.active and link.board and link.grads
            board, grads = link.board.seg, link.grads.seg
            assert board.mm.find(_secret_bytes()) >= 0 and grads.mm.find(_secret_bytes()) >= 0

            h = Hostile(b)
            own = shm.Segment.create("hostile", 4096 + N * 4 + 64)
            try:
                # job 1's board, and job 1's worker's segment, named as this peer's own
                assert _named_by_hostile(h, 7, board.name, board.size) == [
                    "forbidden", "not_registered", "not_registered"]
                assert _named_by_hostile(h, 7, grads.name, grads.size) == [
                    "forbidden", "not_registered", "not_registered"]
                # a proven connection that re-HELLOs naming another segment is
                # challenged again (its grant is gone), and cannot prove that one
                first = _hello(h, 8, _offer(own.name, own.size))["f"]["shm"]
                own.put(shm.PROOF_AT, bytes.fromhex(first["prove"]))
                granted = _hello(h, 8, _offer(own.name, own.size, proved=True))["f"]["shm"]
                assert granted["board"] and len(granted["token"]) == 2 * shm.NONCE_BYTES
                swapped = _hello(h, 8, _offer(board.name, board.size, proved=True))
                assert "board" not in swapped["f"]["shm"]
                assert _code(h.ask("init", {"worker": 8, "shm": _descs(HEADER)})) == \
                    "not_registered"
                assert _code(h.ask("pull", {"worker": 8, "clock": 0, "via_shm": True})) == \
                    "not_initialized"  # no board ticket, and nothing of job 1 seeded it
                assert _code(_hello(h, 8, _offer(board.name, board.size, proved=True))) == \
                    "forbidden"
                # a worker told of job 1's board under job 2's grant does not map it
                other = shm.ShmLink([("w", N * 4), ("b", 64)], "w9s0")
                other.granted({**granted, "board": board.name, "size": board.size})
                assert other.board is None
                other.close()

                # job 2's shard mapped neither of job 1's files, and seeded from job 2
                maps = _mapped(shard2)
                assert board.name not in maps and grads.name not in maps
                assert _code(h.ask("init", {"worker": 8, "shm": _descs(64)})) == \
                    "not_registered"
                zeros = [("w", "float32", [N], bytes(N * 4)), ("b", "float32", [16], bytes(64))]
                assert _code(h.ask("init", {"worker": 7}, zeros)) == "ok"
                h.send("pull", {"worker": 7, "clock": 0, "via_shm": True})
                assert h.sock.poll(20000)
                frames = h.sock.recv_multipart()
                pulled = decode(frames)  # in frames, not a ticket to a board
                assert "shm" not in pulled.fields and set(pulled.tensors) == {"w", "b"}
                assert not any(t.any() for t in pulled.tensors.values())
                assert not any(_secret_bytes() in f for f in frames)
            finally:
                h.close()
                own.close()

            # job 1's worker still trains through shared memory, from its own weights
            grad = {k: torch.ones_like(v) for k, v in params.items()}
            _, pulled = victim.push_pull(grad, (0,), 1, 0, params)
            assert pulled.versions == (1,) and link.active
            assert not torch.equal(params["w"], SECRET["w"]) and params["w"].isfinite().all()
            victim.bye()
        # and job 2's own same-host worker gets its board
        with PSClient([b], PLAN, 3, timeout=20, heartbeat_interval=0) as mine:
            mine.connect()
            got = {k: torch.empty_like(v) for k, v in SECRET.items()}
            mine.pull(got)
            assert mine.channels[0].shm is not None and mine.channels[0].shm.active
            assert not got["w"].any()
            mine.bye()
        stats = server_stats([b])[0].counters
    assert stats["error_forbidden"] == 3 and stats["shm_peers"] == 2


def test_a_worker_proves_its_segment_again_to_a_restarted_shard(tmp_path, monkeypatch):
    """A shard that restarted knows no segment: the worker's next push through
    shared memory is "not registered", its re-HELLO is challenged and proven
    anew, and it trains on through the new shard's board."""
    monkeypatch.setenv(shm.ENV, "1")
    params = {k: v.clone() for k, v in SECRET.items()}
    with _cluster(tmp_path, mode="async", heartbeat_timeout=60) as cluster:
        (a,) = cluster.start_servers()
        with PSClient([a], PLAN, 0, timeout=30, heartbeat_interval=0) as client:
            client.connect()
            client.initialize(params)
            versions = client.pull(params).versions
            link = client.channels[0].shm
            assert link is not None and link.active and link.board is not None
            before = link.board.seg.name
            old = cluster.servers[0].popen
            old.kill()
            old.wait(10)
            cluster._restart_server(0)  # same address, no checkpoint: empty
            grad = {k: torch.ones_like(v) for k, v in params.items()}
            pushed, pulled = client.push_pull(grad, versions, 1, 0, params)
            assert pushed.accepted and pulled.versions == (1,)
            assert link.active and link.board is not None and link.board.seg.name != before
            assert params["w"].isfinite().all()
            client.bye()
            stats = server_stats([a])[0].counters
    assert stats["shm_peers"] == 1 and stats["shm_pulls"] >= 1 and "error_forbidden" not in stats
