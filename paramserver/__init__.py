"""paramserver: sharded parameter servers for sync, async and bounded-staleness training.

The names a user writes, all importable from here::

    from paramserver import ClusterSpec, ServerConfig, WorkerConfig, run_cluster

Each is loaded on first use, so ``import paramserver`` stays light: it imports
neither torch nor any plotting, data-set or terminal library until a name that
needs one is touched. The package's layers, from the bottom (docs/design.md
has the map; import-linter keeps it):

* ``errors``, ``util``, ``policies``, ``sparse`` and ``core``: the pure rules,
  no I/O;
* ``wire`` (typed messages, frames, sockets), ``shm``, ``observe``,
  ``persist``, then ``server``;
* ``paramserver.workers``: the worker side (client, DistributedOptimizer,
  training loop, tasks), then ``workers.launch`` and ``workers.experiments``;
* ``paramserver.benchmarks``, then ``paramserver.cli`` on top.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # errors: one tree under ParamServerError
    "ParamServerError": "paramserver.errors",
    "ConfigError": "paramserver.errors",
    "RegistryError": "paramserver.errors",
    "ProtocolError": "paramserver.errors",
    "RemoteError": "paramserver.errors",
    "TransportError": "paramserver.errors",
    "RequestTimeoutError": "paramserver.errors",
    "ErrorCode": "paramserver.errors",
    # what a client raises for each ErrorCode a server answers (errors.REMOTE_ERRORS)
    "BadRequestError": "paramserver.errors",
    "BusyError": "paramserver.errors",
    "DuplicateWorkerError": "paramserver.errors",
    "ForbiddenError": "paramserver.errors",
    "FutureVersionError": "paramserver.errors",
    "IncompatiblePlanError": "paramserver.errors",
    "NonFiniteError": "paramserver.errors",
    "NotInitializedError": "paramserver.errors",
    "NotRegisteredError": "paramserver.errors",
    "ProtocolVersionError": "paramserver.errors",
    "RemoteInternalError": "paramserver.errors",
    "TooManyWorkersError": "paramserver.errors",
    "TrainingStoppedError": "paramserver.errors",
    # staleness policies: the plug-in point of the server's rules
    "StalenessPolicy": "paramserver.policies",
    "Decision": "paramserver.policies",
    "UpdateInfo": "paramserver.policies",
    "register_policy": "paramserver.policies",
    "available_policies": "paramserver.policies",
    "create_policy": "paramserver.policies",
    # the server
    "ServerConfig": "paramserver.server.loop",
    "ShardServer": "paramserver.server.loop",
    "ShardPlan": "paramserver.core.sharding",
    "TableSpec": "paramserver.sparse.shard",
    # the worker side
    "PSClient": "paramserver.workers.client",
    "Task": "paramserver.workers.tasks",
    "EpochBatches": "paramserver.workers.tasks",
    "register_task": "paramserver.workers.tasks",
    "available_tasks": "paramserver.workers.tasks",
    "WorkerConfig": "paramserver.workers.worker",
    "ClientConfig": "paramserver.workers.clientconfig",
    "DistributedOptimizer": "paramserver.workers.optimizer",
    "DistributedSampler": "paramserver.workers.optimizer",
    "ShardedEmbedding": "paramserver.workers.embedding",
    "ShardedEmbeddingBag": "paramserver.workers.embedding",
    "StepOutcome": "paramserver.workers.optimizer",
    "run_worker": "paramserver.workers.worker",
    "WorkerResult": "paramserver.workers.optimizer",
    # launching
    "ClusterSpec": "paramserver.workers.launch.cluster",
    "LocalCluster": "paramserver.workers.launch.cluster",
    "run_cluster": "paramserver.workers.launch.cluster",
    "ClusterResult": "paramserver.workers.launch.results",
    "ShardStats": "paramserver.wire.stats",
    "SimSpec": "paramserver.workers.launch.virtual",
    "run_simulation": "paramserver.workers.launch.virtual",
    # experiments
    "ExperimentSpec": "paramserver.workers.experiments.spec",
    "load_spec": "paramserver.workers.experiments.spec",
    "write_report": "paramserver.workers.experiments.report",
    "run_experiment": "paramserver.workers.experiments.runner",
    "simulate_experiment": "paramserver.workers.experiments.runner",
}

__all__ = [
    "BadRequestError",
    "BusyError",
    "ClientConfig",
    "ClusterResult",
    "ClusterSpec",
    "ConfigError",
    "Decision",
    "DistributedOptimizer",
    "DistributedSampler",
    "DuplicateWorkerError",
    "EpochBatches",
    "ErrorCode",
    "ExperimentSpec",
    "ForbiddenError",
    "FutureVersionError",
    "IncompatiblePlanError",
    "LocalCluster",
    "NonFiniteError",
    "NotInitializedError",
    "NotRegisteredError",
    "PSClient",
    "ParamServerError",
    "ProtocolError",
    "ProtocolVersionError",
    "RegistryError",
    "RemoteError",
    "RemoteInternalError",
    "RequestTimeoutError",
    "ServerConfig",
    "ShardPlan",
    "ShardServer",
    "ShardStats",
    "ShardedEmbedding",
    "ShardedEmbeddingBag",
    "SimSpec",
    "StalenessPolicy",
    "StepOutcome",
    "TableSpec",
    "Task",
    "TooManyWorkersError",
    "TrainingStoppedError",
    "TransportError",
    "UpdateInfo",
    "WorkerConfig",
    "WorkerResult",
    "__version__",
    "available_policies",
    "available_tasks",
    "create_policy",
    "load_spec",
    "register_policy",
    "register_task",
    "run_cluster",
    "run_experiment",
    "run_simulation",
    "run_worker",
    "simulate_experiment",
    "write_report",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads these
    from paramserver.core.sharding import ShardPlan
    from paramserver.errors import (
        BadRequestError,
        BusyError,
        ConfigError,
        DuplicateWorkerError,
        ErrorCode,
        ForbiddenError,
        FutureVersionError,
        IncompatiblePlanError,
        NonFiniteError,
        NotInitializedError,
        NotRegisteredError,
        ParamServerError,
        ProtocolError,
        ProtocolVersionError,
        RegistryError,
        RemoteError,
        RemoteInternalError,
        RequestTimeoutError,
        TooManyWorkersError,
        TrainingStoppedError,
        TransportError,
    )
    from paramserver.policies import (
        Decision,
        StalenessPolicy,
        UpdateInfo,
        available_policies,
        create_policy,
        register_policy,
    )
    from paramserver.server.loop import ServerConfig, ShardServer
    from paramserver.sparse.shard import TableSpec
    from paramserver.wire.stats import ShardStats
    from paramserver.workers.client import PSClient
    from paramserver.workers.clientconfig import ClientConfig
    from paramserver.workers.embedding import ShardedEmbedding, ShardedEmbeddingBag
    from paramserver.workers.experiments.report import write_report
    from paramserver.workers.experiments.runner import run_experiment, simulate_experiment
    from paramserver.workers.experiments.spec import ExperimentSpec, load_spec
    from paramserver.workers.launch.cluster import ClusterSpec, LocalCluster, run_cluster
    from paramserver.workers.launch.results import ClusterResult
    from paramserver.workers.launch.virtual import SimSpec, run_simulation
    from paramserver.workers.optimizer import (
        DistributedOptimizer,
        DistributedSampler,
        StepOutcome,
        WorkerResult,
    )
    from paramserver.workers.tasks import EpochBatches, Task, available_tasks, register_task
    from paramserver.workers.worker import WorkerConfig, run_worker
