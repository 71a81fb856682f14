"""Shared pieces of the benchmarks: statistics, sizes, memory readings, child agents.

Every system under test runs in real OS processes. A child process is an
*agent* (``python -m paramserver.benchmarks.agent``): it reads one JSON command per line on
stdin and answers with JSON lines on stdout prefixed ``BENCH`` (an optional
``{"address": ...}`` line when it starts serving, then one result line). An
agent outlives one command, so the worker side of a benchmark pays the cost
of importing torch once per sweep, not once per payload.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from paramserver.errors import ConfigError, ParamServerError, RequestTimeoutError
from paramserver.util.jsontypes import JSON, JSONObject

__all__ = [
    "PREFIX",
    "Agent",
    "AgentError",
    "Announce",
    "FixedSizeSession",
    "Stats",
    "Timing",
    "close_all",
    "cpu_seconds",
    "descendants",
    "flag",
    "format_size",
    "free_port",
    "integer",
    "number",
    "numbers",
    "obj",
    "parse_size",
    "peak_rss",
    "reset_peak_rss",
    "rounds_until_stopped",
    "rss",
    "split_range",
    "strings",
    "text",
]

log = logging.getLogger(__name__)

PREFIX = "BENCH "
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


class AgentError(ParamServerError):
    """A benchmark child process failed; the message carries its stderr tail."""


# An agent's commands and answers are JSON lines, a different shape per op, and
# result.json is read back into records (records.py): open JSON, each value checked
# as it is taken (ValueError: a bug of the writer, or a file edited by hand).
_NO = object()


def _take(d: JSONObject, key: str, default: object) -> JSON:
    if key in d:
        return d[key]
    if default is _NO:
        raise ValueError(f"no {key!r} in {sorted(d)}")
    return default  # type: ignore[return-value]  # the caller's default, of its type


def _wrong(key: str, value: JSON, what: str) -> ValueError:
    return ValueError(f"{key!r} must be {what}, got {value!r}")


def text(d: JSONObject, key: str, default: object = _NO) -> str:
    v = _take(d, key, default)
    if not isinstance(v, str):
        raise _wrong(key, v, "a string")
    return v


def integer(d: JSONObject, key: str, default: object = _NO) -> int:
    v = _take(d, key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _wrong(key, v, "an integer")
    return v


def number(d: JSONObject, key: str, default: object = _NO) -> float:
    v = _take(d, key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _wrong(key, v, "a number")
    return float(v)


def flag(d: JSONObject, key: str, default: bool = False) -> bool:
    v = _take(d, key, default)
    if not isinstance(v, bool):
        raise _wrong(key, v, "true or false")
    return v


def obj(d: JSONObject, key: str, default: object = _NO) -> JSONObject:
    v = _take(d, key, default)
    if not isinstance(v, dict):
        raise _wrong(key, v, "an object")
    return v


def strings(d: JSONObject, key: str) -> list[str]:
    v = _take(d, key, _NO)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _wrong(key, v, "a list of strings")
    return [x for x in v if isinstance(x, str)]


def numbers(d: JSONObject, key: str) -> list[float]:
    v = _take(d, key, _NO)
    if not isinstance(v, list):
        raise _wrong(key, v, "a list of numbers")
    return [number({"": x}, "") for x in v]


class FixedSizeSession:
    """A worker session built for one payload size: ``measure`` times ``one_round``."""

    numel: int

    def one_round(self) -> None:
        raise NotImplementedError

    def measure(self, numel: int, iters: int) -> float:
        """Mean seconds per round over ``iters`` rounds."""
        if numel != self.numel:
            raise ValueError(f"this session moves {self.numel} elements, not {numel}")
        t0 = time.perf_counter()
        for _ in range(iters):
            self.one_round()
        return (time.perf_counter() - t0) / iters


#: how an agent's op sends a line before its answer (e.g. ``{"address": ...}``)
Announce = Callable[[JSONObject], None]


def rounds_until_stopped(one_round: Any, args: JSONObject, announce: Announce,
                         batch: int = 50, on_start: Any = None) -> tuple[int, float]:
    """An async worker's loop: ``args["warmup"]`` rounds (default ``batch``), then
    ``{"running": true}`` announced (the parent starts its window once all are
    running) and ``on_start()`` called, then rounds in batches until
    ``args["stop_file"]`` exists. Returns the rounds after the announcement and
    the seconds they took."""
    stop_file = Path(text(args, "stop_file"))
    for _ in range(integer(args, "warmup", batch)):
        one_round()
    announce({"running": True})
    if on_start is not None:
        on_start()
    rounds, t0 = 0, time.perf_counter()
    while not stop_file.exists():
        for _ in range(batch):
            one_round()
        rounds += batch
    return rounds, time.perf_counter() - t0


@dataclass(frozen=True)
class Stats:
    """Median and spread of repeated measurements."""

    median: float
    lo: float  # minimum
    hi: float  # maximum
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("no measurements")
        vals = sorted(float(v) for v in values)
        if len(vals) >= 2:
            q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
        else:
            q1 = q3 = vals[0]
        return cls(statistics.median(vals), vals[0], vals[-1], q1, q3, len(vals))

    def scaled(self, factor: float) -> Stats:
        """The same measurements times ``factor`` (a negative factor is not allowed)."""
        return Stats(self.median * factor, self.lo * factor, self.hi * factor,
                     self.q1 * factor, self.q3 * factor, self.n)

    @property
    def spread(self) -> float:
        """Relative spread (max - min) / median."""
        return (self.hi - self.lo) / self.median if self.median else 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def to_json(self) -> JSONObject:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "q1": self.q1,
                "q3": self.q3, "n": self.n}

    @classmethod
    def from_json(cls, value: JSON) -> Stats:
        """From :meth:`to_json` (or ``to_dict``)."""
        if not isinstance(value, dict):
            raise ValueError(f"statistics must be an object, got {value!r}")
        return cls(number(value, "median"), number(value, "lo"), number(value, "hi"),
                   number(value, "q1"), number(value, "q3"), integer(value, "n"))


@dataclass(frozen=True)
class Timing:
    """Microseconds per operation over repeats: median [min-max]."""

    median_us: float
    min_us: float
    max_us: float

    @classmethod
    def of_seconds(cls, seconds: Sequence[float]) -> Timing:
        return cls.of_us([s * 1e6 for s in seconds])

    @classmethod
    def of_us(cls, micros: Sequence[float]) -> Timing:
        return cls(statistics.median(micros), min(micros), max(micros))

    def cell(self, digits: int = 2) -> str:
        return f"{self.median_us:.{digits}f} [{self.min_us:.{digits}f}-{self.max_us:.{digits}f}]"

    def to_json(self) -> JSONObject:
        return {"median_us": self.median_us, "min_us": self.min_us, "max_us": self.max_us}


def parse_size(text: str | int) -> int:
    """``"4KiB"`` -> 4096, ``"100MiB"`` -> 104857600 (binary units; plain ints are bytes)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"size {text!r} not understood; write e.g. 1KiB, 64KiB, 16MiB, 100MiB"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 4:
        raise ConfigError(f"a payload needs at least one float32 (4 bytes), got {value}")
    return value


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"


def split_range(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` elements as ``parts`` contiguous ranges, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def free_port() -> int:
    """A TCP port free right now on loopback (for torch's rendezvous, which needs one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time consumed so far by these processes (all their threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / tick


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (a Ray head's own processes, say)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        out.append(p)
        frontier += children.get(p, [])
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def rss() -> int:
    """Resident set size of this process now, in bytes."""
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """Peak resident set size (VmHWM) of this process, in bytes."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    # one compute thread per process: many processes share two cores
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("PARAMSERVER_LOG_LEVEL", "WARNING")
    return env


class Agent:
    """One benchmark child process, driven by JSON commands."""

    def __init__(self, name: str, log_dir: Path | None = None,
                 prefix: Sequence[str] = ()) -> None:
        """``prefix``: a command that runs the agent elsewhere, e.g. ``ip netns exec NS``
        (it must exec the interpreter, so that :attr:`pid` is the agent's)."""
        self.name = name
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._log: IO[bytes] = (log_dir / f"{name}.log").open("w+b")
        else:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "paramserver.benchmarks.agent"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=_child_env(),
        )
        self._buf = b""
        self._exit_sent = False
        self._sel = selectors.DefaultSelector()
        assert self.popen.stdout is not None
        self._sel.register(self.popen.stdout, selectors.EVENT_READ)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def send(self, op: str, **args: Any) -> None:
        assert self.popen.stdin is not None
        self._exit_sent = op == "exit"
        try:
            self.popen.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            self.popen.stdin.flush()
        except BrokenPipeError as exc:
            raise AgentError(f"{self.name} has exited: {self._tail()}") from exc

    def read(self, timeout: float) -> JSONObject:
        """The next ``BENCH`` line as a dict; other stdout lines are logged and skipped."""
        deadline = time.monotonic() + timeout
        assert self.popen.stdout is not None
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                line_text = line.decode(errors="replace")
                if line_text.startswith(PREFIX):
                    data = json.loads(line_text[len(PREFIX):])
                    if not isinstance(data, dict):
                        raise AgentError(f"{self.name}: not a JSON object: {line_text}")
                    if "error" in data:
                        raise AgentError(f"{self.name}: {data['error']}")
                    return data
                log.debug("%s: %s", self.name, line_text)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(f"{self.name} did not answer within {timeout:g}s")
            if self._sel.select(remaining):
                chunk = os.read(self.popen.stdout.fileno(), 1 << 16)
                if not chunk:
                    self.popen.wait()
                    raise AgentError(
                        f"{self.name} exited with code {self.popen.returncode}: {self._tail()}"
                    )
                self._buf += chunk

    def call(self, op: str, timeout: float, **args: Any) -> JSONObject:
        self.send(op, **args)
        return self.read(timeout)

    def _tail(self) -> str:
        try:
            self._log.seek(0)
            text = self._log.read().decode(errors="replace")
        except (OSError, ValueError):
            return "(no log)"
        return "\n".join(text.splitlines()[-15:])

    def close(self, timeout: float = 10.0) -> None:
        """Ask the agent to exit; kill it if it does not."""
        if self.popen.poll() is None:
            try:
                if not self._exit_sent:
                    self.send("exit")
                self.popen.wait(timeout=timeout)
            except (AgentError, subprocess.TimeoutExpired):
                self.popen.kill()
                self.popen.wait()
        self._sel.close()
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


def close_all(agents: Sequence[Agent]) -> None:
    """Close every agent (asked together, so they exit in parallel); failures do not
    stop the others."""
    for agent in agents:
        if agent.popen.poll() is None:
            with contextlib.suppress(AgentError):
                agent.send("exit")
    for agent in agents:
        try:
            agent.close()
        except Exception:  # cleanup must go on
            log.exception("closing %s", agent.name)
