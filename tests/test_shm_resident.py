"""The weights living in the shard's board (no sockets): no copy per publication,
the seqlock bracket around every change, the copy-before-change of an async
shard, and moving out for a zero-copy TCP reply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paramserver.shm import board
from paramserver.shm import link as shm
from paramserver.util.flat import FlatLayout
from paramserver.wire.protocol import DEFAULT_LIMITS

pytestmark = pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm")


class Shard:
    """A shard's flat weights (two dtypes), an optimizer on them and its board."""

    def __init__(self, tag: str) -> None:
        self.layout = FlatLayout([("a", 1000, torch.float32), ("b", 21, torch.float64),
                                  ("c", 40, torch.float32)])
        self.flats, self.params = self.layout.zeros()
        for key, p in self.params.items():
            p.fill_(float(len(key)))
        self.opt = torch.optim.SGD(list(self.flats.values()), lr=1.0)
        self.board = shm.WeightBoard(self.params, tag, self.flats, self.layout)
        self.reader = shm.BoardReader(self.board.seg.name, self.board.seg.size)
        self.version = 0

    def step(self, in_place: bool) -> None:
        """One optimizer step (every weight - 1), bracketed as the server does."""
        self.board.before_change(in_place)
        for f in self.flats.values():
            f.grad = torch.ones_like(f)
        self.opt.step()
        self.version += 1
        self.board.after_change(self.version)

    def read(self, ticket: dict, copy=None) -> tuple[int | None, dict[str, torch.Tensor]]:
        got: dict[str, torch.Tensor] = {}

        def take(tensors: dict[str, torch.Tensor]) -> None:
            got.update({k: t.clone() for k, t in tensors.items()})
            if copy is not None:
                copy()

        return shm.read_guarded(self.reader, ticket, take, DEFAULT_LIMITS), got

    def close(self) -> None:
        self.reader.close()
        self.board.close()


@pytest.fixture
def shard(request: pytest.FixtureRequest):
    s = Shard(f"r{abs(hash(request.node.name)) % 10**6}")
    yield s
    s.close()


def _in_slot(shard: Shard, slot: int) -> bool:
    return shard.board.home() == slot and all(
        f.data_ptr() == shard.board._slot_flat(slot, d).data_ptr()
        for d, f in shard.flats.items())


def test_the_weights_move_into_the_board_with_their_values(shard: Shard) -> None:
    assert _in_slot(shard, 0)
    for key, p in shard.params.items():  # the slice views moved with their buffer
        assert torch.equal(p, torch.full_like(p, float(len(key))))
        assert p.untyped_storage().data_ptr() == shard.flats[p.dtype].untyped_storage().data_ptr()
    ticket = shard.board.publish(shard.params, 0)
    assert ticket["slot"] == 0
    version, got = shard.read(ticket)
    assert version == 0 and torch.equal(got["a"], torch.full((1000,), 1.0))


def test_a_sync_step_changes_the_slot_in_place_under_its_seqlock(shard: Shard) -> None:
    ticket = shard.board.publish(shard.params, 0)
    before = shard.board.seg.data.clone()
    shard.board.before_change(in_place=True)
    assert shard.reader.seq(0) % 2 == 1  # odd while the step writes
    # a reader overlapping the step never trusts the slot: every attempt fails
    assert shard.read(ticket)[0] is None
    for f in shard.flats.values():
        f.grad = torch.ones_like(f)
    shard.opt.step()
    shard.board.after_change(1)
    assert _in_slot(shard, 0)  # no second copy was made
    slot1 = slice(board.HEADER + shard.board.slot_bytes, None)
    assert torch.equal(shard.board.seg.data[slot1], before[slot1])  # slot 1 never written
    new = shard.board.publish(shard.params, 1)
    assert new["slot"] == 0 and new["version"] == 1 and new["seq"] % 2 == 0
    version, got = shard.read(new)
    assert version == 1 and torch.equal(got["a"], torch.zeros(1000))
    assert torch.equal(got["b"], torch.zeros((21,), dtype=torch.float64))


def test_an_async_step_keeps_the_handed_out_version_readable(shard: Shard) -> None:
    ticket = shard.board.publish(shard.params, 0)  # handed out: a reader may copy it now
    step_during_copy = [True]

    def copy() -> None:  # the shard steps while the reader copies
        if step_during_copy.pop() if step_during_copy else False:
            shard.step(in_place=False)

    version, got = shard.read(ticket, copy)
    assert version == 0  # the copy was of version 0 and was not overwritten
    assert torch.equal(got["a"], torch.full((1000,), 1.0))
    assert _in_slot(shard, 1)  # the weights moved to the other slot and stepped there
    assert torch.equal(shard.params["a"], torch.zeros(1000))
    # not handed out since: the next change is in place
    shard.step(in_place=False)
    assert _in_slot(shard, 1)
    version, got = shard.read(shard.board.publish(shard.params, shard.version))
    assert version == 2 and torch.equal(got["c"], torch.full((40,), -1.0))


def test_moving_out_for_tcp_then_back_in_on_the_next_publication(shard: Shard) -> None:
    shard.board.publish(shard.params, 0)
    shard.board.before_change(in_place=True)  # a bracket left open (a seeding, say)
    shard.board.moving_out(0)
    assert shard.reader.seq(0) % 2 == 0  # closed: the slot it leaves stays readable
    shard.layout.rebind(shard.flats, shard.params)  # the core's copy-on-write
    assert shard.board.home() is None
    lent = shard.board.seg.data.clone()  # slot 0, which a TCP send would no longer read
    shard.board.before_change(in_place=True)  # not in the board: nothing to bracket
    for f in shard.flats.values():
        f.grad = torch.ones_like(f)
    shard.opt.step()
    ticket = shard.board.publish(shard.params, 1)
    assert ticket["slot"] == 1 and _in_slot(shard, 1)  # copied in, and living there
    version, got = shard.read(ticket)
    assert version == 1 and torch.equal(got["a"], torch.zeros(1000))
    slot0 = slice(board.HEADER, board.HEADER + shard.board.slot_bytes)
    assert torch.equal(shard.board.seg.data[slot0], lent[slot0])  # the step was not there


def _mapped_kib(address: int) -> int:
    """Resident KiB of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_release_unmaps_used_gradient_pages_and_keeps_their_data() -> None:
    worker = shm.Segment.create("relw", 8 << 20)
    shard = shm.Segment.attach(worker.name, 8 << 20)
    hub = shm.ShmHub(0, DEFAULT_LIMITS)
    hub.peers[b"w"] = shm._Peer(0, shard)
    try:
        worker.region(0, torch.float32, (2 << 20,)).copy_(torch.arange(2 << 20,
                                                                       dtype=torch.float32))
        tensors = {"a": shard.region(0, torch.float32, (1 << 20,)),
                   "b": shard.region(4 << 20, torch.float32, (1 << 20,))}
        total = sum(float(t.sum()) for t in tensors.values())  # the shard reads them
        assert _mapped_kib(shard.data.data_ptr()) >= (8 << 10) - 8  # all 8 MiB
        hub.release(b"w", tensors)
        assert _mapped_kib(shard.data.data_ptr()) <= 8
        assert sum(float(t.sum()) for t in tensors.values()) == total  # read again: intact
        hub.release(b"nobody", tensors)  # an unknown peer: nothing to do
    finally:
        hub.peers.clear()
        shard.close()
        worker.close()


def test_next_weights_written_ahead_into_the_other_slot(shard: Shard) -> None:
    """A lone round's next weights go into the slot the weights do not live in,
    opened in its seqlock (a reader of an old ticket for it retries elsewhere);
    the weights published meanwhile stay readable; committing adopts that slot."""
    ticket = shard.board.publish(shard.params, 0)
    nxt = shard.board.begin_ahead()
    assert nxt is not None and shard.board.ahead == 1
    assert shard.board.begin_ahead() is None  # one at a time
    assert shard.reader.seq(1) & 1
    for dtype, flat in nxt.items():
        torch.sub(shard.flats[dtype], 1.0, out=flat)
    version, got = shard.read(ticket)  # version 0, untouched, still readable
    assert version == 0 and torch.equal(got["a"], torch.full((1000,), 1.0))
    assert shard.board.commit_ahead(1)
    assert _in_slot(shard, 1) and shard.reader.current() == 1
    assert not shard.reader.seq(1) & 1 and shard.reader.version(1) == 1
    assert torch.equal(shard.params["a"], torch.zeros(1000))
    version, got = shard.read(shard.board.publish(shard.params, 1))
    assert version == 1 and torch.equal(got["b"], torch.zeros(21, dtype=torch.float64))


@pytest.mark.parametrize("by", ["drop", "publish", "before_change", "moving_out"])
def test_a_slot_opened_ahead_and_dropped_holds_no_version(shard: Shard, by: str) -> None:
    """Dropped (by the round, or by any other change of the board first), the slot
    is closed again (even sequence) marked as holding no version; the weights stay
    where they were and a commit after that is refused."""
    shard.board.publish(shard.params, 0)
    nxt = shard.board.begin_ahead()
    assert nxt is not None
    for flat in nxt.values():
        flat.fill_(float("nan"))
    if by == "drop":
        shard.board.drop_ahead()
    elif by == "publish":
        shard.board.ticket = None
        shard.board.publish(shard.params, 0)
    elif by == "before_change":
        shard.step(in_place=True)
    else:
        shard.board.moving_out(0)
    assert shard.board.ahead is None and not shard.reader.seq(1) & 1
    assert shard.reader.version(1) == -1
    assert not shard.board.commit_ahead(5)
    assert not any(torch.isnan(p).any() for p in shard.params.values())
