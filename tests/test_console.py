"""The console's lines (paramserver/observe/console.py): each event record it shows
renders as one line, the others as none; an EventLog shows its console the records
it writes, with or without a file."""

from __future__ import annotations

import io
from pathlib import Path

from paramserver.observe.console import CONSOLE_EVENTS, Console, render
from paramserver.observe.events import EventLog, read_events


def test_each_story_event_renders_as_one_line() -> None:
    assert render("training_start", {"shard": 0, "mode": "sync", "workers": [0, 1],
                                     "version": 0}) == \
        "training started: 2 worker(s) (0, 1), sync, at version 0"
    assert render("worker_back", {"shard": 0, "worker": 2, "from_clock": 7, "clock": 9}) == (
        "worker 2 heartbeats again after it was declared dead: rejoined at clock 7 -> "
        "resumes at 9, the slowest live worker's clock")
    assert render("worker_hello", {"worker": 1, "clock": 7, "from_clock": 7,
                                   "joined": "back"}) == "worker 1 came back: rejoined at clock 7"
    assert render("worker_dead", {"worker": 1, "clock": 3, "reported": True}) == \
        "worker 1 dead at clock 3: its supervisor saw the process die"
    assert render("all_done", {"version": 40, "seconds": 2.25, "finished": [0, 2],
                               "dead": [1]}) == (
        "no live worker left at version 40 after 2.2s of training: finished 0, 2; dead 1 "
        "(a restarted one rejoins)")
    assert render("checkpoint_refused", {"version": 5, "error": "NaN"}) == \
        "checkpoint at version 5 NOT written (the last good one stays): NaN"


def test_records_it_does_not_show_or_cannot_read_render_as_nothing() -> None:
    assert render("push", {"worker": 0}) is None
    assert render("worker_hello", {"worker": 0, "clock": 0, "joined": "again"}) is None
    assert render("worker_dead", {}) is None  # a record missing its fields: no line, no crash
    assert "push" not in CONSOLE_EVENTS and "all_done" in CONSOLE_EVENTS


def test_an_event_log_shows_its_console_what_it_writes(tmp_path: Path) -> None:
    out = io.StringIO()
    log = EventLog(tmp_path / "e.jsonl", console=Console.to_stream(out))
    log.write("worker_bye", shard=0, worker=3, clock=12)
    log.write("push", shard=0, worker=3)
    log.close()
    (line,) = out.getvalue().splitlines()
    assert line.startswith("paramserver: ") and line.endswith(" worker 3 finished at clock 12")
    assert [r["event"] for r in read_events(tmp_path / "e.jsonl")] == ["worker_bye", "push"]
    # no file: the console still hears it
    lines: list[str] = []
    EventLog(None, console=Console(lines.append)).write("worker_bye", shard=0, worker=1,
                                                        clock=2)
    assert lines == ["worker 1 finished at clock 2"]
