"""A run's final figures and final model: the launcher pulls the final weights once
every worker is done, saves them as ``final_model.safetensors`` and evaluates them;
a command run's figures are what its script logged, labelled by whether it logged
them after ``opt.final()`` (the final weights) or in its loop."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from paramserver.observe.events import read_events
from paramserver.observe.figures import EVAL_FIELDS
from paramserver.workers.launch.clusterspec import ClusterSpec
from paramserver.workers.launch.results import FINAL_WEIGHTS, LAST_IN_LOOP

__all__ = ["final_eval", "final_figures", "logged_eval"]

log = logging.getLogger(__name__)


def final_eval(spec: ClusterSpec, addresses: list[str], out: Path) -> dict[str, float]:
    """The run's final held-out figures (:func:`final_figures`)."""
    return final_figures(spec, addresses, out)[0]


def final_figures(spec: ClusterSpec, addresses: list[str], out: Path
                  ) -> tuple[dict[str, float], str | None]:
    """Pull the final weights as an observer, save them as ``final_model.safetensors``
    (a state_dict for ``load_state_dict``) and, unless ``spec.evaluate`` is off,
    evaluate them on held-out data; returns the figures and what they are of
    (FINAL_WEIGHTS, LAST_IN_LOOP; None: none). A command run's figures are what its
    script logged (:func:`logged_eval`): the launcher has no task to evaluate."""
    from safetensors.torch import save_file

    from paramserver.core.sharding import ShardPlan
    from paramserver.workers.client import PSClient
    from paramserver.workers.tasks import evaluate
    from paramserver.workers.worker import build_task

    if spec.command:
        _save_command_weights(spec, addresses, out)
        return logged_eval(out, spec.num_workers)
    cfg = dataclasses.replace(spec.worker, rank=0, world_size=spec.num_workers,
                              servers=addresses)
    task = build_task(cfg)
    plan = ShardPlan.from_module(task.model, len(addresses), cfg.chunk_bytes)
    with PSClient(addresses, plan, worker=0, role="observer", heartbeat_interval=0,
                  timeout=cfg.timeout, curve=spec.client_curve()) as client:
        client.connect()
        client.pull(dict(task.model.named_parameters()))
        state = {k: v.detach().contiguous() for k, v in task.model.state_dict().items()}
        if plan.sparse:  # the tables too, under nn.Embedding's names, in parts of rows
            from paramserver.workers.embedding import pull_tables
            state.update(pull_tables(client, plan.sparse))
    save_file(state, str(out / "final_model.safetensors"))  # with or without --no-eval
    if not spec.evaluate:
        return {}, None
    if plan.sparse:  # the evaluator evaluated them after opt.final(), while connected
        return logged_eval(out, spec.num_workers)
    return evaluate(task), FINAL_WEIGHTS


def logged_eval(out: Path, num_workers: int) -> tuple[dict[str, float], str | None]:
    """A command run's held-out figures: the last ``eval`` record (``opt.log(eval_...)``)
    of the evaluating rank, the lowest that logged one ({}: none did), and what they are
    of: FINAL_WEIGHTS if it was logged after ``opt.final()``, else LAST_IN_LOOP."""
    for rank in range(num_workers):
        path = out / "events" / f"worker{rank}.jsonl"
        evals = read_events(path, "eval") if path.exists() else []
        if evals:
            last = evals[-1]
            return ({k: float(v) for k, v in last.items() if k not in EVAL_FIELDS
                     and isinstance(v, int | float) and not isinstance(v, bool)},
                    FINAL_WEIGHTS if last.get("final") is True else LAST_IN_LOOP)
    return {}, None


def _save_command_weights(spec: ClusterSpec, addresses: list[str], out: Path) -> None:
    """The servers' weights of a command's model, by the plan its rank 0 recorded."""
    from paramserver.workers.admin import save_final_model
    from paramserver.workers.scriptenv import read_plan

    plan = read_plan(out / "plan.json")
    if plan is None:
        log.warning("no %s (no worker got as far as DistributedOptimizer): no final model",
                    out / "plan.json")
        return
    if plan.num_shards != len(addresses):  # recorded before a live move (--reshard-at)
        from paramserver.workers.planmove import moved_plan

        plan = moved_plan(plan, len(addresses))
    save_final_model(addresses, plan, out / "final_model.safetensors", spec.worker.timeout,
                     spec.client_curve())
