"""The typed STATS snapshot (issue 30, item 4): a real shard's record encodes to the
very bytes the free-form map it replaces had, decodes back to the same record, and
a reply out of bounds is refused at the wire."""

from __future__ import annotations

import io
import json
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest
import torch
from click.testing import CliRunner

from paramserver.cli.status import status
from paramserver.core.probe import l2
from paramserver.core.records import STATS_WORKERS
from paramserver.core.sharding import ShardPlan
from paramserver.errors import ProtocolError
from paramserver.server.config import ServerConfig
from paramserver.server.loop import ShardServer
from paramserver.wire.protocol import Message, Op, decode, encode
from paramserver.wire.stats import CoreStats, ShardStats, Unplanned, fields
from paramserver.wire.stats import decode as decode_stats
from paramserver.wire.transport import Channel, SideChannel
from paramserver.workers.admin import server_stats
from paramserver.workers.client import PSClient

# ------------------------------------------------- the map STATS was built as before the record


def _old_core(core: Any) -> dict[str, Any]:
    """paramserver/core/report.py's stats() as it was (a copy, the reference)."""
    live = core.live()
    momentum = core.stepper.momentum
    listed = list(core.workers.values())
    if len(listed) > STATS_WORKERS:
        listed = sorted(listed, key=lambda w: (not (w.live and not w.finished), -w.last_seen)
                        )[:STATS_WORKERS]
    ssp = core.mode.mode == "ssp"
    return {
        "shard": core.config.shard, "mode": core.mode.describe(),
        "policy": core.policy.describe(), "version": core.version,
        "initialized": core.initialized, "started": core.started, "lr": core.lr,
        "lr_scaling": core.stepper.lr_rule.describe(), "lr_factor": core.stepper.lr_factor,
        "momentum_target": momentum.target if momentum is not None else None,
        "momentum_explicit": momentum.explicit if momentum is not None else None,
        "momentum_implicit": momentum.implicit if momentum is not None else None,
        "mean_staleness_estimate": momentum.mean_staleness if momentum is not None else None,
        "live_workers": sorted(w.worker for w in live)[:STATS_WORKERS],
        "live_count": len(live), "min_clock": core.min_clock(), "clock_gap": core.clock_gap(),
        "max_answered_gap": core.max_answered_gap,
        "staleness_bound": core.bound if ssp else None,
        "staleness_bound_max": core.max_bound if ssp else None,
        "pending_pulls": core.pending_pulls(), "rounds_dropped": core.rounds_dropped,
        "steps_refused": core.stepper.refused, "rounds_voided": core.rounds_voided,
        "rounds_in_place": core.round.in_place, "rounds_ahead": core.ahead.committed,
        "ahead_found_busy": core.ahead.found_busy,
        "weight_norm": math.sqrt(sum(l2(p.detach()) ** 2 for p in core.params.values())),
        "workers": {str(w.worker): w.summary() for w in listed},
        "workers_known": len(core.workers), "workers_listed": len(listed),
        "workers_evicted": core.workers_evicted,
    }


def _old_server(server: ShardServer, uptime: float) -> dict[str, Any]:
    """ShardServer.stats() and the observer's summary() as they were (no trimming:
    this shard's reply is far below the bound)."""
    obs = server.observer
    base: dict[str, Any] = {
        "shard": server.config.shard, "num_shards": server.config.num_shards,
        "address": server.address, "uptime": uptime, "counters": dict(server.counters),
        "metrics_port": server.metrics_port, "measured_one_in": server.measure_budget.level,
        "observed": {
            "step": {"update_norm": obs._step.update_norm, "weight_norm": obs._step.weight_norm,
                     "update_ratio": obs._step.update_ratio, "lr": obs._step.lr},
            "workers": {str(w): {k: v for k, v in (
                ("staleness", last.staleness), ("grad_norm", last.grad_norm),
                ("cosine", last.cosine), ("loss", last.loss)) if v is not None}
                for w, last in obs._last.items()},
            "alarms": [a.as_dict() for a in obs.watchdog.alarms[-20:]],
            "alarm_count": len(obs.watchdog.alarms)},
    }
    assert server.core is not None
    base.update(_old_core(server.core))
    for key, row in base["workers"].items():
        row.update(server.peers.get(int(key), {}))
    base["observed"]["workers"] = {k: v for k, v in base["observed"]["workers"].items()
                                   if k in base["workers"]}
    return base


def _packed(value: Any) -> bytes:
    out: bytes = msgpack.packb(value, use_bin_type=True)
    return out


# ------------------------------------------------------------------------- a real shard


@contextmanager
def _shard(**config: Any) -> Iterator[ShardServer]:
    server = ShardServer(ServerConfig.from_dict({"bind": "tcp://127.0.0.1:0", **config}))
    ready = threading.Event()
    thread = threading.Thread(target=server.serve_forever, args=(lambda a: ready.set(),),
                              daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield server
    finally:
        server.stop()
        thread.join(30)


def _train(address: str, workers: int = 2, steps: int = 3) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    plan = ShardPlan.from_module(model, 1)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    clients = [PSClient([address], plan, w, timeout=30, shm=False) for w in range(workers)]
    try:
        clocks = [c.connect() for c in clients]
        clients[0].initialize(params)
        for step in range(steps):
            for w, c in enumerate(clients):
                versions = c.pull(params, clocks[w] + step).versions
                grads = {n: torch.full_like(p, 0.1 * (w + 1)) for n, p in params.items()}
                assert c.push(grads, versions, 4, clocks[w] + step,
                              loss=1.0 / (step + 1)).accepted
    finally:
        for c in clients:
            c.close()


def test_a_real_shards_record_encodes_to_the_old_maps_bytes() -> None:
    with _shard(mode="ssp", staleness_bound=2, momentum_target=0.5) as server:
        _train(server.address)
        record = server.stats()
        assert isinstance(record.core, CoreStats)
        assert record.figures is not None and record.figures.workers_listed == 2
        old = _old_server(server, record.uptime)
        new = fields(record)
        assert list(new) == list(old) and new == old
        # byte for byte, but for each worker's last-push figures: the old map kept them in
        # the order first seen (a cosine after the loss), the record in its fields' order
        for key in new:
            if key != "observed":
                assert _packed(new[key]) == _packed(old[key]), key
        for key in ("step", "alarms", "alarm_count"):
            assert _packed(new["observed"][key]) == _packed(old["observed"][key]), key
        # what a STATS request gets back over the socket decodes to the record's figures
        (over_wire,) = server_stats([server.address])
        assert isinstance(over_wire, ShardStats)
        assert over_wire.version == record.version and over_wire.workers.keys() == {"0", "1"}
        assert over_wire.workers["1"].pid is not None
        assert over_wire.observed.workers["0"].loss == pytest.approx(1 / 3)
        assert over_wire.figures is not None and over_wire.figures.staleness_bound == 2


def test_an_unplanned_shard_reports_the_same_few_keys() -> None:
    with _shard(mode="sync") as server:
        record = server.stats()
        assert isinstance(record.core, Unplanned)
        assert (record.version, record.workers, record.initialized) == (0, {}, False)
        new = fields(record)
        assert list(new)[8:] == ["mode", "version", "workers", "initialized", "policy"]
        frames = encode(Message(Op.REPLY, 1, {"re": "stats", **new}))
        back = decode([bytes(f) for f in frames]).body
        assert back == record and back.figures is None and back.mode == "sync"


def test_a_stats_reply_out_of_bounds_is_refused_at_the_wire() -> None:
    with _shard() as server:
        _train(server.address, workers=1, steps=1)
        good = fields(server.stats())
    started = time.monotonic()
    assert decode_stats(good).to_dict() == {"re": "stats", **good}
    bad_worker = {**good["workers"]["0"], "clock": -1}
    alarm = {"signal": "s", "shard": 0, "worker": None, "version": 1, "figures": {"x": 1.5},
             "message": "m"}
    assert len(decode_stats({**good, "observed": {**good["observed"], "alarms": [alarm] * 20}}
                            ).observed.alarms) == 20
    for bad in ({**good, "version": -3}, {**good, "workers": {"0": bad_worker}},
                {**good, "observed": {**good["observed"], "alarms": [alarm] * 21}},
                {**good, "observed": {**good["observed"], "workers": {
                    str(w): {"staleness": 0} for w in range(STATS_WORKERS + 1)}}},
                {**good, "mode": 7}):
        with pytest.raises(ProtocolError, match="stats reply"):
            decode_stats(bad)
    assert time.monotonic() - started < 5


def test_status_json_prints_the_reply_map_as_before() -> None:
    """``paramserver status --json``: the STATS reply's map as the wire carried it
    (``re`` first, then every key in its order), as when it printed the raw fields."""
    with _shard(mode="ssp", staleness_bound=1) as server:
        _train(server.address, workers=2, steps=2)
        channel: Channel[SideChannel] = Channel(server.address, peer="shard 0")
        try:
            raw = channel.request(Message(Op.STATS), 10).fields  # what status printed
        finally:
            channel.close()
        result = CliRunner().invoke(status, ["--servers", server.address, "--json"])
    assert result.exit_code == 0, result.output
    (printed,) = json.loads(result.stdout)
    assert list(printed) == list(raw) and printed["re"] == "stats"
    moving = ("uptime", "counters")  # a second STATS: later, one more message counted
    assert {k: v for k, v in printed.items() if k not in moving} == \
        json.loads(json.dumps({k: v for k, v in raw.items() if k not in moving}))


def test_launch_shows_one_line_per_alarm_episode() -> None:
    """The launcher's alarm lines read the alarm's record: the same loss episode seen
    by two shards is one line, another episode or signal another."""
    from rich.console import Console

    from paramserver.cli.launch import _AlarmLines

    out = Console(file=io.StringIO(), width=200, color_system=None)
    lines = _AlarmLines(out)

    def event(shard: int, signal: str, episode: int) -> dict[str, Any]:
        return {"t": 1.0, "event": "alarm", "process": f"server{shard}", "signal": signal,
                "shard": shard, "worker": None, "version": 40 + shard,
                "figures": {"loss": 2.5, "episode": episode},
                "message": f"[{signal}] shard {shard}: episode {episode}"}

    for e in (event(0, "loss_stalled", 1), event(1, "loss_stalled", 1),
              event(1, "loss_stalled", 2), event(0, "loss_rising", 1)):
        lines(e)
    text = out.file.getvalue()
    assert text.count("ALARM") == 3, text
    assert "shard 0: episode 1" in text and "shard 1: episode 1" not in text
    assert "shard 1: episode 2" in text and "[loss_rising] shard 0" in text
