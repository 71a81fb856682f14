"""Suite-wide guards: a test stops every process it started."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from paramserver.workers.launch.netcluster import EmulatedCluster

#: how long a test's processes get to finish exiting after the test returns
EXIT_GRACE = 10.0


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process we can read: from its stat alone, as
    this runs twice a test (a command line is read only for a leftover, _args)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields start after the last ")"
        fields = stat[stat.rindex(b")") + 2:].split(maxsplit=2)
        out[int(name)] = (int(fields[1]), fields[0].decode())
    return out


def _args(pid: int) -> str:
    """``pid``'s command line ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        return ""


def _zygotes() -> set[int]:
    """The launcher's zygotes in this process (shared by the tests, so not leftovers)."""
    import sys

    module = sys.modules.get("paramserver.workers.launch.zygote")
    if module is None:
        return set()
    return set(module.zygote_pids())


def _leftovers() -> dict[int, str]:
    """Live descendants of this process, except the launcher's zygotes themselves
    (forked children of one are leftovers like any other), with their command lines."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, state) in _processes().items():
        if state != "Z":
            children.setdefault(ppid, []).append(pid)
    zygotes = _zygotes()
    found: dict[int, str] = {}
    frontier = [os.getpid()]
    while frontier:
        for pid in children.get(frontier.pop(), ()):
            frontier.append(pid)
            if pid not in zygotes:
                found[pid] = _args(pid)
    return found


@pytest.fixture(autouse=True)
def _no_process_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    if not Path("/proc/self/stat").exists():  # not Linux: nothing to check with
        yield
        return
    before = set(_leftovers())
    yield
    deadline = time.monotonic() + EXIT_GRACE
    left = {p: a for p, a in _leftovers().items() if p not in before}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)  # processes told to stop are still exiting; bounded by the deadline
        left = {p: a for p, a in _leftovers().items() if p not in before}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        pytest.fail(f"{request.node.nodeid} left processes running (killed now): "
                    + "; ".join(f"{pid} {args[:120]}" for pid, args in sorted(left.items())),
                    pytrace=False)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PARAMSERVER_* or launcher variables from the outside leak into a CLI test."""
    for key in list(os.environ):
        if key.startswith(("PARAMSERVER_", "SLURM_", "TORCHELASTIC_")) or key in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PARAMSERVER_LOG_LEVEL", "WARNING")  # restored after the test


@pytest.fixture
def emulated_hosts() -> Iterator[Callable[..., EmulatedCluster]]:
    """Hosts for a test: ``emulated_hosts(workers=2, servers=1, rate="100mbit",
    rates={2: "20mbit"})`` makes a running :class:`EmulatedCluster` (network namespaces
    on a bridge, see paramserver/workers/launch/netcluster.py); the test skips, with the
    reason, where namespaces cannot be made. Everything is deleted after the test, which
    fails if a namespace or interface of it is left."""
    from paramserver.workers.launch.netcluster import (
        emulated_cluster,
        existing_links,
        existing_namespaces,
        netns_problem,
    )

    problem = netns_problem()
    if problem:
        pytest.skip(problem)
    tags: list[str] = []
    with contextlib.ExitStack() as stack:
        def make(workers: int, servers: int = 0, rate: str = "1gbit",
                 rates: dict[int, str] | None = None) -> EmulatedCluster:
            cluster = stack.enter_context(emulated_cluster(workers, servers, rate, rates))
            tags.append(cluster.tag)
            return cluster

        yield make
    left = sorted(n for n in existing_namespaces() | existing_links()
                  if any(tag in n for tag in tags))
    if left:
        pytest.fail(f"emulated hosts left behind: {', '.join(left)}", pytrace=False)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """The longest modules first: the documents' blocks, then those with ``slow`` grids.
    With test processes side by side (``make test`` runs ``-n auto --dist loadfile``)
    none of them then starts last and runs alone. Whole modules move, each in its own
    order, so module-scoped fixtures are still set up once."""
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    slow = {module(item) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (not module(item).endswith("test_docs.py"),
                                 module(item) not in slow))
