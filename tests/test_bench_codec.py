"""``python -m paramserver.benchmarks.codec`` runs (a smoke run, ``--quick``): its msgspec
mirror of the header reads what the wire writes today, the same Message as decode."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from paramserver.benchmarks import codec
from paramserver.wire.protocol import PROTOCOL_VERSION, Message, Op, encode


def test_quick_run_prints_a_row_per_header(capsys: pytest.CaptureFixture[str]) -> None:
    codec.main(["--quick"])
    out = capsys.readouterr().out
    assert out.startswith(f"protocol {PROTOCOL_VERSION};")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "header" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == list(codec.HEADERS)


def test_the_mirror_speaks_the_wires_version_only() -> None:
    full, struct_only = codec.msgspec_decoder()
    frames = encode(Message(Op.PULL, 5, {"worker": 1, "clock": 2}))
    msg, _ = full(frames)
    assert (msg.op, msg.seq, msg.body.clock) == (Op.PULL, 5, 2)
    head = msgpack.unpackb(frames[0])
    head["v"] = PROTOCOL_VERSION - 1
    with pytest.raises(msgspec.ValidationError, match=r"\$\.v"):
        struct_only([msgpack.packb(head)])
