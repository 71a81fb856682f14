"""peerprobe.refused: a dead process's port is refused, a live one's or an address
out of reach is not (the primary keeps waiting for a backup it cannot prove dead)."""

from __future__ import annotations

import socket

from paramserver.server.peerprobe import refused


def test_a_port_nobody_listens_on_is_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: the host refuses it
        assert refused(f"tcp://127.0.0.1:{port}", 1.0)


def test_a_listening_port_is_not_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not refused(f"tcp://127.0.0.1:{sock.getsockname()[1]}", 1.0)


def test_what_is_not_a_tcp_address_is_not_refused() -> None:
    assert not refused("ipc:///tmp/nothing-here", 1.0)
    assert not refused("tcp://127.0.0.1:notaport", 1.0)
    assert not refused("tcp://no-such-host.invalid:5000", 1.0)
