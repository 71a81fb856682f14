"""Resharding a checkpoint (issue 47, item 1): the pure rule (paramserver/core/reshard.py)
without sockets, and ``paramserver checkpoint reshard`` on files.

Cores of a sync run on S shards are stepped, their snapshots resharded to S' and loaded
into cores of the S'-shard plan; stepping on, every weight is bit-identical to the run
kept on S shards."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from paramserver.cli.main import main
from paramserver.core.reshard import ReshardError, reshard
from paramserver.core.shard import ShardCore, SliceSpec
from paramserver.core.sharding import ParamSpec, ShardPlan
from paramserver.persist.checkpoint import load_shard, save_shard
from paramserver.sparse.shard import SparseShard, TableSpec, owned_rows
from tests.core_inputs import core_config

WORKERS = 3
PARAMS = [ParamSpec("w1", (7, 5), "float32"), ParamSpec("b1", (5,), "float32"),
          ParamSpec("w2", (3, 40), "float32"), ParamSpec("h", (9,), "float64")]
TABLE = TableSpec.from_description({"name": "emb", "rows": 50, "dim": 4, "dtype": "float32",
                                    "init": "normal", "std": 0.1, "seed": 3})


def _plan(shards: int, sparse: bool = False) -> ShardPlan:
    # 64-byte chunks: w2 is cut into 8 slices, spread over the shards
    return ShardPlan(PARAMS, shards, chunk_bytes=64, sparse=[TABLE] if sparse else [])


class Run:
    """A sync run's shard cores (and sparse tables), stepped on the same gradients."""

    def __init__(self, plan: ShardPlan, optimizer: str, scheduler: str | None = None) -> None:
        self.plan = plan
        cfg = core_config("sync", WORKERS, adam=optimizer == "adam")
        if scheduler:
            cfg = dataclasses.replace(cfg, scheduler=scheduler,
                                      scheduler_args={"step_size": 2, "gamma": 0.5})
        self.cfg = cfg
        self.cores = [ShardCore([SliceSpec(s.key, s.numel, s.dtype)
                                 for s in plan.shard_slices(k)],
                                dataclasses.replace(cfg, shard=k))
                      for k in range(plan.num_shards)]
        self.tables = [SparseShard(plan.sparse, plan.num_shards, k, optimizer="sgd",
                                   optimizer_args={"lr": 0.1, "momentum": 0.9},
                                   live=lambda: range(WORKERS))
                       for k in range(plan.num_shards)] if plan.sparse else []
        self.clock = 0

    def start(self) -> Run:
        gen = torch.Generator().manual_seed(0)
        full = {p.name: torch.randn(p.shape, generator=gen, dtype=p.torch_dtype)
                for p in self.plan.params}
        for k, part in self.plan.split_tensors(full).items():
            core = self.cores[k]
            for w in range(WORKERS):
                core.register(w, f"inc{w}", now=0.0)
            core.initialize({key: t.clone() for key, t in part.items()})
        return self

    def step(self, rounds: int) -> Run:
        for _ in range(rounds):
            t = self.clock
            for w in range(WORKERS):
                gen = torch.Generator().manual_seed(1000 * w + t)
                grads = {p.name: torch.randn(p.shape, generator=gen, dtype=p.torch_dtype)
                         * 10.0 ** (w - 1) for p in self.plan.params}
                for k, part in self.plan.split_tensors(grads).items():
                    core = self.cores[k]
                    core.push(w, t, t, core.version, 4, part, now=0.0)
            for sp in self.tables:  # a step on every row a worker touched
                ids = torch.arange(TABLE.rows)
                mine = ids[torch.isin(ids, owned_rows(TABLE.rows, self.plan.num_shards,
                                                      sp.shard))]
                pos = sp.tables["emb"].local(mine, "test")
                sp._step([("emb", pos, torch.full((len(pos), TABLE.dim), 0.01 * (t + 1)))],
                         1.0)
            self.clock += 1
        return self

    def states(self) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        out = []
        for core, k in zip(self.cores, range(self.plan.num_shards), strict=True):
            tensors, meta = core.state_dict()
            meta = json.loads(json.dumps(meta))  # as a manifest holds it
            meta.update(plan=self.plan.describe(), plan_hash=self.plan.hash,
                        optimizer_name=self.cfg.optimizer, script_optimizer=None,
                        server={"shard": k, "num_shards": self.plan.num_shards})
            if self.tables:
                rows, meta["sparse"] = self.tables[k].state_dict()
                tensors.update(rows)
            out.append(({n: t.clone() for n, t in tensors.items()}, meta))
        return out

    def load(self, states: list[tuple[dict[str, torch.Tensor], dict[str, Any]]]) -> Run:
        for k, (tensors, meta) in enumerate(states):
            self.cores[k].load_state_dict(tensors, meta, now=0.0)
            if self.tables:
                self.tables[k].load_state_dict(tensors, meta["sparse"])
            self.clock = meta["rounds_closed"]  # (the workers' next push ids)
        return self

    def weights(self) -> dict[str, torch.Tensor]:
        full = {p.name: torch.zeros(p.shape, dtype=p.torch_dtype) for p in self.plan.params}
        for core in self.cores:
            self.plan.assemble_into(full, dict(core.params))
        for k, sp in enumerate(self.tables):
            table = full.setdefault("emb", torch.zeros(TABLE.rows, TABLE.dim))
            table[owned_rows(TABLE.rows, self.plan.num_shards, k)] = sp.tables["emb"].weight
        return full


def _identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(("optimizer", "old", "new", "sparse"), [
    ("sgd", 2, 3, False), ("adam", 2, 3, False), ("sgd", 3, 1, True), ("adam", 1, 4, False),
    ("sgd", 2, 5, True)])
def test_a_resharded_run_steps_on_bit_identical(optimizer, old, new, sparse):
    kept = Run(_plan(old, sparse), optimizer).start().step(3)
    moved = Run(_plan(new, sparse), optimizer).load(reshard(kept.states(), new))
    _identical(moved.weights(), kept.weights())
    kept.step(3)
    moved.step(3)
    _identical(moved.weights(), kept.weights())
    assert [c.version for c in moved.cores] == [kept.cores[0].version] * new


def _same_states(got, want) -> None:
    assert len(got) == len(want)
    for (gt, gm), (wt, wm) in zip(got, want, strict=True):
        assert set(gt) == set(wt)
        for name in wt:
            assert torch.equal(gt[name], wt[name]), name
        assert gm == {k: v for k, v in wm.items()}


@pytest.mark.parametrize("sparse", [False, True])
def test_there_and_back_is_the_identity(sparse):
    run = Run(_plan(2, sparse), "adam", scheduler="step").start().step(2)
    states = run.states()
    _same_states(reshard(reshard(states, 3), 2), states)
    _same_states(reshard(states, 2), states)


def test_an_open_round_and_every_state_kind_move_with_their_slices():
    run = Run(_plan(2), "adam").start().step(2)
    for k, core in enumerate(run.cores):  # worker 0 pushed into the open round
        part = run.plan.split_tensors({p.name: torch.ones(p.shape, dtype=p.torch_dtype)
                                       for p in run.plan.params})[k]
        core.push(0, 2, 2, core.version, 4, part, now=0.0)
    states = run.states()
    three = reshard(states, 3)
    new = _plan(3)
    for k, (tensors, meta) in enumerate(three):
        keys = [s.key for s in new.shard_slices(k)]
        assert {n[len("param/"):] for n in tensors if n.startswith("param/")} == set(keys)
        assert {n[len("agg/"):] for n in tensors if n.startswith("agg/")} == set(keys)
        for i, key in enumerate(keys):  # Adam's moments renumbered with the slice
            old = run.plan.slice_for(key).shard
            j = [s.key for s in run.plan.shard_slices(old)].index(key)
            for entry in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(tensors[f"optim/{i}/{entry}"],
                                   states[old][0][f"optim/{j}/{entry}"])
        assert meta["round"] == [0] and meta["between_rounds"] is False
        assert meta["workers"] == states[0][1]["workers"] and meta["shard"] == k
    moved = Run(new, "adam").load(three)  # and the round closes there as it would have
    for k, core in enumerate(run.cores):
        part = run.plan.split_tensors({p.name: torch.ones(p.shape, dtype=p.torch_dtype)
                                       for p in run.plan.params})[k]
        for w in (1, 2):
            core.push(w, 2, 2, core.version, 4, part, now=0.0)
    for k, core in enumerate(moved.cores):
        part = new.split_tensors({p.name: torch.ones(p.shape, dtype=p.torch_dtype)
                                  for p in new.params})[k]
        for w in (1, 2):
            core.push(w, 2, 2, core.version, 4, part, now=0.0)
    _identical(moved.weights(), run.weights())


def test_sparse_rows_and_their_momentum_go_where_the_new_plan_puts_them():
    run = Run(_plan(2, sparse=True), "sgd").start().step(2)
    states = run.states()
    full_w, full_m = torch.zeros(TABLE.rows, TABLE.dim), torch.zeros(TABLE.rows, TABLE.dim)
    for k, (tensors, _) in enumerate(states):
        ids = owned_rows(TABLE.rows, 2, k)
        full_w[ids], full_m[ids] = tensors["sparse/emb/weight"], tensors["sparse_momentum/0"]
    for k, (tensors, meta) in enumerate(reshard(states, 3)):
        ids = owned_rows(TABLE.rows, 3, k)
        assert torch.equal(tensors["sparse/emb/weight"], full_w[ids])
        assert torch.equal(tensors["sparse_momentum/0"], full_m[ids])
        assert meta["sparse"]["version"] == 2


def _refused(states, match: str, to: int = 3) -> None:
    with pytest.raises(ReshardError, match=match) as info:
        reshard(states, to)
    assert "\n" not in str(info.value)


def test_shards_that_disagree_are_refused_in_one_line():
    states = Run(_plan(2), "sgd").start().step(2).states()
    states[1][1]["workers"]["2"]["last_push_id"] = 0  # a push that reached shard 0 only
    _refused(states, r"field 'workers.2.last_push_id' differs between the shards")
    states = Run(_plan(2), "sgd").start().step(2).states()
    states[1][1]["version"] = 1
    _refused(states, r"field 'version' differs .*shard 0: 2, shard 1: 1")
    states = Run(_plan(2), "adam").start().step(2).states()
    for name in [n for n in states[1][0] if n.endswith("/step")]:
        states[1][0][name] = states[1][0][name] - 1  # shard 1 refused a step
    _refused(states, "stepped .*together kept different optimizer counts|would step together")


def test_what_cannot_move_is_refused_with_the_reason():
    states = Run(_plan(2), "sgd").start().step(1).states()
    for _, meta in states:
        meta["optimizer_name"] = "torch.optim.lbfgs:LBFGS"
    _refused(states, "cannot reshard: its optimizer .* is unknown here|not one whose step")
    states = Run(_plan(2), "sgd").start().step(1).states()
    for _, meta in states:  # a manifest naming code to import: refused, never imported
        meta["optimizer_name"] = "tests.plugin_probe:Optimizer"
    _refused(states, "names the optimizer 'tests.plugin_probe:Optimizer', code to import "
                     "and run: not imported")
    states = Run(_plan(2), "sgd").start().step(1).states()
    for k, (_, meta) in enumerate(states):  # statistics of each shard's own slices
        meta["policy"] = {"name": "gap-aware", "state": {"ema_square": {f"p{k}": 1.0}}}
    _refused(states, "the policy 'gap-aware' keeps state of each shard's own "
                     r"\(its ema_square\), which a reshard cannot split or merge")
    states = Run(_plan(2), "sgd").start().step(1).states()
    for _, meta in states:
        meta["optimizer_name"] = "SparseAdam"
    _refused(states, "the optimizer 'SparseAdam' is not one whose step reads each slice alone")
    states = Run(_plan(2), "sgd").start().step(1).states()
    key = next(n for n in states[0][0] if n.startswith("param/"))
    states[0][0][key] = states[0][0][key].clone().fill_(float("nan"))
    _refused(states, "holds NaN or Inf")
    _refused(Run(_plan(2), "sgd").start().states()[:1], "the plan has 2 shards, the checkpoint 1")
    _refused(Run(_plan(2), "sgd").start().states(), "integer >= 1", to=0)


def _write(root: Path, states) -> None:
    for k, (tensors, meta) in enumerate(states):
        save_shard(root, k, tensors, meta)


def test_the_command_reshards_a_directory_whole_or_not_at_all(tmp_path):
    _write(tmp_path / "ckpt", Run(_plan(2, sparse=True), "sgd").start().step(2).states())
    runner = CliRunner()
    out = tmp_path / "ckpt3"
    result = runner.invoke(main, ["checkpoint", "reshard", str(tmp_path / "ckpt"), "--to", "3",
                                  "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "resharded" in result.output and "--num-servers 3" in result.output
    plans = {load_shard(out, k)[1]["plan_hash"] for k in range(3)}
    assert plans == {_plan(3, sparse=True).hash}
    # the output exists: refused, and left as it is
    again = runner.invoke(main, ["checkpoint", "reshard", str(tmp_path / "ckpt"), "--to", "2",
                                 "--out", str(out)])
    assert again.exit_code == 2 and "exists" in again.output
    # a tampered input is refused as --resume refuses it, and nothing is written
    manifest = next((tmp_path / "ckpt" / "shard1").glob("v*.json"))
    meta = json.loads(manifest.read_text())
    meta["tensors_bytes"] += 1
    manifest.write_text(json.dumps(meta))
    bad = runner.invoke(main, ["checkpoint", "reshard", str(tmp_path / "ckpt"), "--to", "3",
                               "--out", str(tmp_path / "never")])
    assert bad.exit_code == 2 and "tensors_bytes" in bad.output
    assert not (tmp_path / "never").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".never")]


def test_the_command_teaches():
    result = CliRunner().invoke(main, ["checkpoint", "reshard", "--help"])
    assert result.exit_code == 0
    assert "--to" in result.output and "bit-identical" in result.output
    assert "launch -s 3 -n 3 --resume runs/ckpt3" in result.output


def test_a_sparse_rounds_sum_of_a_row_is_in_worker_order_whatever_else_the_shard_holds():
    # a resharded table's shard holds other rows than before: each row's sum must not
    # depend on them (it did: a coalesce of every row summed a row's repeats in an
    # order that changed with the rest)
    table = TableSpec.from_description({"name": "emb", "rows": 5000, "dim": 4,
                                        "dtype": "float32", "init": "zeros", "std": 0.1,
                                        "seed": 3})
    sp = SparseShard([table], 1, 0, optimizer="sgd", optimizer_args={"lr": 1.0},
                     live=lambda: range(8))
    gen = torch.Generator().manual_seed(0)
    want = torch.zeros(table.rows, table.dim)
    for w in range(8):
        pos = torch.randperm(table.rows, generator=gen)[:3000].sort().values
        vals = torch.randn(3000, table.dim, generator=gen) * 10.0 ** torch.randint(
            -4, 5, (3000, 1), generator=gen)
        sp.held.rows[w], sp.held.values[w] = {"emb": [pos]}, {"emb": [vals]}
        want[pos] += vals  # worker by worker
    sp.close_round(1.0)
    assert torch.equal(sp.tables["emb"].weight, -want)


def test_a_shard_resumed_on_another_count_takes_its_part_and_never_writes_into_the_old_run(
        tmp_path):
    from paramserver.observe.events import EventLog
    from paramserver.persist.checkpoint import CheckpointError
    from paramserver.server.checkpointer import Checkpointer

    _write(tmp_path / "ckpt", Run(_plan(2), "adam").start().step(2).states())
    events = EventLog(None)
    plan, tensors, meta = Checkpointer(2, str(tmp_path / "new"), events).read(
        str(tmp_path / "ckpt"), None, num_shards=3)
    assert plan == _plan(3) and meta["shard"] == 2 and meta["version"] == 2
    assert {n[6:] for n in tensors if n.startswith("param/")} == {
        s.key for s in _plan(3).shard_slices(2)}
    with pytest.raises(CheckpointError, match="would mix two plans; give --checkpoint-dir"):
        Checkpointer(0, str(tmp_path / "ckpt"), events).read(str(tmp_path / "ckpt"), None,
                                                             num_shards=3)


def test_a_launch_resumed_on_another_count_checkpoints_beside_the_old_run(tmp_path):
    from paramserver.errors import ConfigError
    from paramserver.persist.reshard import resume_elsewhere

    ckpt = str(tmp_path / "ckpt")
    _write(tmp_path / "ckpt", Run(_plan(2), "sgd").start().step(1).states())
    assert resume_elsewhere(ckpt, ckpt, 2) is None  # the same count: as asked
    assert resume_elsewhere(ckpt, str(tmp_path / "other"), 3) is None
    assert resume_elsewhere(ckpt, ckpt, 3) == tmp_path / "ckpt.3shards"
    _write(tmp_path / "ckpt.3shards", reshard(Run(_plan(2), "sgd").start().states(), 3))
    with pytest.raises(ConfigError, match=r"holds a run already .* --resume .*ckpt\.3shards"):
        resume_elsewhere(ckpt, ckpt, 3)
