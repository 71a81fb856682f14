"""The console's lines (paramserver/observe/console.py): each event record it shows
renders as one line, the others as none; an EventLog shows its console the records
it writes, with or without a file."""

from __future__ import annotations

import io
from pathlib import Path

from paramserver.observe.console import CONSOLE_EVENTS, Console, Progress, render
from paramserver.observe.events import EventLog, read_events
from paramserver.observe.records import Push, WorkerBye


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
    log.write(WorkerBye(shard=0, worker=3, clock=12))
    log.write(Push(shard=0, worker=3, clock=12, read_version=0, version=1, staleness=1,
                   accepted=True, weight=1.0, reason="", num_samples=1, loss=None,
                   grad_norm=None, cosine=None))
    log.close()
    (line,) = out.getvalue().splitlines()
    assert line.startswith("paramserver: ") and line.endswith(" worker 3 finished at clock 12")
    assert [r["event"] for r in read_events(tmp_path / "e.jsonl")] == ["worker_bye", "push"]
    # no file: the console still hears it
    lines: list[str] = []
    EventLog(None, console=Console(lines.append)).write(WorkerBye(shard=0, worker=1, clock=2))
    assert lines == ["worker 1 finished at clock 2"]


def _step(worker: int, clock: int, loss: float) -> dict[str, object]:
    return {"worker": worker, "clock": clock, "loss": loss}


def test_progress_off_a_terminal_is_a_line_every_few_seconds() -> None:
    out = io.StringIO()  # not a terminal
    progress = Progress(out, every=5.0)
    assert not progress.live
    for i in range(1, 31):  # 30 steps, 0.5 s apart: the rate from step 1, a line 5 s on
        progress.show("step", _step(0, i, 1.0 / i), 100.0 + 0.5 * i)
    progress.show("worker_end", {"worker": 0}, 116.0)
    lines = [line.split(" ", 2)[2] for line in out.getvalue().splitlines()]
    assert lines == ["worker 0: step 11 (clock 11), loss 0.09091, 2.0 steps/s",
                     "worker 0: step 21 (clock 21), loss 0.04762, 2.0 steps/s"]


def test_progress_on_a_terminal_is_one_live_line() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    progress = Progress(out, every=5.0, tty_every=1.0)
    assert progress.live
    for i in range(1, 6):
        progress.show("step", _step(1, i, 0.5), 10.0 + i)
    progress.show("worker_end", {"worker": 1}, 16.0)
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 4 and text.endswith("steps/s\n")
    assert "\n" not in text[:-1]  # rewritten in place, ended once
