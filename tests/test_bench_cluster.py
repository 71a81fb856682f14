"""The cluster part of the bench: the sync round on N worker and N server hosts
(network namespaces on a bridge, shaped NICs) against gloo and raw pyzmq.

Needs root, iproute2 and tc (skipped otherwise), except the tests of the skip and
of the refusals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from paramserver.benchmarks.cluster import limits, run_cluster
from paramserver.benchmarks.records import BenchResult, ClusterResult
from paramserver.benchmarks.report import markdown
from paramserver.cli.bench import bench
from paramserver.workers.launch.netcluster import (
    EmulatedCluster,
    existing_links,
    existing_namespaces,
    netns_problem,
)


def test_the_limits_are_m_over_b_and_the_rings() -> None:
    # 8 MiB on 400 Mbit/s NICs: 168 ms; a ring of 4 sends 1.5x that through each NIC
    wire, ring = limits(4, 8 << 20, 400_000_000)
    assert wire == pytest.approx(0.16777216)
    assert ring == pytest.approx(1.5 * wire)
    assert limits(2, 8 << 20, 400_000_000)[1] == pytest.approx(wire)


def test_a_bad_link_rate_is_refused_in_one_line(tmp_path: Path) -> None:
    res = CliRunner().invoke(bench, ["--out", str(tmp_path), "--part", "cluster",
                                     "--link", "fast"])
    assert res.exit_code == 2
    assert "rate 'fast': give a number and a unit" in res.output


def test_cluster_part_is_skipped_without_root(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert run_cluster([4096]) == ClusterResult(skipped="creating network namespaces needs "
                                                "root", rate="400mbit")
    res = CliRunner().invoke(bench, ["--out", str(tmp_path), "--part", "cluster", "--quick"])
    assert res.exit_code == 0, res.output
    assert "across a cluster: skipped: creating network namespaces needs root" in res.output
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["cluster"] == {"skipped": "creating network namespaces needs root"}
    goals = [g for g in data["goals"] if g["goal"].startswith("cluster")]
    assert len(goals) == 8 and all(g["status"] == "n/a" for g in goals)


@pytest.mark.integration
@pytest.mark.timeout(480)  # 8 systems on 4 hosts, then async on them: ~1 min unloaded
@pytest.mark.skipif(netns_problem() is not None, reason=str(netns_problem()))
def test_cluster_part_measures_every_system_beside_the_limits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the clusters this run makes, by tag (another test may make its own meanwhile)
    tags: list[str] = []
    made = EmulatedCluster.__init__

    def record(self: EmulatedCluster, tag: str, *args: Any, **kwargs: Any) -> None:
        tags.append(tag)
        made(self, tag, *args, **kwargs)

    monkeypatch.setattr(EmulatedCluster, "__init__", record)
    out = tmp_path / "bench"
    res = CliRunner().invoke(bench, ["--out", str(out), "--part", "cluster", "--quick",
                                     "--size", "256KiB", "--repeats", "2", "--link", "200mbit"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "result.json").read_text())
    cluster = data["cluster"]
    assert cluster["rate"] == "200mbit"
    rows = {r["system"]: r for r in cluster["rows"]}
    assert set(rows) == {"raw", "ps", "ps-colocated", "ps-parts", "ps-early", "ps-int8",
                         "ps-topk", "ps-int8-2way", "ps-topk-2way", "gloo"}
    wire = (256 << 10) * 8 / 200e6
    for r in rows.values():
        assert r["workers"] == 2 and r["bytes"] == 256 << 10 and r["round_s"]["n"] == 2
        assert r["limit_s"] == pytest.approx(wire) and r["ring_limit_s"] == pytest.approx(wire)
        # no round beats the wire: each worker's NIC carries the weights down (the
        # compressed rows push fewer bytes up, but pull dense), unless pulls are
        # compressed too (the 2-way rows, whose rounds may take less than M/B)
        assert r["vs_limit"] > 0.9 or r["system"].endswith("-2way")
    assert rows["gloo"]["shards"] is None and rows["gloo"]["vs_gloo"] is None
    assert rows["ps"]["shards"] == 2 and rows["ps"]["vs_gloo"]["n"] == 2
    assert "x M/B" in res.output and "across a cluster" in res.output
    # async, worker host 0 slowed to a quarter in every other window: every worker pushed
    # in both, and host 0's own rate fell (its NIC is the limit at 256 KiB)
    arow = cluster["async"]
    assert arow["workers"] == 2 and arow["bytes"] == 256 << 10 and arow["slow_bits"] == 50e6
    assert all(r > 0 for w in arow["fast_per_worker"] + arow["slow_per_worker"] for r in w)
    assert arow["slow_vs_fast"]["median"] < 0.8
    goal = next(g for g in data["goals"] if g["goal"].startswith("cluster: async"))
    assert goal["measured"] == pytest.approx(arow["others_vs_fast"]["median"])
    assert "the other workers' updates/s with host 0 slow" in res.output
    text = markdown(BenchResult.from_json(data))
    assert "| 2 | 2 | 256KiB | ps-colocated |" in text.split("Across a cluster")[1]
    assert "| host 0 slow |" in text.split("Across a cluster")[1]
    # every host of every cluster it made was deleted
    assert tags
    assert not {n for n in existing_namespaces() | existing_links()
                if any(n.startswith((f"pscl{t}", f"pcb{t}", f"pco{t}")) for t in tags)}
