"""The training loop of one worker: pull, compute, (inject slowness), push, repeat.

One iteration = one push. With ``push_every = k`` the worker accumulates the
gradients of k local mini-batches (their sample-weighted mean) before pushing
them as one update covering all their samples. The worker's clock counts its
pushes; a (re)joining worker resumes at the clock its shards give it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from paramserver.core.optim import build_optimizer
from paramserver.errors import (
    ConfigError,
    TooManyWorkersError,
    WorkerInUseError,
    WrongRunError,
)
from paramserver.observe import records as ev
from paramserver.observe.console import Progress, Sink
from paramserver.observe.events import EventLog, write_json
from paramserver.util import lifeline
from paramserver.util.proctitle import set_title
from paramserver.workers.clientconfig import ClientConfig
from paramserver.workers.config import WorkerConfig
from paramserver.workers.optimizer import DistributedOptimizer, WorkerResult
from paramserver.workers.tasks import (
    Task,
    create_task,
    evaluate,
    resolve_task,
    task_parameters,
)

__all__ = ["WorkerConfig", "WorkerResult", "resolve_device", "run_worker"]

log = logging.getLogger(__name__)


def resolve_device(spec: str) -> torch.device:
    """``auto`` (CUDA if present, else CPU), ``cpu`` or ``cuda[:N]``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ConfigError(f"device must be auto, cpu or cuda:N; got {spec!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda:N; got {spec!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {spec!r} asked for, but CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    return device


def build_task(config: WorkerConfig) -> Task:
    """The task for this worker, with batch_size and seed passed where accepted."""
    args = dict(config.task_args)
    accepted = task_parameters(resolve_task(config.task))
    if config.batch_size is not None and "batch_size" in accepted:
        args.setdefault("batch_size", config.batch_size)
    if "seed" in accepted:
        args.setdefault("seed", config.seed)
    return create_task(config.task, config.rank, config.world_size, args)


def cycle_batches(task: Task, skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The task's batches, epoch after epoch, from the ``skip``-th on (a resumed worker's
    data goes on where it stopped: whole epochs by ``set_epoch``, the rest drawn and
    dropped, so every batch after it is the one the run would have drawn)."""
    epoch = 0
    set_epoch = getattr(task.batches, "set_epoch", None)
    if skip and callable(set_epoch) and hasattr(task.batches, "__len__"):
        per_epoch = len(task.batches)  # type: ignore[arg-type]
        if per_epoch:
            epoch, skip = divmod(skip, per_epoch)
            set_epoch(epoch)
    while True:
        empty = True
        for batch in task.batches:
            empty = False
            if skip:
                skip -= 1
                continue
            yield batch
        if empty:
            raise ConfigError("the task's batches are empty")
        epoch += 1
        if callable(set_epoch):
            set_epoch(epoch)


#: the step cap of a worker with a time budget and neither steps nor epochs
UNCAPPED = sys.maxsize


def num_steps(config: WorkerConfig, task: Task) -> int:
    if config.steps is not None:
        return config.steps
    if config.epochs is None:  # budget_seconds alone (validated): the budget stops it
        return UNCAPPED
    try:
        per_epoch = len(task.batches)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigError("epochs need a task whose batches have a length; give steps") from exc
    return max(1, math.ceil(config.epochs * per_epoch / config.push_every))


def worker_title(config: WorkerConfig) -> None:
    """Name this process after the worker it runs (``ps``, ``top``); for the entry
    points that make a process a worker, never for a library call."""
    set_title(f"worker {config.rank}/{config.world_size} ({config.task})")


def run_worker(config: WorkerConfig, console: Sink | None = None) -> WorkerResult:
    """Train until ``steps`` pushes are done (or ``budget_seconds`` have passed since the
    first step); return (and write) the worker's result. ``console``: shown the event
    records as they are written (e.g. a progress line).

    The task's loop on :class:`~paramserver.workers.optimizer.DistributedOptimizer`:
    the same push and pull a user's own loop makes."""
    if not config.servers:  # empty is fine in a ClusterSpec: the launcher fills it in
        raise ConfigError("a worker needs at least one server address (--servers)")
    device = resolve_device(config.device)
    task = build_task(config)
    model = task.model.to(device)
    trace = None
    if config.trace:  # --trace: each step's reads and times, beside the shards' (replay.py)
        from paramserver.observe import trace as tr

        trace = tr.TraceWriter(config.trace, tr.Header(
            tr.FORMAT, "worker", config.rank, config.to_dict(), torch.get_num_threads(),
            tr.DEFAULT_CAP))
        console = tr.StepSink(trace, console)
    events = EventLog(config.event_log, console=console)
    steps = num_steps(config, task)
    # local steps: --steps counts gradients computed, the clock counts pushes
    pushes = steps if steps == UNCAPPED else math.ceil(steps / config.sync_every)
    local = (None if config.local_optimizer is None else
             build_optimizer(config.local_optimizer, model.parameters(), config.local_args))
    losses: list[float] = []
    t_start = time.time()
    # every rank builds the task's model from the same seed: any may seed the servers
    opt = DistributedOptimizer(
        model, overlap=config.overlap, backward_passes_per_step=config.push_every,
        local=local, sync_every=config.sync_every,
        config=ClientConfig.of(config, offer_weights=True, events=events))
    # a resumed run's worker starts at the clock its shards give it: its data goes on
    # from the batch after the last one its pushes hold (each push: push_every batches,
    # sync_every times with local steps)
    batches = cycle_batches(task, skip=opt.clock * config.push_every * config.sync_every)
    with opt:
        opt.seed()  # now, not at the first step: the budget's clock starts there
        events.write(ev.WorkerStart(worker=config.rank, clock=opt.clock, seeded=opt.seeded,
                                    device=str(device), steps=steps, plan_hash=opt.plan.hash))
        log.info("worker %d: %s on %s from clock %d", config.rank,
                 f"{steps} steps" if steps != UNCAPPED else "no step cap", device, opt.clock)
        # the budget runs from this worker's first step (not from process start, whose
        # import and connection time differ between workers and runs): every worker of
        # every mode trains for the same seconds, the last step ending <= 1 step after
        t_train = time.monotonic()
        deadline = t_train + config.budget_seconds if config.budget_seconds else math.inf
        budget_spent = False
        while opt.clock < pushes:  # the clock counts pushes; a rejoining worker resumes
            if time.monotonic() >= deadline:
                budget_spent = True
                log.info("worker %d: budget of %gs spent at clock %d", config.rank,
                         config.budget_seconds, opt.clock)
                break
            if (opt.evaluates and config.eval_every and opt.clock % config.eval_every == 0
                    and (opt.local is None or opt.local.taken == 0)):  # not mid-round
                _log_eval(opt, task, model)
            # step() injects this worker's straggler delay and logs it apart
            total, loss_value = _compute(opt, task, model, batches, device, config.push_every)
            losses.append(loss_value)
            opt.step(num_samples=total, loss=loss_value)
        train_seconds = time.monotonic() - t_train
        final_eval = None
        if opt.evaluates:  # the final weights, once every worker is done (a straggler too)
            opt.final()
            # evaluated while connected: a ShardedEmbedding pulls its rows from the shards
            final_eval = _log_eval(opt, task, model)
        else:
            opt.pull()  # the weights as this worker ends (its final_versions)
    result = dataclasses.replace(
        opt.result(time.time() - t_start),
        final_train_loss=sum(losses[-10:]) / max(1, len(losses[-10:])),
        train_seconds=train_seconds, budget_seconds=config.budget_seconds,
        budget_spent=budget_spent, eval=final_eval)
    data = result.to_json()
    events.write(result.to_event())
    events.close()
    if trace is not None:
        trace.close()
    if config.result_file:
        write_json(config.result_file, data)
    return result


Batch = tuple[torch.Tensor, torch.Tensor]


def _compute(opt: DistributedOptimizer, task: Task, model: torch.nn.Module,
             batches: Iterator[Batch], device: torch.device,
             micro_batches: int) -> tuple[int, float]:
    """The step's gradient: the sample-weighted mean over ``micro_batches`` batches
    (with overlap, its buckets leave during the last backward). Returns (samples,
    mean loss); the compute time runs from ``zero_grad()``, in the optimizer."""
    model.train()
    opt.zero_grad(set_to_none=True)
    drawn = [next(batches) for _ in range(micro_batches)]
    sizes = [int(targets.shape[0]) for _, targets in drawn]
    total = sum(sizes)
    loss_sum = 0.0
    for i, ((inputs, targets), n) in enumerate(zip(drawn, sizes, strict=True)):
        inputs, targets = inputs.to(device), targets.to(device)
        loss = task.loss_fn(model(inputs), targets)
        loss_sum += float(loss.detach()) * n
        if i == micro_batches - 1:  # before the last backward: overlapped parts carry them
            opt.set_num_samples(total, loss=loss_sum / total)
        # scaled so that the accumulated gradient is the mean over all samples as it
        # is produced (with overlap there is no pass afterwards to divide it)
        (loss * (n / total)).backward()
    return total, loss_sum / total


def _log_eval(opt: DistributedOptimizer, task: Task,
              model: torch.nn.Module) -> dict[str, float]:
    """Held-out figures of the model now, logged as a user's loop logs them."""
    metrics = evaluate(task, model)
    opt.log(**{f"eval_{k}": v for k, v in metrics.items()})
    return metrics


def main(argv: list[str] | None = None) -> None:
    """``python -m paramserver.workers.worker CONFIG.json``: how the launcher starts a worker."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m paramserver.workers.worker CONFIG.json")
    config = WorkerConfig.from_dict(json.loads(Path(args[0]).read_text()))
    logging.basicConfig(
        level=os.environ.get("PARAMSERVER_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s worker{config.rank} %(levelname)s %(name)s: %(message)s",
    )
    worker_title(config)
    lifeline.watch()  # started by a launcher: end with it, however it ends
    try:
        run_worker(config, Progress())  # a line every few seconds in the worker's log
    except (WorkerInUseError, TooManyWorkersError, WrongRunError) as exc:
        # a shard will not take this worker: one line that says why, exit status 1
        raise SystemExit(f"worker {config.rank}: {exc.reason}") from exc


if __name__ == "__main__":
    main()
