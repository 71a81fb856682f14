"""Shared-memory pieces without sockets: the board's torn-read guard, segment
checks, descriptors and the sweep of dead owners' segments."""

from __future__ import annotations

import os

import pytest
import torch

from paramserver.errors import ProtocolError
from paramserver.shm import link as shm
from paramserver.wire.protocol import DEFAULT_LIMITS, Message, Op

pytestmark = pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm")


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((1000,), value), "b": torch.full((3, 7), value, dtype=torch.float64)}


def _torn_read(board: shm.WeightBoard, reader: shm.BoardReader,
               attempts: int) -> tuple[int | None, dict[str, torch.Tensor], int]:
    """Read version 1's ticket while the shard publishes versions 2 and 3 between
    the copies of the two tensors of the first attempt (a slow reader overtaken)."""
    ticket = board.publish(_weights(1.0), 1)
    got: dict[str, torch.Tensor] = {}
    calls = 0

    def copy(tensors: dict[str, torch.Tensor]) -> None:
        nonlocal calls
        calls += 1
        got["a"] = tensors["a"].clone()
        if calls == 1:  # the writer overtakes: v2 into the other slot, v3 into ours
            board.before_change(in_place=False)
            board.publish(_weights(2.0), 2)
            board.before_change(in_place=False)
            board.publish(_weights(3.0), 3)
        got["b"] = tensors["b"].clone()

    version = shm.read_guarded(reader, ticket, copy, DEFAULT_LIMITS, attempts=attempts)
    return version, got, calls


def test_guard_redoes_a_copy_overlapped_by_a_write() -> None:
    board = shm.WeightBoard(_weights(0.0), "t0")
    reader = shm.BoardReader(board.seg.name, board.seg.size)
    try:
        version, got, calls = _torn_read(board, reader, attempts=4)
        assert calls == 2  # the first copy was noticed torn and redone
        assert version == 3
        assert torch.equal(got["a"], torch.full((1000,), 3.0))
        assert torch.equal(got["b"], torch.full((3, 7), 3.0, dtype=torch.float64))
    finally:
        reader.close()
        board.close()


def test_without_the_guard_the_same_read_is_torn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scenario above really tears a copy: a reader that trusts the ticket's
    sequence number (no check after the copy) mixes two versions."""
    board = shm.WeightBoard(_weights(0.0), "t1")
    reader = shm.BoardReader(board.seg.name, board.seg.size)
    try:
        ticket_seq = board.publish(_weights(1.0), 1)["seq"]
        board.before_change(in_place=False)
        monkeypatch.setattr(shm.BoardReader, "seq", lambda self, slot: ticket_seq)
        version, got, calls = _torn_read(board, reader, attempts=4)
        assert calls == 1 and version is not None
        assert not torch.equal(got["a"].double().unique(), got["b"].unique())
    finally:
        reader.close()
        board.close()


def test_a_reader_always_overtaken_gives_up() -> None:
    board = shm.WeightBoard(_weights(0.0), "t2")
    reader = shm.BoardReader(board.seg.name, board.seg.size)
    try:
        ticket = board.publish(_weights(1.0), 1)
        n = 0

        def copy(tensors: dict[str, torch.Tensor]) -> None:
            nonlocal n
            n += 1
            for _ in range(2):  # both slots rewritten during every copy
                board.before_change(in_place=False)
                board.publish(_weights(float(n)), 1 + n)

        assert shm.read_guarded(reader, ticket, copy, DEFAULT_LIMITS, attempts=3) is None
        assert n == 3
    finally:
        reader.close()
        board.close()


def test_segments_are_private_and_checked_on_attach(tmp_path) -> None:
    seg = shm.Segment.create("t3", 4096)
    try:
        assert seg.path.stat().st_mode & 0o777 == 0o600
        other = shm.Segment.attach(seg.name, 4096)
        other.close()
        assert seg.path.exists()  # attaching and closing never unlinks the owner's file
        with pytest.raises(OSError):
            shm.Segment.attach(seg.name, 8192)  # smaller than promised
        with pytest.raises(OSError):
            shm.Segment.attach("../etc/passwd", 1)
        seg.path.chmod(0o644)
        with pytest.raises(OSError, match="0600"):
            shm.Segment.attach(seg.name, 1)
    finally:
        seg.close()
    assert not seg.path.exists()


def test_descriptors_are_bounded_by_the_segment() -> None:
    hub = shm.ShmHub(0, DEFAULT_LIMITS)
    grads = shm.GradSegment([("w", 400), ("b", 8)], "t4")
    try:
        assert hub.hello(b"id", 0, {"host": "elsewhere", "seg": grads.seg.name,
                                    "size": grads.seg.size}, True, True, _weights(0)) is None
        offer = {"host": shm.host_identity(), "seg": grads.seg.name, "size": grads.seg.size}
        assert hub.hello(b"id", 0, offer, local=False, trusted=True, params=_weights(0)) is None
        assert hub.hello(b"id", 0, offer, local=True, trusted=False, params=_weights(0)) is None
        challenge = hub.hello(b"id", 0, offer, local=True, trusted=True, params=_weights(0))
        assert challenge is not None and challenge.board is None  # a nonce to prove first
        assert challenge.prove is not None
        grads.seg.put(shm.PROOF_AT, bytes.fromhex(challenge.prove))
        granted = hub.hello(b"id", 0, {**offer, "proved": True}, local=True, trusted=True,
                            params=_weights(0))
        assert granted is not None and granted.board is not None
        descs = grads.write({"w": torch.arange(100.0), "b": torch.tensor([1.0, 2.0])})
        assert descs is not None
        # (a PUSH's other fields: take() reads the typed body, as decode made it)
        head = {"worker": 0, "push_id": 1, "clock": 0, "read_version": 0, "num_samples": 1}
        msg = Message(Op.PUSH, 1, {**head, "shm": descs})
        hub.take(msg, b"id")
        assert torch.equal(msg.tensors["w"], torch.arange(100.0))
        for bad in ([["w", "float32", [100], grads.seg.size]], [["w", "float32", [100], 2]],
                    [["w", "float32", [100], -64]], [["w", "pickle", [1], 0]]):
            with pytest.raises(ProtocolError):
                hub.take(Message(Op.PUSH, 1, {**head, "shm": bad}), b"id")
        with pytest.raises(ProtocolError, match="HELLO"):
            hub.take(Message(Op.PUSH, 1, {**head, "shm": descs}), b"another connection")
        assert grads.write({"unknown": torch.zeros(1)}) is None  # goes over TCP instead
    finally:
        hub.close()
        grads.close()


def test_sweep_removes_only_segments_whose_owner_is_gone() -> None:
    mine = shm.Segment.create("t5", 64)
    pid = os.fork()
    if pid == 0:  # a process that creates a segment and exits without unlinking it
        seg = shm.Segment.create("t6", 64)
        os.write(1, b"")
        del seg
        os._exit(0)
    os.waitpid(pid, 0)
    theirs = [n for n in os.listdir(shm.SHM_DIR) if f".{pid}." in n]
    try:
        assert len(theirs) == 1
        removed = shm.sweep()
        assert theirs[0] in removed and mine.name not in removed
        assert mine.path.exists() and not (shm.SHM_DIR / theirs[0]).exists()
    finally:
        mine.close()
