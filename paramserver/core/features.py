"""Which features work together: one table, and the one check every command runs.

A *feature* is something a run turns on (replicas, sparse tables, CURVE, ...). Each
pair of features is in :data:`PAIRS` as one of:

* ``works``: it works, and ``test`` names the end-to-end test that shows it
  (``tests/<file>.py::<test>``; tests/test_features.py checks that it exists);
* ``refused``: a run that turns both on is refused at start, in one line giving
  ``why`` (:func:`check`, which the configs of ``server``, ``worker``, ``launch``,
  ``run`` and ``experiment`` call, and DistributedOptimizer for what a script turns
  on); tests/test_features.py starts ``launch`` with each refused pair and expects
  exit 2, before any process starts;
* ``untested``: nothing refuses it, and no end-to-end test runs it yet (``why`` says
  what is missing): not a promise that it works;
* ``exclusive``: the two cannot be asked for together (one ``--policy``).

A feature in :data:`SCRIPT_ONLY` is turned on inside a script, not by a flag: its
refused pairs are refused by ``DistributedOptimizer(...)``, before it connects.

docs/reliability.md shows the table (:func:`markdown`; a test checks the two agree).
Pure and light: the CLI reads it before anything heavy is imported.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from paramserver.errors import ConfigError

__all__ = ["BUILTIN_POLICIES", "FEATURES", "PAIRS", "SCRIPT_ONLY", "SPARSE_TASKS", "Pair",
           "active", "check", "markdown", "of_run", "pair", "policy_feature"]

#: the staleness policies paramserver ships (paramserver/policies), "none" aside
BUILTIN_POLICIES = ("reject", "inverse", "exponential", "dc-asgd", "dc-asgd-adaptive",
                    "gap-aware", "ssp-adaptive")

#: the built-in tasks whose model holds ShardedEmbedding tables (tests/test_features.py
#: checks this against the task registry)
SPARSE_TASKS = ("recsys",)


#: the features a script turns on in its own code, which no flag expresses
SCRIPT_ONLY = ("script_optimizer",)


def policy_feature(name: str) -> str:
    return f"policy:{name}"


#: feature -> how a run turns it on (the name a refusal and the docs' table give it)
FEATURES: dict[str, str] = {
    "replicas": "--replicas",
    "sparse": "a sparse table (ShardedEmbedding, --task recsys)",
    "curve": "CURVE",
    "shm": "shared memory",
    "trace": "--trace (record every push; simulate --replay)",
    "resume": "--resume",
    "command": "a command run (-- COMMAND)",
    "local_sgd": "local SGD (--local-optimizer)",
    "outer": "--optimizer delayed-nesterov",
    "backup_workers": "--backup-workers",
    "overlap": "--overlap",
    "wire_dtype": "--wire-dtype",
    "compression": "--compression",
    "pull_compression": "--pull-compression",
    "script_optimizer": "a script's own optimizer (DistributedOptimizer(model, torch.optim.X))",
    "hosts": "emulated hosts (--hosts W+S)",
    "early_parts": "--early-parts",
    "reshard": "--resume on another shard count (checkpoint reshard)",
    "live_reshard": "a live reshard (--reshard-at, paramserver reshard)",
    **{policy_feature(p): f"--policy {p}" for p in BUILTIN_POLICIES},
}


@dataclass(frozen=True)
class Pair:
    """What a pair of features does together (see the module's docstring)."""

    status: str  # works | refused | untested | exclusive
    test: str = ""  # works: the end-to-end test's node id
    why: str = ""  # refused: the one-line reason; untested: what is missing

    def __post_init__(self) -> None:
        if self.status not in ("works", "refused", "untested", "exclusive"):
            raise ValueError(f"unknown status {self.status!r}")
        if (self.status == "works") != bool(self.test):
            raise ValueError("a pair works with the test that shows it, and only then")
        if self.status == "refused" and not self.why:
            raise ValueError("a refused pair says why")


def _works(test: str) -> Pair:
    return Pair("works", test=test)


def _refused(why: str) -> Pair:
    return Pair("refused", why=why)


_READ_WEIGHTS = ("it rewrites gradients from the weights each worker read, which a "
                 "joining replica's snapshot does not carry")
_SURFACES = "tests/test_replicas_surfaces_e2e.py::"
_LIVE = "tests/test_reshard_live_e2e.py::"
_LIVE_RESUMED = (_LIVE + "test_launch_reshard_at_across_a_resume_on_another_shard_count_"
                 "ends_as_kept_on_2")
_LIVE_SCRIPT = (_LIVE + "test_a_scripts_own_optimizer_moved_2_to_3_to_1_shards_equals_"
                "single_process_torch")
_LIVE_POLICY = _LIVE + "test_async_moves_under_a_policy_and_an_old_shard_lost_mid_move"
_PER_SHARD_STATS = ("it keeps per-slice statistics in one state per shard, which a move "
                    "does not split among the new plan's shards; keep the shard count")
_TRACE = "tests/test_trace_e2e.py::"
_PAIRS = "tests/test_compress_trace_pairs_e2e.py::"
_EACH_POLICY = _PAIRS + "test_a_traced_curve_run_compressed_both_ways_replays_under_each_policy"
_SHM_RUN = _PAIRS + "test_a_traced_run_through_shared_memory_with_compressed_pulls_replays"
_EARLY_RUN = _PAIRS + "test_a_traced_run_with_early_parts_and_compressed_pushes_replays"
_LOCAL_RUN = _PAIRS + "test_bf16_local_sgd_with_compressed_pulls_equals_the_replay"
_SCRIPT_RUN = (_PAIRS + "test_a_script_wrapping_its_optimizer_with_overlap_compressed_both_"
               "ways_equals_the_replay")
_RESIDUALS = ("the built-in loop's workers keep their error-feedback residuals in memory, "
              "so a resumed run starts them empty and is not the run never stopped (with "
              "ef=0 it is, bit for bit); a script's DistributedOptimizer.state_dict() "
              "keeps them")
_TRACE_COMMAND = "the replay recomputes the built-in loop's gradients; a command owns its loop"
_TRACE_RESUME = "a trace starts at a run's first push; a resumed run's began in another run"

_LISTED: dict[tuple[str, str], Pair] = {
    # replicas (paramserver/server/replication.py)
    ("replicas", "sparse"): _refused(
        "a backup does not follow the sparse tables' pushes, so a failover would lose "
        "the table's updates; train sparse tables without --replicas (checkpoints "
        "and --resume keep them)"),
    ("replicas", "curve"): _works(
        _SURFACES + "test_curve_replicas_refuse_strangers_and_survive_two_primary_sigkills"),
    ("replicas", "shm"): _works(
        "tests/test_replication_shm_e2e.py::"
        "test_sync_failover_through_shared_memory_ends_bit_identical"),
    ("replicas", "resume"): _works(_SURFACES + "test_every_replica_resumes_from_the_checkpoint"),
    ("replicas", "command"): _works(
        _SURFACES + "test_a_command_run_with_replicas_survives_a_primary_sigkill"),
    ("replicas", "backup_workers"): _works(
        _SURFACES + "test_backup_workers_replicate_through_a_primary_sigkill"),
    ("replicas", policy_feature("reject")): _works(
        _SURFACES + "test_a_staleness_policy_replicates_through_a_primary_sigkill"),
    ("replicas", policy_feature("dc-asgd")): _refused(_READ_WEIGHTS),
    ("replicas", policy_feature("dc-asgd-adaptive")): _refused(_READ_WEIGHTS),
    ("replicas", policy_feature("gap-aware")): _refused(_READ_WEIGHTS),
    ("replicas", policy_feature("ssp-adaptive")): _refused(
        "it sets the SSP bound from wait times each replica measures on its own clock"),
    # local SGD (paramserver/workers/localsgd.py)
    ("local_sgd", "overlap"): _refused(
        "local SGD pushes the weights' change once per round, so there is no backward "
        "pass to overlap a push with"),
    ("local_sgd", "sparse"): _refused(
        "local SGD pushes the weights' change once per round; sparse tables push row "
        "gradients at every step"),
    ("local_sgd", "outer"): _works(
        "tests/test_localsgd.py::test_bf16_pseudo_gradients_under_delayed_nesterov_equal_"
        "the_replay"),
    ("local_sgd", "wire_dtype"): _works(
        "tests/test_localsgd.py::test_bf16_pseudo_gradients_under_delayed_nesterov_equal_"
        "the_replay"),
    ("outer", "wire_dtype"): _works(
        "tests/test_localsgd.py::test_bf16_pseudo_gradients_under_delayed_nesterov_equal_"
        "the_replay"),
    ("local_sgd", "command"): _works(
        "tests/test_localsgd.py::test_own_loop_with_sync_every_per_worker"),
    # your own script
    ("command", "overlap"): _works(
        "tests/test_own_loop_e2e.py::test_overlap_and_accumulation_give_the_same_sync_training"),
    ("command", policy_feature("reject")): _works(
        "tests/test_own_loop_e2e.py::test_a_staleness_policy_acts_on_the_users_pushes"),
    ("command", "sparse"): _works(
        "tests/test_sparse_e2e.py::test_sync_sparse_with_a_row_cache_equals_single_process_torch"),
    # a script's own optimizer (paramserver/workers/wrapped.py)
    ("script_optimizer", "command"): _works(
        "tests/test_wrapped_optimizer_e2e.py::"
        "test_the_scripts_optimizer_and_its_lr_change_run_on_the_servers"),
    ("script_optimizer", "resume"): _works(
        "tests/test_resume_e2e.py::test_the_ddp_port_resumes_bit_identical_by_opt_clock"),
    ("script_optimizer", "local_sgd"): _refused(
        "with local steps the worker runs the inner optimizer and the servers' is the "
        "outer one (--optimizer): wrap no optimizer in DistributedOptimizer with local="),
    # early parts (paramserver/core/ahead.py): a client option, so a command's too
    ("early_parts", "command"): _works(
        "tests/test_command_flags_e2e.py::"
        "test_stragglers_seed_and_client_options_act_and_opt_log_reports"),
    # sparse tables
    ("sparse", "resume"): _works(
        "tests/test_sparse_e2e.py::test_checkpoint_and_resume_of_sparse_shards_loses_nothing"),
    # resharding (paramserver/core/reshard.py)
    ("reshard", "sparse"): _works(
        "tests/test_reshard_e2e.py::"
        "test_sgd_momentum_with_embedding_tables_on_2_then_3_then_1_shards_ends_as_kept_on_2"),
    ("reshard", "replicas"): _works(
        "tests/test_reshard_e2e.py::test_adam_replicated_on_2_then_3_shards_ends_as_kept_on_2"),
    ("reshard", "resume"): _works(
        "tests/test_reshard_e2e.py::"
        "test_sgd_momentum_with_embedding_tables_on_2_then_3_then_1_shards_ends_as_kept_on_2"),
    # a resume on another shard count of a run with local SGD under delayed Nesterov, a
    # bf16 wire, early parts and CURVE, bit-identical to the run kept (a stateless inner
    # optimizer: local SGD x resume stays untested, an inner Adam's state is the worker's)
    **{(resumed, other): _works(_LIVE_RESUMED) for resumed in ("resume", "reshard")
       for other in ("outer", "wire_dtype", "early_parts", "curve")},
    # live resharding (paramserver/server/elastic.py, paramserver/workers/reshard.py)
    ("live_reshard", "replicas"): _refused(
        "a replicated shard's state moves between its replicas, not to another plan; "
        "checkpoint, `checkpoint reshard`, resume"),
    ("live_reshard", "sparse"): _refused(
        "a ShardedEmbedding keeps per-shard state in the worker that does not follow a "
        "move; checkpoint, `checkpoint reshard`, resume"),
    ("live_reshard", "pull_compression"): _refused(
        "a worker's reconstructions of compressed pulls are kept per shard of the old plan; "
        "checkpoint, `checkpoint reshard`, resume"),
    ("live_reshard", "trace"): _refused(
        "the replay runs one plan from a run's first push to its last"),
    ("live_reshard", "overlap"): _works(
        "tests/test_reshard_live_e2e.py::"
        "test_launch_reshard_at_moves_a_compressed_run_2_to_4_to_3_and_ends_as_kept_on_2"),
    # live resharding x the rest (tests/test_reshard_live_e2e.py)
    ("live_reshard", "outer"): _works(_LIVE_RESUMED),
    ("live_reshard", "local_sgd"): _works(_LIVE_RESUMED),
    ("live_reshard", "wire_dtype"): _works(_LIVE_RESUMED),
    ("live_reshard", "early_parts"): _works(_LIVE_RESUMED),
    ("live_reshard", "curve"): _works(_LIVE_RESUMED),
    ("live_reshard", "resume"): _works(_LIVE_RESUMED),
    ("live_reshard", "reshard"): _works(_LIVE_RESUMED),
    ("live_reshard", "compression"): _works(
        _LIVE + "test_launch_reshard_at_moves_a_compressed_run_2_to_4_to_3_and_ends_as_kept_on_2"),
    ("live_reshard", "command"): _works(_LIVE_SCRIPT),
    ("live_reshard", "script_optimizer"): _works(_LIVE_SCRIPT),
    ("live_reshard", "hosts"): _works(_LIVE_SCRIPT),
    ("live_reshard", policy_feature("reject")): _works(_LIVE_POLICY),
    ("live_reshard", policy_feature("exponential")): _works(_LIVE_POLICY),
    ("live_reshard", policy_feature("inverse")): _works(_LIVE_POLICY),
    ("live_reshard", "shm"): _works(_LIVE_POLICY),
    ("live_reshard", "backup_workers"): _refused(
        "a round closes without the slowest B, whose late push may have reached some "
        "shards and not others at the cut; move a run without --backup-workers"),
    ("live_reshard", policy_feature("dc-asgd-adaptive")): _refused(_PER_SHARD_STATS),
    ("live_reshard", policy_feature("gap-aware")): _refused(_PER_SHARD_STATS),
    ("live_reshard", policy_feature("ssp-adaptive")): _refused(
        "each shard sets its SSP bound from the waits it measures, so the bounds a move "
        "needs alike may differ at the cut; move an ssp run with a fixed --staleness-bound"),
    # compression (paramserver/compress): the dense push only
    ("local_sgd", "compression"): _works(
        "tests/test_compress_e2e.py::test_int8_pseudo_gradients_of_local_sgd_equal_the_replay"),
    ("replicas", "compression"): _works(
        "tests/test_compress_replicas_e2e.py::"
        "test_a_compressed_sync_run_survives_a_primary_sigkill_bit_identical"),
    ("command", "compression"): _works(
        "tests/test_compress_e2e.py::test_a_restarted_worker_continues_its_residuals"),
    ("compression", "sparse"): _refused(
        "a sparse table's row gradients are not compressed (only the dense push is); "
        "train it without --compression"),
    # the trace of a run and its replay (paramserver/observe/trace.py, workers/launch/replay.py)
    ("trace", policy_feature("dc-asgd")): _works(_TRACE + "test_own_policy_replays_bit_for_bit"),
    ("trace", "compression"): _works(_TRACE + "test_sync_compressed_run_with_backups_replays"),
    ("trace", "backup_workers"): _works(_TRACE + "test_sync_compressed_run_with_backups_replays"),
    ("trace", "outer"): _works(_TRACE + "test_sync_compressed_run_with_backups_replays"),
    ("trace", "replicas"): _refused(
        "every replica of a shard would write its trace; trace a run without --replicas"),
    ("trace", "sparse"): _refused(
        "the replay's shards are dense cores: a sparse table's row pushes are not traced"),
    ("trace", "command"): _refused(_TRACE_COMMAND),
    ("trace", "local_sgd"): _refused(
        "the replay recomputes one gradient per push; a local-SGD push is H inner steps"),
    ("trace", "resume"): _refused(_TRACE_RESUME),
    ("trace", "overlap"): _refused(
        "an overlapped push leaves in parts, which a sync shard adds in an order the "
        "trace does not keep"),
    ("trace", "wire_dtype"): _refused(
        "the replay pushes the gradients as computed; a 16-bit wire rounds them on the way"),
    ("trace", "hosts"): _refused(
        "the emulated hosts' processes write no trace yet"),
    # compressed pulls (paramserver/core/pullsqueeze.py): the dense weights' pull only
    ("replicas", "pull_compression"): _works(
        "tests/test_compress_replicas_e2e.py::"
        "test_a_compressed_sync_run_survives_a_primary_sigkill_bit_identical"),
    ("compression", "pull_compression"): _works(
        "tests/test_compress_e2e.py::test_a_sync_run_compressed_both_ways_equals_the_replay"),
    ("sparse", "pull_compression"): _refused(
        "a sparse table's rows are pulled as they are (only the dense weights' pull is "
        "compressed); train it without --pull-compression"),
    ("resume", "pull_compression"): _works(
        "tests/test_resume_e2e.py::test_the_built_in_loop_resumes_bit_identical"),
    ("reshard", "pull_compression"): _works(
        "tests/test_reshard_e2e.py::test_adam_replicated_on_2_then_3_shards_ends_as_kept_on_2"),
    # compression both ways and --trace beside the rest (tests/test_compress_trace_pairs_e2e.py)
    **{(f, policy_feature(p)): _works(_EACH_POLICY)
       for f in ("trace", "compression", "pull_compression") for p in BUILTIN_POLICIES
       if (f, p) != ("trace", "dc-asgd")},
    **{(f, g): _works(_EACH_POLICY) for f, g in (
        ("trace", "pull_compression"), ("trace", "curve"), ("compression", "curve"),
        ("pull_compression", "curve"))},
    ("trace", "shm"): _works(_SHM_RUN),
    ("pull_compression", "shm"): _works(_SHM_RUN),
    **{(f, g): _works(_EARLY_RUN) for f, g in (
        ("compression", "shm"), ("trace", "early_parts"), ("compression", "early_parts"),
        ("pull_compression", "early_parts"))},
    **{(f, g): _works(_TRACE + "test_sync_compressed_run_with_backups_replays")
       for f in ("compression", "pull_compression") for g in ("backup_workers", "outer")},
    ("pull_compression", "local_sgd"): _works(_LOCAL_RUN),
    ("pull_compression", "wire_dtype"): _works(_LOCAL_RUN),
    **{(f, g): _works(_SCRIPT_RUN) for f, g in (
        ("compression", "script_optimizer"), ("compression", "overlap"),
        ("pull_compression", "script_optimizer"), ("pull_compression", "overlap"),
        ("pull_compression", "command"))},
    **{(f, "hosts"): _works("tests/test_launch_hosts.py::"
                            "test_sync_on_hosts_ends_with_the_weights_of_sync_on_loopback")
       for f in ("compression", "pull_compression")},
    ("trace", "script_optimizer"): _refused(_TRACE_COMMAND),  # (a script runs as a command)
    ("trace", "reshard"): _refused(_TRACE_RESUME),  # (a checkpoint reshard is a --resume)
    ("compression", "wire_dtype"): _refused(
        "--compression sets the push's wire format itself: give one (--wire-dtype "
        "bfloat16 is --compression bf16)"),
    ("compression", "resume"): Pair("untested", why=_RESIDUALS),
    ("compression", "reshard"): Pair("untested", why=_RESIDUALS),
    # shared memory
    ("shm", "curve"): _works(
        "tests/test_shm_e2e.py::test_curve_peer_without_an_allow_list_entry_gets_no_segment"),
}

_UNTESTED = Pair("untested", why="no end-to-end test runs this pair yet")


def _table() -> dict[frozenset[str], Pair]:
    table: dict[frozenset[str], Pair] = {}
    for (a, b), p in _LISTED.items():
        if a not in FEATURES or b not in FEATURES or a == b:
            raise ValueError(f"unknown feature pair {a!r}, {b!r}")
        key = frozenset((a, b))
        if key in table:
            raise ValueError(f"pair {a!r}, {b!r} listed twice")
        table[key] = p
    for a, b in itertools.combinations(FEATURES, 2):
        key = frozenset((a, b))
        if key not in table:
            both_policies = a.startswith("policy:") and b.startswith("policy:")
            table[key] = (Pair("exclusive", why="a run has one --policy") if both_policies
                          else _UNTESTED)
    return table


#: every pair of :data:`FEATURES`, as a frozenset of the two names
PAIRS: Mapping[frozenset[str], Pair] = _table()


def pair(a: str, b: str) -> Pair:
    """What features ``a`` and ``b`` do together (a feature not in the table, a
    plug-in policy say: untested)."""
    return PAIRS.get(frozenset((a, b)), _UNTESTED)


def active(*, replicas: int = 0, sparse: bool = False, curve: bool = False,
           resume: bool = False, command: bool = False, local_sgd: bool = False,
           optimizer: str = "", policy: str = "none", backup_workers: int = 0,
           overlap: bool = False, wire_dtype: str | None = None,
           script_optimizer: bool = False, compression: str | None = None,
           trace: bool = False, pull_compression: str | None = None) -> set[str]:
    """The features a run's settings turn on (each side passes what it knows)."""
    on = {name for name, given in (
        ("replicas", replicas), ("sparse", sparse), ("curve", curve), ("resume", resume),
        ("command", command), ("local_sgd", local_sgd),
        ("outer", optimizer.lower() == "delayed-nesterov"),
        ("backup_workers", backup_workers), ("overlap", overlap),
        ("wire_dtype", wire_dtype not in (None, "none")),
        ("compression", compression not in (None, "none")),
        ("pull_compression", pull_compression not in (None, "none")),
        ("script_optimizer", script_optimizer), ("trace", trace)) if given}
    if policy and policy != "none":
        on.add(policy_feature(policy))
    return on


def of_run(server: Iterable[str], worker: Iterable[str], command: bool, task: str) -> set[str]:
    """A run's features: its shards' and its workers' (``ServerConfig.features``,
    ``WorkerConfig.features``), a command, and sparse tables where the built-in task
    has them (a command's are known once its DistributedOptimizer is built, which
    checks them, and at the shards its plan reaches)."""
    return {*server, *worker, *active(command=command,
                                      sparse=not command and task in SPARSE_TASKS)}


def check(features: Iterable[str]) -> None:
    """Refuse (ConfigError, one line) the first pair of ``features`` the table refuses."""
    on = sorted(set(features), key=lambda f: (list(FEATURES).index(f) if f in FEATURES
                                               else len(FEATURES), f))
    for a, b in itertools.combinations(on, 2):
        p = pair(a, b)
        if p.status == "refused":
            raise ConfigError(f"{_name(a)} does not work with {_name(b)}: {p.why}")


def _name(feature: str) -> str:
    if feature.startswith("policy:"):  # (a plug-in policy too)
        return f"--policy {feature[7:]}"
    return FEATURES.get(feature, feature)


def markdown() -> str:
    """The table as docs/reliability.md shows it: the refused pairs and the working ones
    with their tests, then the pairs no test runs yet."""
    rows = ["| Features | Together | Why, or the test that shows it |", "|---|---|---|"]
    untested: list[str] = []
    for key, p in sorted(PAIRS.items(), key=lambda kv: sorted(
            list(FEATURES).index(f) for f in kv[0])):
        a, b = sorted(key, key=list(FEATURES).index)
        if p.status == "untested":
            untested.append(f"{a} + {b}")
        elif p.status != "exclusive":
            detail = f"`{p.test}`" if p.status == "works" else p.why
            rows.append(f"| {a} + {b} | {p.status} | {detail} |")
    return "\n".join([*rows, "", "Untested (nothing refuses them; no end-to-end test runs "
                      "them yet): " + ", ".join(untested) + "."])
