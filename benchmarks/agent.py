"""``python -m paramserver.benchmarks.agent``: a benchmark child process driven by JSON lines.

Commands arrive on stdin, one JSON object per line: ``{"op": NAME, ...args}``.
``open`` / ``measure`` / ``close`` (with ``"system": NAME``) drive a session
of one system under test, kept open between commands so that repeats of
different systems can be interleaved; other ops run one function.
Each is answered by exactly one ``BENCH {...}`` result line on stdout (or
``BENCH {"error": ...}``); a serving op first prints ``BENCH {"address": ...}``
once it listens. ``{"op": "exit"}`` or end of input ends the process. Ops are
imported lazily so that an agent for the raw ZeroMQ loop never imports torch.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from paramserver.util.jsontypes import JSONObject

from .common import PREFIX, Announce, integer, text

__all__ = ["OPS", "SESSIONS", "main"]

#: op name -> "module:function"; the function takes (args, announce) and returns a dict
OPS: dict[str, str] = {
    "raw_serve": "paramserver.benchmarks.raw:serve",
    "raw_stop": "paramserver.benchmarks.raw:stop_op",
    "raw_async": "paramserver.benchmarks.raw:async_run",
    "ps_stop": "paramserver.benchmarks.ps:stop_op",
    "ps_serve": "paramserver.benchmarks.ps:serve",
    "ps_async": "paramserver.benchmarks.ps:async_run",
    "overlap": "paramserver.benchmarks.overlap:run",
    "rss": "paramserver.benchmarks.agent:report_rss",
    "ray_serve": "paramserver.benchmarks.rayps:serve",
    "ray_version": "paramserver.benchmarks.rayps:version",
    "ray_stop": "paramserver.benchmarks.rayps:stop",
    "ray_async": "paramserver.benchmarks.rayps:async_run",
}

#: system name -> "module:Class" of its session: Class(args), .measure(numel, iters)
#: -> seconds per round, .close() -> dict. Driven by the ops open / measure / close.
SESSIONS: dict[str, str] = {
    "raw": "paramserver.benchmarks.raw:RawSession",
    "ps": "paramserver.benchmarks.ps:PSSession",
    "rpc": "paramserver.benchmarks.rpc:RPCSession",
    "gloo": "paramserver.benchmarks.gloo:GlooSession",
    "ray": "paramserver.benchmarks.rayps:RaySession",
}


class Session(Protocol):
    """A system's worker session (raw.RawSession, ps.PSSession, ...)."""

    def measure(self, numel: int, iters: int) -> float: ...

    def close(self) -> JSONObject: ...


_open: dict[str, Session] = {}
#: an op: its command's arguments and a way to announce lines -> its answer
Op = Callable[[JSONObject, Announce], JSONObject]


def _emit(data: JSONObject) -> None:
    sys.stdout.write(PREFIX + json.dumps(data) + "\n")
    sys.stdout.flush()


def report_rss(args: JSONObject, announce: Announce) -> JSONObject:
    from .common import peak_rss, rss

    return {"rss": rss(), "peak_rss": peak_rss()}


def _load(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _session_op(op: str, cmd: JSONObject) -> JSONObject:
    system = text(cmd, "system")
    del cmd["system"]
    if op == "open":
        if system not in SESSIONS:
            raise KeyError(f"unknown system {system!r}; known: {', '.join(SESSIONS)}")
        if system in _open:
            _open.pop(system).close()
        _open[system] = _load(SESSIONS[system])(cmd)
        return {"opened": system}
    session = _open.get(system)
    if session is None:
        raise KeyError(f"no open {system} session")
    if op == "measure":
        return {"round_s": session.measure(integer(cmd, "numel"), integer(cmd, "iters"))}
    return _open.pop(system).close()


def _run(op: str, cmd: JSONObject) -> JSONObject:
    if op in ("open", "measure", "close"):
        return _session_op(op, cmd)
    target = OPS.get(op)
    if target is None:
        raise KeyError(f"unknown op {op!r}; known: open, measure, close, {', '.join(OPS)}")
    fn: Op = _load(target)
    return fn(cmd, _emit)


def main() -> None:
    logging.basicConfig(level=os.environ.get("PARAMSERVER_LOG_LEVEL", "WARNING"),
                        stream=sys.stderr,
                        format=f"%(asctime)s agent{os.getpid()} %(levelname)s %(name)s: "
                               "%(message)s")
    for line in sys.stdin:
        if not line.strip():
            continue
        result: JSONObject
        try:
            cmd = json.loads(line)
            if not isinstance(cmd, dict):
                raise ValueError(f"a command is a JSON object, not {line!r}")
            op = text(cmd, "op")
            del cmd["op"]
            if op == "exit":
                break
            result = _run(op, cmd)
        except Exception as exc:  # report to the parent, keep serving commands
            traceback.print_exc(file=sys.stderr)
            result = {"error": f"{type(exc).__name__}: {exc}"}
        _emit(result)


if __name__ == "__main__":
    main()
