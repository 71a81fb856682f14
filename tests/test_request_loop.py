"""request_all's lean loop (distinct channels, one request each, no window) and its
general one (requests pipelined on a channel) match replies, drop stale ones, retry and
ask for patience alike; a request's patience is made only when a timeout passes, with
the request's start."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from paramserver.errors import BadRequestError, RequestTimeoutError
from paramserver.wire.protocol import Message, Op, decode, error_reply, reply
from paramserver.wire.retry import Retry
from paramserver.wire.transport import Channel, Fanout, RouterSocket, request_all

#: what a fake shard does with the n-th request it gets (counted from 0): the replies
#: to send, each built from the request
Script = Callable[[int, Message], list[Message]]


class _Shard:
    """A shard that answers as its script says, from a thread of its own."""

    def __init__(self, script: Script) -> None:
        self.socket = RouterSocket("tcp://127.0.0.1:0")
        self.script, self.seen = script, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self.socket.recv(20)
            if got is None:
                continue
            identity, frames = got
            req = decode(frames)
            for rep in self.script(self.seen, req):
                self.socket.send(identity, rep)
            self.seen += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.socket.close()


@pytest.fixture
def shards() -> Iterator[Callable[[Script], tuple[_Shard, Channel]]]:
    made: list[tuple[_Shard, Channel]] = []

    def make(script: Script) -> tuple[_Shard, Channel]:
        shard = _Shard(script)
        made.append((shard, Channel(shard.socket.address, peer=f"shard {len(made)}")))
        return made[-1]

    yield make
    for shard, ch in made:
        ch.close()
        shard.close()


def _beat() -> Message:
    return Message(Op.HEARTBEAT, 0, {"worker": 1})


def _stale_first(n: int, req: Message) -> list[Message]:
    # an answer to an older request (another seq) before the right one
    return [Message(Op.REPLY, req.seq + 1000, {"re": "heartbeat"}), reply(req, n=n)]


def test_both_loops_match_replies_and_drop_stale_ones(shards) -> None:  # type: ignore[no-untyped-def]
    (_, a), (_, b) = shards(_stale_first), shards(_stale_first)
    assert Fanout.of([a, b]) is not None and Fanout.of([a, a]) is None
    seen: list[int] = []
    lean = request_all([a, b], [_beat(), _beat()], 5.0, on_reply=lambda i, r: seen.append(i))
    assert [r.seq for r in lean] == [a._seq, b._seq] and sorted(seen) == [0, 1]
    assert [r["n"] for r in lean] == [0, 0]
    fan = Fanout([a, b])  # made once, as a client does for its shards
    again = request_all([a, b], [_beat(), _beat()], 5.0, fanout=fan)
    assert [r["n"] for r in again] == [1, 1]
    general = request_all([a, a, b], [_beat(), _beat(), _beat()], 5.0)  # pipelined on a
    assert [r["n"] for r in general] == [2, 3, 2]
    assert general[0].seq < general[1].seq


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_error_reply_raises_or_is_returned(shards, pipelined: bool) -> None:  # type: ignore[no-untyped-def]
    _, a = shards(lambda n, req: [error_reply(req.seq, "unknown_op", "no such op")])
    chans = [a, a] if pipelined else [a]
    with pytest.raises(BadRequestError):
        request_all(chans, [_beat() for _ in chans], 5.0)
    got = request_all(chans, [_beat() for _ in chans], 5.0, raise_errors=False)
    assert [r.op for r in got] == [Op.ERROR] * len(chans)


@pytest.mark.parametrize("pipelined", [False, True])
def test_patience_is_made_once_a_timeout_passes_with_the_requests_start(  # type: ignore[no-untyped-def]
        shards, pipelined: bool) -> None:
    # the first copy of each request goes unanswered; a copy sent again is answered
    _, a = shards(lambda n, req: [] if n < (2 if pipelined else 1) else [reply(req)])
    made: list[float] = []
    judged: list[list[int]] = []

    def judge(lost: list[int]) -> bool:
        judged.append(lost)
        return True  # send them again

    def patience_from(started: float) -> Callable[[list[int]], bool]:
        made.append(started)
        return judge

    chans = [a, a] if pipelined else [a]
    before = time.monotonic()
    got = request_all(chans, [_beat() for _ in chans], Retry(0.2, patience_from=patience_from))
    assert len(got) == len(chans)
    assert len(made) == 1 and before <= made[0] <= before + 0.15
    assert judged == [list(range(len(chans)))]
    # answered in time: no patience is made
    made.clear()
    request_all(chans, [_beat() for _ in chans], Retry(5.0, patience_from=patience_from))
    assert made == []


@pytest.mark.parametrize("pipelined", [False, True])
def test_without_patience_retries_then_names_who_did_not_answer(  # type: ignore[no-untyped-def]
        shards, pipelined: bool) -> None:
    shard, a = shards(lambda n, req: [])
    chans = [a, a] if pipelined else [a]
    with pytest.raises(RequestTimeoutError, match=r"no reply within 0\.3s from shard 0"):
        request_all(chans, [_beat() for _ in chans],
                    Retry(0.1, retries=2, patience_from=lambda started: None))
    time.sleep(0.1)
    assert shard.seen == 3 * len(chans)  # sent, then sent again twice


def test_a_held_pull_does_not_keep_a_lost_bye_behind_it_from_being_sent_again(  # type: ignore[no-untyped-def]
        shards) -> None:
    # a final PULL and the BYE pipelined behind it (workers/finish.py): the shard holds
    # the pull until that BYE, and the first BYE is lost on the way. The judge says the
    # shard holds our pull (do not send it again); the BYE, which no shard ever holds,
    # goes again anyway, or both sides wait for each other for good
    held: list[Message] = []
    lost: list[Message] = []

    def script(n: int, req: Message) -> list[Message]:
        if req.op is Op.PULL:
            held.append(req)
            return []
        if not lost:
            lost.append(req)
            return []
        return [reply(held[0]), reply(req)]

    _, a = shards(script)
    calls: list[list[int]] = []

    def judge(unanswered: list[int]) -> bool:
        calls.append(unanswered)
        if len(calls) > 20:
            raise RequestTimeoutError("the BYE was never sent again")
        return False  # "shard 0 is alive and holding your pull"

    msgs = [Message(Op.PULL, 0, {"worker": 1, "clock": 0, "observer": True, "final": True}),
            Message(Op.BYE, 0, {"worker": 1})]
    got = request_all([a, a], msgs, Retry(0.1, patience=judge))
    assert [r.seq for r in got] == [m.seq for m in msgs]
    assert len(held) == 1  # the held pull itself was not sent again
