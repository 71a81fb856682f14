"""``launch --reshard-at ROUND:S``: the launcher moves its running job to S shards once
ROUND sync rounds closed, live (issue 47, item 2; workers/reshard.py moves it).

A thread of the launcher, one move after another in round order: it starts the
shards a move adds (empty, with the run's options), has the move made, and then
counts the new plan's processes as the run's shards (the final model and the
shutdown go to them). A shard the move removes stops by itself once the workers
were told; the launcher expects that exit. A move that fails is logged and the
run goes on on the old plan (the shards it started for it are stopped).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from paramserver.workers.reshard import MoveFailed, MoveReport, live_reshard

if TYPE_CHECKING:
    from paramserver.workers.launch.children import ChildProcess
    from paramserver.workers.launch.cluster import LocalCluster

__all__ = ["Resharder"]

log = logging.getLogger(__name__)

#: a move's steps' answers are waited for this long (its cut, as long as the run)
STEP_TIMEOUT = 300.0


class Resharder(threading.Thread):
    """The launcher's moves, made while the workers train."""

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(name="resharder", daemon=True)
        self.cluster = cluster
        self.cancel = threading.Event()
        self.reports: list[MoveReport] = []
        self.failed: list[str] = []
        self.ready: dict[int, list[ChildProcess]] = {}  # shards started ahead, by round

    def prepare(self) -> None:
        """Before the workers start: the first move's shards, so that its cut is asked
        for while the workers still start (not rounds after the round it names)."""
        at, to = min(self.cluster.spec.reshard_at.items())
        self.ready[at] = self._spawn(at, len(self.cluster.addresses), to)

    def run(self) -> None:
        for at, to in sorted(self.cluster.spec.reshard_at.items()):
            if self.cancel.is_set():
                return
            try:
                self._move(at, to)
            except Exception as exc:  # (a move is no reason to stop training)
                log.error("--reshard-at %d:%d: %s", at, to, exc)
                self.failed.append(f"{at}:{to}: {exc}")

    def _move(self, at: int, to: int) -> None:
        cluster, spec = self.cluster, self.cluster.spec
        current = list(cluster.addresses)
        added = self.ready.pop(at, None) or self._spawn(at, len(current), to)
        deadline = time.monotonic() + spec.startup_timeout
        add = [cluster._await_ready(p, deadline) for p in added]
        kept, leaving = cluster.servers[:to], cluster.servers[to:]
        cluster.retired = [*cluster.retired, *leaving]  # (their exit is expected now)
        cluster.servers = kept
        try:
            report = live_reshard(current, to, add, at=at, timeout=STEP_TIMEOUT,
                                  freeze_timeout=spec.run_timeout or float("inf"),
                                  curve=spec.admin_curve(), cancel=self.cancel,
                                  progress=lambda text: log.info("--reshard-at %d:%d: %s",
                                                                 at, to, text))
        except MoveFailed:
            cluster.retired = [p for p in cluster.retired if p not in leaving]
            cluster.servers = [*kept, *leaving]
            for proc in added:
                proc.popen.kill()
                proc.popen.wait()
            raise
        cluster.servers = [*kept, *added]
        cluster.addresses = list(report.servers)
        self.reports.append(report)
        log.warning("--reshard-at %d:%d: %s", at, to, report.describe())

    def _spawn(self, at: int, have: int, to: int) -> list[ChildProcess]:
        """Empty shards ``have .. to - 1`` of the new plan, with the run's options."""
        cluster, spec = self.cluster, self.cluster.spec
        added = []
        for k in range(have, to):
            cfg = dataclasses.replace(  # (shard 0's template, as shard k of the new plan)
                spec.server_config(0, cluster.out), shard=k, num_shards=to,
                event_log=str(cluster.out / "events" / f"server{k}.move{at}.jsonl"),
                metrics_port=None if spec.metrics_port is None else 0)
            added.append(cluster._spawn(f"server{k}.move{at}", "paramserver.server.loop",
                                        cluster.bind_on(cfg, k).to_dict(), ready_pipe=True,
                                        host=cluster.server_host(k)))
        return added

    def finish(self) -> None:
        """The workers are done: a move still waiting for its round is called off."""
        self.cancel.set()
        self.join(STEP_TIMEOUT)
