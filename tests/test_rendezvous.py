"""Role mapping, launcher environments, Slurm node lists and the TCPStore rendezvous."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from paramserver.errors import ConfigError
from paramserver.workers.launch.rendezvous import (
    LaunchEnv,
    Rendezvous,
    RendezvousError,
    Role,
    assign_role,
    default_host,
    detect_launcher,
    expand_nodelist,
    launch_env,
)
from tests.ports import free_port


@pytest.mark.parametrize(("text", "hosts"), [
    ("node7", ["node7"]),
    ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("n[1,4-5]", ["n1", "n4", "n5"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("x-[1-2]-y,z", ["x-1-y", "x-2-y", "z"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(("text", "match"), [
    ("node[1-", "unbalanced"), ("node]1", "unbalanced"), ("n[a-b]", "cannot read"),
    ("n[5-2]", "backwards"),
])
def test_expand_nodelist_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        expand_nodelist(text)


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}


def test_torchrun_environment():
    env = launch_env(TORCHRUN)
    assert env == LaunchEnv("torchrun", 3, 4, 1, "10.0.0.5", 29500, single_node=False,
                            agent_store=True)
    assert not env.hosts_store
    single = launch_env({**TORCHRUN, "RANK": "0", "LOCAL_WORLD_SIZE": "4",
                         "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert single.single_node and single.hosts_store
    assert default_host(single) == "127.0.0.1"


def test_slurm_environment():
    env = launch_env(SLURM)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 8, 1)
    assert env.store == "gpu07:29956"  # first node; 29500 + job id % 1000
    assert not env.single_node and not env.agent_store
    assert launch_env({**SLURM, "MASTER_PORT": "4000"}).store_port == 4000
    assert launch_env(SLURM, store_host="head", store_port=5000).store == "head:5000"
    assert launch_env({**SLURM, "SLURM_NNODES": "1"}).single_node


def test_torchrun_inside_slurm_is_torchrun():
    assert detect_launcher({**SLURM, **TORCHRUN}) == "torchrun"
    assert launch_env({**SLURM, **TORCHRUN}).rank == 3


@pytest.mark.parametrize(("environ", "launcher", "match"), [
    ({}, "auto", "paramserver launch"),
    ({"RANK": "0"}, "torchrun", "WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"),
    ({**TORCHRUN, "RANK": "x"}, "auto", "RANK='x' is not an integer"),
    ({**TORCHRUN, "RANK": "4"}, "auto", r"rank 4 is not in \[0, 4\)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "auto", "SLURM_JOB_NODELIST is not set"),
    (TORCHRUN, "mpi", "launcher must be"),
])
def test_environment_errors(environ, launcher, match):
    with pytest.raises(ConfigError, match=match):
        launch_env(environ, launcher)


def test_roles():
    roles = [assign_role(r, 5, 2) for r in range(5)]
    assert [(r.kind, r.index) for r in roles] == [
        ("server", 0), ("server", 1), ("worker", 0), ("worker", 1), ("worker", 2)]
    assert {(r.num_servers, r.num_workers) for r in roles} == {(2, 3)}
    assert roles[1].describe() == "server (shard 1 of 2)"
    with pytest.raises(ConfigError, match="cannot hold 2 server"):
        assign_role(0, 2, 2)
    with pytest.raises(ConfigError, match=">= 1"):
        assign_role(0, 2, 0)



def _env(rank: int, port: int, world: int = 3) -> LaunchEnv:
    return LaunchEnv("torchrun", rank, world, rank, "127.0.0.1", port, single_node=True)


def test_rendezvous_publishes_addresses_and_names_missing_servers():
    port = free_port()
    host = Rendezvous(_env(0, port), timeout=10)  # rank 0 hosts the store
    worker = Rendezvous(_env(2, port), timeout=10)
    host.publish_server(0, "tcp://10.0.0.1:5600")
    with pytest.raises(RendezvousError, match=r"server rank\(s\) 1 \(of 2\)"):
        worker.wait_servers(2, timeout=0.5)
    Rendezvous(_env(1, port), timeout=10).publish_server(1, "tcp://10.0.0.2:5601")
    assert worker.wait_servers(2) == ["tcp://10.0.0.1:5600", "tcp://10.0.0.2:5601"]
    # the last worker to finish releases the servers
    stop = threading.Event()
    finished = []
    watcher = threading.Thread(target=lambda: finished.append(host.wait_finished(stop, 0.1)))
    watcher.start()
    assert worker.worker_done(num_workers=1)
    watcher.join(10)
    assert finished == [True]


def test_a_server_rank_started_again_is_a_replacement_of_the_same_replica():
    """`run --replicas 1`: a server rank whose node is in the store already was started
    in place of a dead one: it keeps the dead one's node (so its shard and replica) and
    counts as it among the ranks that joined; a torchrun restart of the whole group
    (another attempt) is a new run, not a replacement."""
    port = free_port()
    ranks = [Rendezvous(_env(r, port, world=4), timeout=10) for r in range(2)]
    roles = [Role("server", r, 1, 2, replicas=1) for r in range(2)]
    threads = [threading.Thread(target=lambda r=r: ranks[r].place(roles[r], f"node{r}"))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    ranks[0].publish_server(0, "tcp://10.0.0.1:5600|tcp://10.0.0.2:5601")
    again = Rendezvous(_env(1, port, world=4), timeout=10)
    joined = again.store.add(again._key("joined"), 0)
    assert again.replaces(roles[1])
    assert again.store.add(again._key("joined"), 0) == joined - 1  # it counts as the dead one
    assert again.place(roles[1], "elsewhere", replacement=True).replica == 1
    assert again.store.get(again._key("node", 1)) == b"node1"  # the dead rank's node kept
    assert again.shard_replicas(0) == ["tcp://10.0.0.1:5600", "tcp://10.0.0.2:5601"]
    restarted = Rendezvous(dataclasses.replace(_env(1, port, world=4), attempt=1), timeout=10)
    assert not restarted.replaces(roles[1])
    assert launch_env({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"}).attempt == 2


def test_unreachable_store_names_it():
    port = free_port()
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}.*hosted by rank 0"):
        Rendezvous(_env(1, port), timeout=0.5)
