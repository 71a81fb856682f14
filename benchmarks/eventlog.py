"""``python -m paramserver.benchmarks.eventlog``: the cost of a shard's ``push`` record.

A shard writes one ``push`` record per push it decides on, in its message loop.
This times that write as the shard makes it (:class:`~paramserver.observe.records.Push`
built, :meth:`~paramserver.observe.events.EventLog.write`) against the way it was
written before the records (``json.dumps`` of the keyword arguments, the line
written to a text file), both to a file, in three cases: every field a plain
number (``plain``), no loss and no cosine (``nulls``: the record's floats are
checked for NaN), and a gradient norm below 1e-4 (``tiny``: written by json.dumps,
as msgspec would print it otherwise). Prints the median seconds per record of
each and the ratio old / new (above 1: the records are faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from paramserver.observe.events import EventLog
from paramserver.observe.records import Push

__all__ = ["CASES", "main", "measure"]

_BASE: dict[str, Any] = dict(
    shard=0, worker=3, clock=1207, read_version=4810, version=4812, staleness=2,
    accepted=True, weight=1.0, reason="", num_samples=64, loss=0.4213958740234375,
    grad_norm=1.3077394962310791, cosine=0.7210659384727478)

CASES: dict[str, dict[str, Any]] = {
    "plain": _BASE,
    "nulls": {**_BASE, "loss": None, "cosine": None},
    "tiny": {**_BASE, "grad_norm": 3.1e-05},
}


class _JsonLog:
    """The push record's write before the records: json.dumps of the keywords."""

    def __init__(self, path: Path) -> None:
        self._fh = path.open("a", encoding="utf-8")
        self._last_flush = 0.0

    def write(self, event: str, **fields: Any) -> None:
        now = time.time()
        self._fh.write(json.dumps({"t": now, "event": event, **fields},
                                  separators=(",", ":")) + "\n")
        if now - self._last_flush >= 0.5:
            self._fh.flush()
            self._last_flush = now

    def close(self) -> None:
        self._fh.close()


def measure(case: str, records: int = 20000, repeats: int = 7) -> tuple[float, float]:
    """Median seconds per record: (before the records, with them)."""
    f = CASES[case]
    old_times, new_times = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            old = _JsonLog(Path(tmp) / f"old{r}.jsonl")
            t0 = time.perf_counter()
            for _ in range(records):
                old.write("push", shard=f["shard"], worker=f["worker"], clock=f["clock"],
                          read_version=f["read_version"], version=f["version"],
                          staleness=f["staleness"], accepted=f["accepted"],
                          weight=f["weight"], reason=f["reason"],
                          num_samples=f["num_samples"], loss=f["loss"],
                          grad_norm=f["grad_norm"], cosine=f["cosine"])
            old_times.append((time.perf_counter() - t0) / records)
            old.close()
            new = EventLog(Path(tmp) / f"new{r}.jsonl")
            t0 = time.perf_counter()
            for _ in range(records):
                new.write(Push(shard=f["shard"], worker=f["worker"], clock=f["clock"],
                               read_version=f["read_version"], version=f["version"],
                               staleness=f["staleness"], accepted=f["accepted"],
                               weight=f["weight"], reason=f["reason"],
                               num_samples=f["num_samples"], loss=f["loss"],
                               grad_norm=f["grad_norm"], cosine=f["cosine"]))
            new_times.append((time.perf_counter() - t0) / records)
            new.close()
    return statistics.median(old_times), statistics.median(new_times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    for case in CASES:
        old, new = measure(case, args.records, args.repeats)
        print(f"{case:6s} json.dumps {old * 1e6:6.2f} us   record {new * 1e6:6.2f} us   "
              f"old/new {old / new:.2f}")


if __name__ == "__main__":
    main()
