"""Event records (paramserver/observe/records.py): the only thing an event log writes,
written as they always were, and docs/events.md describing each of them, field by field."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import msgspec
import pytest

from paramserver.observe import records as ev
from paramserver.observe.events import EventLog, encode, read_events

ROOT = Path(__file__).resolve().parent.parent


def _old_line(t: float, kind: str, **fields: Any) -> bytes:
    """How a record was written before the records (json.dumps of the keywords)."""
    return (json.dumps({"t": t, "event": kind, **fields}, separators=(",", ":")) + "\n").encode()


# ---------------------------------------------------------------- one way to write


def _event_log_writes(path: Path) -> list[tuple[int, str]]:
    """Calls ``<...events...>.write(...)`` in a source file that pass a kind's name or
    keyword fields (a dict): (line, source) of each."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "write"):
            continue
        if "events" not in ast.unparse(node.func.value):
            continue
        untyped = (any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                       for a in node.args)
                   or any(k.arg != "t" for k in node.keywords))
        if untyped:
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def test_every_event_log_write_in_the_source_passes_a_record() -> None:
    untyped = []
    # (workers/, cli/ and benchmarks/ are reached through the package's links to them)
    for folder, _, files in os.walk(ROOT / "paramserver", followlinks=True):
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                untyped += [f"{path.relative_to(ROOT)}:{line}: {src}"
                            for line, src in _event_log_writes(path)]
    assert untyped == []


def test_an_event_log_refuses_what_is_not_a_record(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl")
    with pytest.raises(TypeError, match=r"records of paramserver\.observe\.records"):
        log.write("worker_bye")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not dict"):
        log.write({"event": "worker_bye", "shard": 0})  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # no file, no console: refused all the same
        EventLog(None).write({"event": "worker_bye"})  # type: ignore[arg-type]
    class Mine(ev.Event, tag="mine"):  # a kind not declared with the others
        shard: int

    for undeclared in (ev.Event(), Mine(shard=0)):
        with pytest.raises(TypeError, match="no record of"):
            log.write(undeclared)
    log.close()
    assert read_events(tmp_path / "e.jsonl") == []


def test_each_log_declares_every_kind_once() -> None:
    declared = [c for c in vars(ev).values()
                if isinstance(c, type) and issubclass(c, ev.Event) and c is not ev.Event]
    grouped = [c for group in ev.LOGS.values() for c in group]
    assert sorted(c.__name__ for c in grouped) == sorted(c.__name__ for c in declared)
    for group in ev.LOGS.values():
        kinds = [c.__struct_config__.tag for c in group]
        assert len(kinds) == len(set(kinds)) and all(isinstance(k, str) for k in kinds)


# ---------------------------------------------------------------- the bytes, as before


PUSH = dict(shard=0, worker=3, clock=1207, read_version=4810, version=4812, staleness=2,
            accepted=True, weight=1.0, reason="", num_samples=64, loss=0.42,
            grad_norm=1.31, cosine=0.72)


@pytest.mark.parametrize("changes", [
    {},
    {"loss": None, "cosine": None},
    {"grad_norm": 3.1e-05, "loss": 1e16, "weight": 0.0, "cosine": -0.0},
    {"loss": math.nan, "grad_norm": math.inf, "cosine": -math.inf},
    {"reason": "stale: tau=9 > 4 \"quoted\"\n"},
    {"reason": "zu spät \u00e9\u2028", "weight": 9.999e-05},
    {"reason": "\x7f"},
    {"weight": 1, "loss": 123456789012345.67},  # an int where a float is declared
])
def test_a_push_record_is_written_byte_for_byte_as_before(changes: dict[str, Any]) -> None:
    fields = {**PUSH, **changes}
    assert encode(ev.Push(**fields), 1765000000.123456) == \
        _old_line(1765000000.123456, "push", **fields)


def test_records_left_out_fields_maps_and_figures_are_written_as_before() -> None:
    t = 12.5
    dead = ev.WorkerDead(shard=0, worker=1, reported=True, clock=3)
    assert encode(dead, t) == _old_line(t, "worker_dead", shard=0, worker=1, reported=True,
                                        clock=3)
    start = ev.ServerStart(shard=1, address="sim://shard1", config={"lr": 1e-05, "n": None})
    assert encode(start, t) == _old_line(t, "server_start", shard=1, address="sim://shard1",
                                         config={"lr": 1e-05, "n": None})
    step = dict(worker=0, clock=4, read_versions=[3, 3], staleness=1, accepted=False,
                reasons=["stale"], weight=0.0, loss=None, num_samples=8, compute_s=0.01,
                sleep_s=0.0, pull_s=2e-05, push_s=0.003, wait_s=0.0, bytes=4096)
    for figures, local in (({}, {}), ({"acc": 0.5, "lr": 1e-05}, {}),
                           ({"acc": 0.5}, {"local_steps": 4})):
        rec = ev.Step(**step, **local, figures=figures)  # type: ignore[arg-type]
        assert encode(rec, t) == _old_line(t, "step", **step, **local, **figures)
    evaluation = ev.Eval(worker=0, clock=9, versions=[9], figures={"loss": 0.1}, final=True)
    assert encode(evaluation, t) == _old_line(t, "eval", worker=0, clock=9, versions=[9],
                                              loss=0.1, final=True)


# ---------------------------------------------------------------- a simulated run's logs


def test_a_simulated_run_writes_only_declared_well_typed_records(tmp_path: Path) -> None:
    from paramserver.server.loop import ServerConfig
    from paramserver.workers.launch.cluster import ClusterSpec
    from paramserver.workers.launch.virtual import run_simulation
    from paramserver.workers.worker import WorkerConfig

    spec = ClusterSpec(
        num_servers=2, num_workers=2,
        server=ServerConfig(mode="async", expected_workers=2),
        worker=WorkerConfig(servers=[], task="digits-mlp", steps=3, eval_every=2))
    run_simulation(spec, tmp_path)
    logs = sorted((tmp_path / "events").glob("*.jsonl"))
    assert [p.name for p in logs] == ["server0.jsonl", "server1.jsonl", "worker0.jsonl",
                                      "worker1.jsonl"]
    for path in logs:
        group = ev.LOGS["server" if path.name.startswith("server") else "worker"]
        kinds = {c.__struct_config__.tag: c for c in group}
        for line in path.read_text().splitlines():
            raw = json.loads(line)
            cls = kinds[raw.pop("event")]  # a declared kind of this log
            del raw["t"]
            if cls.flat is not None:  # its figures, by name
                raw[cls.flat] = {k: raw.pop(k) for k in list(raw)
                                 if k not in cls.__struct_fields__}
            record = msgspec.convert(raw, cls, strict=True)  # every field of its type
            assert msgspec.to_builtins(record) == {"event": cls.__struct_config__.tag, **raw}


# ---------------------------------------------------------------- docs/events.md

_SECTIONS = {"Shard server": "server", "Worker": "worker", "Launcher": "launcher"}
_TYPE = r"(int|float|bool|string|list|map|true)\b(\?)?"
_PROSE = re.compile(r"((?:`[A-Za-z_]+`(?:,\s+|\s+or\s+|,?\s+and\s+)?)+)\s+" + _TYPE)
_ROW = re.compile(r"^\| ((?:`[A-Za-z_]+`(?:, )?)+) \| ([a-z]+)( of [a-z]+)?(\?)? \|", re.M)
_NAMES = re.compile(r"`([A-Za-z_]+)`")


def _documented() -> dict[str, dict[str, dict[str, str]]]:
    """log -> kind -> field -> type, as docs/events.md says."""
    text = (ROOT / "docs" / "events.md").read_text()
    out: dict[str, dict[str, dict[str, str]]] = {}
    likes: list[tuple[str, list[str], str]] = []
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        log = next((v for k, v in _SECTIONS.items() if title.startswith(k)), None)
        if log is None:
            continue
        kinds = out.setdefault(log, {})
        # a record's paragraph opens with its kind in bold (two kinds: "**`a`** / **`b`**")
        pieces = re.split(r"^((?:\*\*`[a-z_]+`\*\*(?: / )?)+)", body, flags=re.M)
        for heads, para in zip(pieces[1::2], pieces[2::2], strict=True):
            fields: dict[str, str] = {}
            for names, kind, q in _PROSE.findall(para):
                for name in _NAMES.findall(names):
                    fields[name] = kind + q
            for names, kind, _of, q in _ROW.findall(para):
                for name in _NAMES.findall(names):
                    fields[name] = kind + q
            for like in re.findall(r"the\s+fields\s+of\s+(?:the\s+shard's\s+)?`([a-z_]+)`", para):
                likes.append((log, _NAMES.findall(heads), like))
            for kind_name in _NAMES.findall(heads):
                kinds[kind_name] = {**kinds.get(kind_name, {}), **fields}
    for log, heads, like in likes:  # "the fields of `alarm`": the shard's alarm's
        for kind_name in heads:
            out[log][kind_name] = {**out["server"][like], **out[log][kind_name]}
    return out


def _doc_type(tp: Any) -> str:
    """How docs/events.md names a declared field's type."""
    args = [a for a in get_args(tp) if a is not msgspec.UnsetType] \
        if get_origin(tp) in (Union, types.UnionType) else [tp]
    optional = type(None) in args
    (base,) = [a for a in args if a is not type(None)]
    origin = get_origin(base) or base
    name = {int: "int", float: "float", bool: "bool", str: "string", list: "list",
            dict: "map"}[origin]
    return name + ("?" if optional else "")


def test_docs_events_md_describes_every_record_and_nothing_else() -> None:
    documented = _documented()
    problems = []
    for log, group in ev.LOGS.items():
        kinds = documented.get(log, {})
        declared = {c.__struct_config__.tag: c for c in group}
        problems += [f"{log}: `{k}` documented, not declared" for k in set(kinds) - set(declared)]
        for kind, cls in declared.items():
            if kind not in kinds:
                problems.append(f"{log}: `{kind}` not documented")
                continue
            doc = kinds[kind]
            fields = {f.name: f.type for f in msgspec.structs.fields(cls) if f.name != cls.flat}
            for name, tp in fields.items():
                if name not in doc:
                    problems.append(f"{log}: `{kind}`.`{name}` not documented")
                elif doc[name] != _doc_type(tp) and not (doc[name] == "true"
                                                          and _doc_type(tp) == "bool"):
                    problems.append(f"{log}: `{kind}`.`{name}` is {_doc_type(tp)}, "
                                    f"documented {doc[name]}")
            if cls.flat is None:  # (a flat record's other names are its figures')
                problems += [f"{log}: `{kind}`.`{name}` documented, not declared"
                             for name in set(doc) - set(fields)]
    assert problems == []
