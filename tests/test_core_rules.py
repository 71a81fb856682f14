"""One rule engine for dense slices and sparse rows (core/rules.py): the same push ids,
staleness and policy give the same PushOutcome whichever payload a push carries. No
sockets: a ShardCore drives its dense slices and a table of rows side by side."""

from __future__ import annotations

import torch

from paramserver.core.records import CoreConfig, Mode, ModeSpec, PushOutcome, SliceSpec
from paramserver.core.shard import ShardCore
from paramserver.policies import Decision, NoPolicy, StalenessPolicy, UpdateInfo
from paramserver.sparse.shard import SparseShard, TableSpec

TABLE = TableSpec("emb", 64, 4, "float64", "normal", 0.5, seed=1)


class RefuseWorker1(StalenessPolicy):
    name = "refuse-1"

    def decide(self, info: UpdateInfo) -> Decision:
        return Decision(False, 0.0, "worker 1 refused") if info.worker == 1 else Decision(True)


def _core(mode: str, policy: StalenessPolicy) -> tuple[ShardCore, SparseShard]:
    core = ShardCore([SliceSpec("w", 4, "float64")],
                     CoreConfig(mode=ModeSpec(Mode(mode)), expected_workers=2), policy)
    for w in (0, 1):
        core.register(w, f"inc{w}", 0.0)
    core.initialize({"w": torch.zeros(4, dtype=torch.float64)})
    table = SparseShard([TABLE], 1, 0, optimizer="sgd", optimizer_args={"lr": 0.1},
                        live=core.members.live_ids)
    return core, table


def _both(core: ShardCore, table: SparseShard, worker: int, push_id: int, read: int
          ) -> tuple[PushOutcome | None, PushOutcome | None]:
    dense = core.push(worker, push_id, 0, read, 2, {"w": torch.ones(4, dtype=torch.float64)},
                      now=1.0)
    rows = {"ids:emb": table.tables["emb"].ids[:2],
            "val:emb": torch.ones(2, 4, dtype=torch.float64)}
    sparse = core.rows.push(table, worker, push_id, read, 0, 2, rows, token=(worker, push_id))
    return dense, sparse


def test_a_policy_refusal_and_a_duplicate_id_answer_dense_and_sparse_pushes_alike() -> None:
    core, table = _core("async", RefuseWorker1())
    dense, sparse = _both(core, table, 1, 1, 0)
    assert dense == sparse == PushOutcome(False, 0.0, "worker 1 refused", 0, 0, False)
    dense, sparse = _both(core, table, 0, 1, 0)
    assert dense == sparse == PushOutcome(True, 1.0, "", 0, 1, True)
    # the same id again: the first answer, marked duplicate, applied once
    dense, sparse = _both(core, table, 0, 1, 0)
    assert dense == sparse == PushOutcome(True, 1.0, "", 0, 1, True, duplicate=True)
    # an older id than the last: a plain duplicate
    _both(core, table, 0, 2, 1)
    dense, sparse = _both(core, table, 0, 1, 0)
    assert dense == sparse == PushOutcome(False, 0.0, "duplicate", 0, 2, False, duplicate=True)
    assert core.version == table.version == 2


def test_a_sync_round_closes_and_a_late_push_is_dropped_alike_for_slices_and_rows() -> None:
    core, table = _core("sync", NoPolicy())
    dense, sparse = _both(core, table, 0, 1, 0)
    assert dense == PushOutcome(True, 1.0, "", 0, 0, False)  # its pull waits for the round
    assert sparse is None  # its reply waits for the round
    dense, sparse = _both(core, table, 1, 1, 0)
    assert dense == sparse == PushOutcome(True, 1.0, "", 0, 1, True)  # closed the round
    assert [token for token, _ in core.rows.ready(table)] == [(0, 1), (1, 1)]
    # a gradient read before the round that closed: late, whatever it carries
    dense, sparse = _both(core, table, 0, 2, 0)
    assert dense == sparse == PushOutcome(False, 0.0, "late", 1, 1, False)
    assert core.version == table.version == 1


def test_a_worker_that_restarts_starts_its_sparse_push_ids_afresh() -> None:
    core, table = _core("async", NoPolicy())
    _both(core, table, 0, 5, 0)
    core.register(0, "another incarnation", 100.0)  # the old one went quiet: it died
    dense, sparse = _both(core, table, 0, 1, 1)
    assert dense == sparse and dense is not None and not dense.duplicate
    assert core.version == table.version == 2


def test_the_mode_is_one_enum_that_reads_and_writes_as_its_name() -> None:
    spec = ModeSpec("ssp", staleness_bound=2)
    assert spec.mode is Mode.SSP and spec.mode == "ssp" and f"{spec.mode}" == "ssp"
    assert ModeSpec().describe() == "async" and spec.describe() == "ssp(s=2)"
