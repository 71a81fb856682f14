"""JSONL event logs: writing, reading and following them."""

from __future__ import annotations

from paramserver.observe.events import EventLog, read_events
from paramserver.observe.recorder import JsonlFollower
from paramserver.observe.records import WorkerStart


def test_event_log_after_a_killed_writer_keeps_every_new_record(tmp_path):
    # a SIGKILLed process leaves half a record; its restarted successor appends to the
    # same file, and its records must neither be lost nor break a follower
    path = tmp_path / "worker1.jsonl"
    path.write_text('{"t":1,"event":"step","loss":1.0}\n{"t":2,"event":"step","lo')
    follower = JsonlFollower(path)
    assert [r["t"] for r in follower.read()] == [1]
    log = EventLog(path)
    log.write(WorkerStart(worker=1, clock=7, seeded=False, steps=None, plan_hash=""))
    log.close()
    assert [r["event"] for r in read_events(path)] == ["step", "worker_start"]
    assert [r["event"] for r in follower.read()] == ["worker_start"]
