"""The end of training a script can use: :func:`finish`, behind
:meth:`DistributedOptimizer.final() <paramserver.workers.optimizer.DistributedOptimizer.final>`.

A worker's last ``step()`` is its own end, not training's: in async and SSP a straggler
pushes on after the fast workers stopped, and its pushes change the weights. The final
weights exist once every worker is done: each said BYE or was judged gone by the usual
liveness rules (the heartbeat timeout, its supervisor's death report), which is the
shard's ``holding`` rule (paramserver/core/membership.py). So :func:`finish` sends every
shard a *final pull* (an observer's pull the shard holds until no expected worker is
awaited or live there, and then answers with its weights) and, pipelined behind it on the
same connection, this worker's BYE (no sync round or SSP gate waits for it any more). The
order matters: a shard that stops once every worker is done (``paramserver run``) has the
pull parked before the BYE that may end its job, and answers it before it stops. It is
waited for as a pull held at a gate is (workers/liveness.py): while the shards' heartbeat
answers say they hold it, for at most ``timeout``; past it the error names the workers a
shard still waits for.

Afterwards the worker reads as an observer (``opt.pull()``, a ShardedEmbedding's rows),
and what it logs with ``opt.log(eval_...)`` is marked ``final``: the figures of the final
weights, which result.json and the experiment report take as the run's final figures.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from paramserver.errors import ConfigError
from paramserver.observe import records as ev

if TYPE_CHECKING:
    from paramserver.workers.optimizer import DistributedOptimizer

__all__ = ["FINAL_TIMEOUT", "finish"]

log = logging.getLogger(__name__)

#: how long final() waits for the other workers by default (torch.distributed's default
#: process-group timeout too): a straggler's remaining steps, not a hang
FINAL_TIMEOUT = 1800.0


def finish(opt: DistributedOptimizer, timeout: float) -> tuple[int, ...]:
    """Say BYE for ``opt``'s worker, wait until every worker is done, and load the final
    weights into its parameters; returns their versions per shard. Called again, it
    returns them at once."""
    if timeout < 0:
        raise ConfigError(f"final(timeout=...) must be >= 0 (0: no bound), got {timeout}")
    if opt.finished:
        return tuple(opt.versions)
    opt.seed()  # the ranks waiting for this one's weights must not wait forever
    opt._flush()
    if opt._buckets is not None:  # no backward may push any more
        opt._buckets.remove()
    client = opt.client
    # an observer from now on; said before the BYE, which may end a shard's job
    client.observe()
    opt.finished = True  # the BYE goes out now: no round or gate waits for it any more
    t0 = time.monotonic()
    log.info("worker %d: done at clock %d; waiting for the other workers to finish",
             opt.rank, opt.clock)
    with torch.no_grad():  # the final pull first: a shard holds it before it sees the BYE
        pulled = client.bye_final(opt.params, timeout)
    opt.versions = pulled.versions
    if opt.local is not None:  # the final weights replace the local ones
        opt.local.mark()
    opt._events.write(ev.Final(worker=opt.rank, clock=opt.clock, versions=list(pulled.versions),
                               waited_s=time.monotonic() - t0))
    return tuple(pulled.versions)
