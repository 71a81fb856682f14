"""The primary's keep-alive thread (paramserver/server/keepalive.py) against a backup
played by this test on a loopback ROUTER socket: the keep-alives arrive, carry the
primary's epoch and the primary's seal, and a refusal naming a higher epoch reaches
the loop once, if a replica of the shard sealed it (a stranger's fences no one)."""

from __future__ import annotations

import time
from typing import Any

import zmq

from paramserver.server.keepalive import KeepAlive
from paramserver.wire import replication as wrepl
from paramserver.wire.replauth import ReplicationKey

SECRET = b"k" * 32


def _receive(sock: zmq.Socket[Any], limit: float = 30.0) -> tuple[bytes, wrepl.Apply]:
    assert sock.poll(int(limit * 1000)), "no keep-alive came"
    identity, *frames = sock.recv_multipart()
    record, rest = wrepl.decode(frames)
    assert isinstance(record, wrepl.Apply) and rest == []
    return identity, record


def test_keep_alives_arrive_and_a_refusal_reaches_the_loop() -> None:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    backup = ctx.socket(zmq.ROUTER)
    backup.setsockopt(zmq.LINGER, 0)
    port = backup.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    keepalive = KeepAlive(ctx, 0.02, 0, ReplicationKey(SECRET, 0, 0))
    mine = ReplicationKey(SECRET, 0, 1)  # the backup's, replica 1
    try:
        keepalive.aim(2, (address,), time.monotonic())
        identity, ping = _receive(backup)
        assert (ping.epoch, ping.seq, ping.kind) == (2, 0, "ping")
        assert keepalive.refusal() is None
        # a refusal without the seal (whoever sent it) is no refusal, nor one sealed
        # with another key, nor a sealed one sent again
        refusal = mine.seal(wrepl.encode(wrepl.Ack(3, 0, False, "a lower epoch")))
        backup.send_multipart([identity, *wrepl.encode(wrepl.Ack(999, 0, False, "x"))])
        backup.send_multipart([identity, *ReplicationKey(b"o" * 32, 0, 1).seal(
            wrepl.encode(wrepl.Ack(998, 0, False, "x")))])
        backup.send_multipart([identity, *refusal])
        deadline = time.monotonic() + 30.0
        while (found := keepalive.refusal()) is None:
            assert time.monotonic() < deadline, "the refusal never reached the loop"
            _receive(backup)
        assert found == (3, address)
        # the backup took over at epoch 3: it refuses the keep-alive, naming it
        backup.send_multipart([identity, *refusal])  # (a replay: refused)
        for _ in range(5):
            _receive(backup)
        assert keepalive.refusal() is None
        backup.send_multipart([identity, *mine.seal(wrepl.encode(wrepl.Ack(
            3, 0, False, "a lower epoch")))])
        deadline = time.monotonic() + 30.0
        while (found := keepalive.refusal()) is None:
            assert time.monotonic() < deadline, "the refusal never reached the loop"
            _receive(backup)  # the thread reads answers at each keep-alive it sends
        assert found == (3, address)
        assert keepalive.refusal() is None  # told once
    finally:
        keepalive.close()
        backup.close(0)
