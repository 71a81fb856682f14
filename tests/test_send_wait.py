"""A request's send never blocks for good on a peer it cannot reach.

A DEALER blocks a send while it has no pipe to its peer, or while the pipe is
full; either holds as long as the peer cannot be reached. Channel.send gives
up after SEND_WAIT_MS and counts the request as lost, so the request's own
timeout and retries decide (a RequestTimeoutError), as for any peer that
does not answer.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from paramserver.wire.protocol import Message, Op
from paramserver.wire.transport import SEND_WAIT_MS, Channel
from tests.ports import free_port


@pytest.mark.integration
def test_a_send_with_no_connection_is_given_up_not_blocked() -> None:
    ctx = zmq.Context()
    # no pipe before a connection completes, and none ever does (nothing listens)
    ctx.setsockopt(zmq.IMMEDIATE, 1)
    channel = Channel(f"tcp://127.0.0.1:{free_port()}", peer="shard 0", context=ctx)
    sent = threading.Event()

    def send() -> None:
        for _ in range(3):
            channel.send(Message(Op.HEARTBEAT, channel.next_seq(), {"worker": 0}))
        sent.set()

    try:
        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        # each send waits SEND_WAIT_MS at most; a blocked one would never return
        assert sent.wait(3 * SEND_WAIT_MS / 1000 + 10), "a send blocked"
        assert channel.unsent == 3
    finally:
        channel.close()
        ctx.term()
