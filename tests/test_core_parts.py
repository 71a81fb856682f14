"""Sync pushes in parts: added into the round as they arrive, with no sockets.

A part is a subset of the shard's slices; the push is decided at its first
part and joins the round at its last. These tests pin down that the result
is the same as whole pushes, that retried parts are not added twice, and what
happens to a round when a push is given up half-way (it is void: no step).
"""

from __future__ import annotations

import random

import pytest
import torch

from paramserver.core import probe as probe_module
from paramserver.core.shard import CoreConfig, ModeSpec, ShardCore, SliceSpec
from paramserver.errors import ErrorCode, ProtocolError
from paramserver.policies.research import DCASGDPolicy

SLICES = [SliceSpec(f"k{i}", 3 + i, "float64") for i in range(5)]


def make_core(workers=2, mode="sync", backups=0, momentum=0.9, policy=None):
    cfg = CoreConfig(mode=ModeSpec(mode, 0, backups), optimizer="sgd",
                     optimizer_args={"lr": 0.1, "momentum": momentum},
                     expected_workers=workers, heartbeat_timeout=10.0)
    core = ShardCore(SLICES, cfg, policy)
    for w in range(workers):
        core.register(w, f"inc{w}", now=0.0)
    gen = torch.Generator().manual_seed(0)
    core.initialize({s.key: torch.randn(s.numel, generator=gen, dtype=torch.float64)
                     for s in SLICES})
    return core


def gradient(worker, step):
    gen = torch.Generator().manual_seed(1000 * worker + step)
    return {s.key: torch.randn(s.numel, generator=gen, dtype=torch.float64) for s in SLICES}


def split(grads, sizes):
    """The gradient's keys in consecutive groups of the given sizes."""
    keys, out, at = list(grads), [], 0
    for n in sizes:
        out.append({k: grads[k] for k in keys[at:at + n]})
        at += n
    assert at == len(keys)
    return out


def push_parts(core, worker, push_id, grads_parts, clock=0, read_version=None, n=1,
               order=None):
    """Send every part (in ``order``); the outcome of the last one."""
    rv = core.version if read_version is None else read_version
    order = range(len(grads_parts)) if order is None else order
    outs = [core.push(worker, push_id, clock, rv, n, grads_parts[i], 0.0, i,
                           len(grads_parts)) for i in order]
    assert all(o is None for o in outs[:-1])
    return outs[-1]


def counters_reconcile(core):
    for state in core.workers.values():
        assert state.pushes == state.applied + sum(state.rejected.values()), state.summary()


def test_parts_in_any_order_equal_whole_pushes():
    whole, parted = make_core(3), make_core(3)
    rng = random.Random(4)
    for step in range(4):
        for w in range(3):
            g = gradient(w, step)
            whole.push(w, step + 1, step, whole.version, w + 1, g, 0.0)
            order = list(range(3))
            rng.shuffle(order)
            out = push_parts(parted, w, step + 1, split(g, [2, 1, 2]), clock=step, n=w + 1,
                             order=order)
            assert out is not None and out.accepted
        assert whole.version == parted.version == step + 1
    for key in whole.params:
        assert torch.equal(whole.params[key], parted.params[key]), key
    counters_reconcile(parted)


def test_a_part_sent_again_is_added_once():
    once, twice = make_core(1), make_core(1)
    g = gradient(0, 0)
    push_parts(once, 0, 1, split(g, [3, 2]))
    parts = split(g, [3, 2])
    assert twice.push(0, 1, 0, 0, 1, parts[0], 0.0, 0, 2) is None
    assert twice.push(0, 1, 0, 0, 1, parts[0], 0.0, 0, 2) is None  # a retry
    out = twice.push(0, 1, 0, 0, 1, parts[1], 0.0, 1, 2)
    assert out is not None and out.applied
    # the whole push retried after its outcome was lost: a duplicate, not applied again
    again = twice.push(0, 1, 0, 0, 1, parts[1], 0.0, 1, 2)
    assert again is not None and again.duplicate
    for key in once.params:
        assert torch.equal(once.params[key], twice.params[key])
    assert twice.workers[0].pushes == 1


def test_a_round_does_not_close_before_the_last_part():
    core = make_core(2)
    push_parts(core, 0, 1, split(gradient(0, 0), [5]))
    parts = split(gradient(1, 0), [1, 1, 3])
    assert core.push(1, 1, 0, 0, 1, parts[0], 0.0, 0, 3) is None
    assert core.push(1, 1, 0, 0, 1, parts[1], 0.0, 1, 3) is None
    assert core.version == 0
    out = core.push(1, 1, 0, 0, 1, parts[2], 0.0, 2, 3)
    assert out is not None and out.applied and core.version == 1


@pytest.mark.parametrize(("case", "code"), [
    ("header", ErrorCode.BAD_FIELD),
    ("key_twice", ErrorCode.BAD_TENSOR),
    ("missing", ErrorCode.BAD_TENSOR),
    ("part_range", ErrorCode.BAD_FIELD),
])
def test_malformed_parts_are_refused(case, code):
    core = make_core(1)
    g = gradient(0, 0)
    first, second = split(g, [2, 3])
    if case == "part_range":
        with pytest.raises(ProtocolError) as err:
            core.push(0, 1, 0, 0, 1, first, 0.0, 2, 2)
        assert err.value.code == code
        return
    core.push(0, 1, 0, 0, 1, first, 0.0, 0, 2)
    with pytest.raises(ProtocolError) as err:
        if case == "header":  # another sample count than the first part's
            core.push(0, 1, 0, 0, 7, second, 0.0, 1, 2)
        elif case == "key_twice":
            core.push(0, 1, 0, 0, 1, {**second, "k0": g["k0"]}, 0.0, 1, 2)
        else:  # the last part leaves a key out
            core.push(0, 1, 0, 0, 1, dict(list(second.items())[1:]), 0.0, 1, 2)
    assert err.value.code == code


def test_async_shards_take_pushes_whole():
    core = make_core(1, mode="async")
    assert not core.streams_parts
    with pytest.raises(ProtocolError) as err:
        core.push(0, 1, 0, 0, 1, split(gradient(0, 0), [2, 3])[0], 0.0, 0, 2)
    assert err.value.code == ErrorCode.BAD_FIELD


def test_a_rewriting_policy_gets_whole_pushes():
    assert not make_core(1, policy=DCASGDPolicy()).streams_parts
    assert make_core(1).streams_parts


def test_a_non_finite_part_voids_the_round():
    core = make_core(2)
    push_parts(core, 0, 1, split(gradient(0, 0), [5]))
    first, second = split(gradient(1, 0), [2, 3])
    core.push(1, 1, 0, 0, 1, first, 0.0, 0, 2)
    second["k3"][1] = float("nan")
    with pytest.raises(ProtocolError) as err:
        core.push(1, 1, 0, 0, 1, second, 0.0, 1, 2)
    assert err.value.code == ErrorCode.NONFINITE
    before = {k: p.clone() for k, p in core.params.items()}
    # worker 1 pushes again for the same round: the round closes, void, without a step
    out = push_parts(core, 1, 2, split(gradient(1, 0), [5]))
    assert out is not None and not out.applied
    assert core.version == 0 and core.rounds_voided == 1
    assert all(torch.equal(before[k], p) for k, p in core.params.items())
    assert core.workers[1].rejected["incomplete"] == 1
    counters_reconcile(core)
    # the next round is a normal one
    push_parts(core, 0, 2, split(gradient(0, 1), [5]), clock=1)
    out = push_parts(core, 1, 3, split(gradient(1, 1), [1, 4]), clock=1)
    assert out is not None and out.applied and core.version == 1


@pytest.mark.parametrize("how", ["declared_dead", "timed_out", "restarted", "newer_push"])
def test_a_push_given_up_half_way_voids_the_round(how):
    core = make_core(2)
    first, _ = split(gradient(1, 0), [2, 3])
    core.push(1, 1, 0, 0, 1, first, 0.0, 0, 2)
    push_parts(core, 0, 1, split(gradient(0, 0), [5]))
    assert core.version == 0  # waits for worker 1
    if how == "declared_dead":
        assert core.declare_dead(1)
    elif how == "timed_out":
        core.heartbeat(0, 11.0)
        assert core.expire(11.0) == [1]
    elif how == "restarted":
        core.heartbeat(0, 11.0)
        core.register(1, "another incarnation", now=11.0)
        push_parts(core, 1, 1, split(gradient(1, 0), [5]))
    else:
        push_parts(core, 1, 2, split(gradient(1, 0), [5]))
    assert core.version == 0 and core.rounds_voided == 1 and core.rounds_dropped == 1
    counters_reconcile(core)


def test_a_late_part_of_a_push_given_up_is_not_added():
    core = make_core(1)
    old, new = split(gradient(0, 0), [2, 3]), split(gradient(0, 1), [2, 3])
    core.push(0, 1, 0, 0, 1, old[0], 0.0, 0, 2)
    core.push(0, 2, 0, 0, 1, new[0], 0.0, 0, 2)  # push 1 given up: the round is void
    late = core.push(0, 1, 0, 0, 1, old[1], 0.0, 1, 2)
    assert late is not None and late.duplicate and not late.accepted
    out = core.push(0, 2, 0, 0, 1, new[1], 0.0, 1, 2)  # push 2 is still whole
    assert out is not None and not out.applied and core.rounds_voided == 1
    counters_reconcile(core)


def test_a_backup_worker_half_way_through_holds_the_round_until_it_is_done():
    core = make_core(3, backups=1)
    first, second = split(gradient(2, 0), [2, 3])
    core.push(2, 1, 0, 0, 1, first, 0.0, 0, 2)
    push_parts(core, 0, 1, split(gradient(0, 0), [5]))
    push_parts(core, 1, 1, split(gradient(1, 0), [5]))
    assert core.version == 0  # two of three would do, but worker 2's parts are in the buffer
    out = core.push(2, 1, 0, 0, 1, second, 0.0, 1, 2)
    assert out is not None and out.applied and core.version == 1
    reference = make_core(3)  # the same round with no backup: all three gradients
    for w in range(3):
        reference.push(w, 1, 0, 0, 1, gradient(w, 0), 0.0)
    for key in core.params:  # (summed in another order)
        assert torch.allclose(core.params[key], reference.params[key], rtol=0, atol=1e-12)


def test_a_checkpoint_taken_half_way_restores_a_void_round():
    core = make_core(2)
    push_parts(core, 0, 1, split(gradient(0, 0), [5]))
    core.push(1, 1, 0, 0, 1, split(gradient(1, 0), [2, 3])[0], 0.0, 0, 2)
    tensors, meta = core.state_dict()
    assert meta["round_void"]
    restored = make_core(2)
    restored.load_state_dict(tensors, meta, now=0.0)
    # worker 1 sends its whole push again (the shard lost the first part): no step
    out = push_parts(restored, 1, 1, split(gradient(1, 0), [2, 3]))
    assert out is not None and not out.applied and restored.version == 0
    assert restored.rounds_voided == 1


@pytest.mark.parametrize(("sample_elements", "momentum"), [(None, 0.0), (7, 0.9)])
def test_observed_statistics_are_the_same_in_parts(monkeypatch, sample_elements, momentum):
    if sample_elements is not None:  # measure every k-th element (k = 5 here)
        monkeypatch.setattr(probe_module, "_SAMPLE_ELEMENTS", sample_elements)
    seen = {}
    for name, sizes in (("whole", [5]), ("parts", [1, 2, 2])):
        core = make_core(1, momentum=momentum)
        assert core.probe.stride == (1 if sample_elements is None else 5)
        stats = seen[name] = []
        core.observe(stats.append, cosine_decay=0.5)
        for step in range(4):
            push_parts(core, 0, step + 1, split(gradient(0, step), sizes), clock=step)
    assert len(seen["whole"]) == len(seen["parts"]) == 8  # a GradStats and a StepStats each
    for a, b in zip(seen["whole"], seen["parts"], strict=True):
        assert type(a) is type(b)
        for x, y in zip(vars(a).values(), vars(b).values(), strict=True):
            assert (x is None and y is None) or x == pytest.approx(y, rel=1e-12, abs=1e-12)
    assert any(getattr(s, "cosine", None) is not None for s in seen["parts"])


def fresh_core(workers=2):
    cfg = CoreConfig(mode=ModeSpec("sync", 0, 0), optimizer="sgd", optimizer_args={"lr": 0.1},
                     expected_workers=workers, heartbeat_timeout=10.0)
    core = ShardCore(SLICES, cfg)
    for w in range(workers):
        core.register(w, f"inc{w}", now=0.0)
    return core


def weights(seed):
    gen = torch.Generator().manual_seed(seed)
    return {s.key: torch.randn(s.numel, generator=gen, dtype=torch.float64) for s in SLICES}


def test_init_in_parts_seeds_from_one_worker_and_pulls_wait_for_it():
    core = fresh_core()
    mine, theirs = split(weights(1), [2, 3]), split(weights(2), [2, 3])
    assert core.initialize_part(0, mine[0], 0, 2) is None
    assert core.initialize_part(1, theirs[0], 0, 2) is False  # worker 0 is seeding
    core.request_pull(1, 0, "pull-1", 0.0)  # waits instead of failing
    assert core.ready_pulls(0.0) == []
    assert core.initialize_part(0, mine[0], 0, 2) is None  # sent again
    assert core.initialize_part(0, mine[1], 1, 2) is True
    assert core.initialize_part(1, theirs[1], 1, 2) is False
    assert [r.token for r in core.ready_pulls(0.0)] == ["pull-1"]
    for key, value in weights(1).items():
        assert torch.equal(core.params[key], value)


def test_init_in_parts_starts_over_when_its_worker_dies():
    core = fresh_core()
    assert core.initialize_part(0, split(weights(1), [2, 3])[0], 0, 2) is None
    assert core.declare_dead(0)
    with pytest.raises(ProtocolError) as err:  # nobody is seeding now: pulls fail again
        core.request_pull(1, 0, "pull-1", 0.0)
    assert err.value.code == ErrorCode.NOT_INITIALIZED
    theirs = split(weights(2), [1, 4])
    assert core.initialize_part(1, theirs[0], 0, 2) is None
    assert core.initialize_part(1, theirs[1], 1, 2) is True
    for key, value in weights(2).items():
        assert torch.equal(core.params[key], value)


def test_init_in_parts_must_cover_the_shard():
    core = fresh_core()
    first, second = split(weights(1), [2, 3])
    core.initialize_part(0, first, 0, 2)
    with pytest.raises(ProtocolError) as err:
        core.initialize_part(0, dict(list(second.items())[1:]), 1, 2)
    assert err.value.code == ErrorCode.BAD_TENSOR and not core.initialized
    # a whole INIT from anyone still seeds it
    assert core.initialize(weights(3)) is True and core.initialized


# --------------------------------------------------------------- a lone contributor's round


def test_a_lone_contributor_is_stepped_ahead_part_by_part():
    """One worker, plain SGD: each part's next weights are computed as it arrives,
    out of place (the weights served do not change before the round closes), and
    the round's step makes them the weights: torch's SGD step, bit for bit."""
    core = make_core(1, momentum=0.0)
    before = {k: p.clone() for k, p in core.params.items()}
    g = gradient(0, 0)
    parts = split(g, [2, 3])
    assert core.push(0, 1, 0, 0, 4, parts[0], 0.0, 0, 2) is None
    assert core.ahead.keys == set(parts[0]) and core.round.held
    assert all(torch.equal(p, before[k]) for k, p in core.params.items())
    out = core.push(0, 1, 0, 0, 4, parts[1], 0.0, 1, 2)
    assert out is not None and out.applied and core.version == 1
    assert core.ahead.committed == 1 and core.round.in_place == 1 and core.round.held == {}
    for k, p in core.params.items():
        assert torch.equal(p, before[k].add(g[k], alpha=-0.1)), k
    flat = core.flats[torch.float64]
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in core.params.values())  # the views follow their flat buffer
    # the next round writes into the buffer the weights left: the same result again
    g2 = gradient(0, 1)
    expected = {k: p.clone().add(g2[k], alpha=-0.1) for k, p in core.params.items()}
    push_parts(core, 0, 2, split(g2, [4, 1]), clock=1)
    assert core.ahead.committed == 2
    assert all(torch.equal(p, expected[k]) for k, p in core.params.items())


def test_ready_gives_a_parts_next_weights_the_round_then_makes():
    """What StepAhead.ready hands out early (the next weights of a part's keys) is
    what the round makes when it commits: lent as views, or copied."""
    core = make_core(1, momentum=0.0)
    g = gradient(0, 0)
    parts = split(g, [2, 3])
    assert core.ahead.ready(parts[0]) is None  # nothing stepped ahead yet
    assert core.push(0, 1, 0, 0, 4, parts[0], 0.0, 0, 2) is None
    assert core.ahead.ready(parts[1]) is None  # not computed: they have not come
    copied = core.ahead.ready(parts[0])
    lent = core.ahead.ready(parts[0], lend=True)
    assert copied is not None and lent is not None and list(copied) == list(parts[0])
    for k in parts[0]:
        assert torch.equal(copied[k], lent[k])
        assert copied[k].data_ptr() != lent[k].data_ptr() == core.ahead.next[k].data_ptr()
    core.push(0, 1, 0, 0, 4, parts[1], 0.0, 1, 2)
    assert core.ahead.last_commit == core.version == 1
    for k in parts[0]:
        assert torch.equal(core.params[k], copied[k])
        assert core.params[k].data_ptr() == lent[k].data_ptr()  # they became the weights
    assert core.ahead.ready(parts[0]) is None  # the round is over
    # a round begun ahead and then dropped vouches for nothing, even at a version
    # an earlier round committed (one restored from a checkpoint comes again)
    core.version = 0
    assert core.push(0, 2, 1, 0, 4, parts[0], 0.0, 0, 2) is None
    core.ahead.drop()
    core.push(0, 2, 1, 0, 4, parts[1], 0.0, 1, 2)
    assert core.version == 1 and core.ahead.last_commit is None


def test_a_rate_changed_half_way_drops_what_was_stepped_ahead():
    core = make_core(1, momentum=0.0)
    before = {k: p.clone() for k, p in core.params.items()}
    g = gradient(0, 0)
    parts = split(g, [2, 3])
    core.push(0, 1, 0, 0, 1, parts[0], 0.0, 0, 2)
    core.stepper.optimizer.param_groups[0]["lr"] = 0.25
    core.push(0, 1, 0, 0, 1, parts[1], 0.0, 1, 2)
    assert core.version == 1 and core.ahead.committed == 0 and core.round.in_place == 1
    for k, p in core.params.items():
        assert torch.equal(p, before[k].add(g[k], alpha=-0.25)), k


def test_an_optimizer_that_may_write_its_gradients_gets_a_copy():
    """Momentum SGD steps through torch.optim: the round copies the lone push into
    its buffer first, and the pushed tensors are left as they were."""
    core = make_core(1, momentum=0.9)
    g = gradient(0, 0)
    sent = {k: t.clone() for k, t in g.items()}
    push_parts(core, 0, 1, split(g, [2, 3]), n=2)
    assert core.version == 1 and core.round.agg
    assert all(torch.equal(g[k], sent[k]) for k in g)


def test_a_lone_push_whose_round_stays_open_is_copied_before_it_is_answered():
    """A worker joins while the first one's push is half-way: that push is no longer
    the round's only one, so its tensors are copied when it completes; what its
    worker does to them afterwards (a next gradient written into the same memory)
    does not reach the round."""
    core = make_core(1, momentum=0.0)
    g0, g1 = gradient(0, 0), gradient(1, 0)
    parts = split(g0, [2, 3])
    assert core.push(0, 1, 0, 0, 1, parts[0], 0.0, 0, 2) is None
    assert core.round.held  # alone so far: borrowed
    core.register(1, "inc1", now=0.0)
    out = core.push(0, 1, 0, 0, 1, parts[1], 0.0, 1, 2)
    assert out is not None and not out.applied and core.version == 0
    assert core.round.held == {}
    for t in g0.values():
        t.fill_(float("nan"))  # the worker's memory, reused
    expected = make_core(2, momentum=0.0)
    g0 = gradient(0, 0)
    expected.push(0, 1, 0, 0, 1, g0, 0.0)
    expected.push(1, 1, 0, 0, 1, g1, 0.0)
    core.push(1, 1, 0, 0, 1, g1, 0.0)
    assert core.version == expected.version == 1 and core.ahead.committed == 0
    for k, p in core.params.items():
        assert torch.equal(p, expected.params[k]), k


def test_a_lone_push_given_up_half_way_lets_its_tensors_go():
    core = make_core(1, momentum=0.0)
    before = {k: p.clone() for k, p in core.params.items()}
    parts = split(gradient(0, 0), [2, 3])
    core.push(0, 1, 0, 0, 1, parts[0], 0.0, 0, 2)
    assert core.ahead.active
    with pytest.raises(ProtocolError):
        core.push(0, 1, 0, 0, 1, {"k4": torch.full((7,), float("nan"), dtype=torch.float64)},
                  0.0, 1, 2)
    assert core.round.void and core.round.held == {} and not core.ahead.active
    assert core.version == 0
    assert all(torch.equal(p, before[k]) for k, p in core.params.items())


def test_a_busy_shard_does_not_step_ahead_and_rests_a_while():
    """A part that finds more work waiting drops the try (stepping ahead costs more
    than the step at the close); the next tries back off (1, 2, 4, ... rounds) and
    a round stepped ahead again resets that. The results are the same either way."""
    from paramserver.core.ahead import REST_ROUNDS
    core = make_core(1, momentum=0.0)
    busy = [True]
    core.ahead.busy = lambda: busy[0]
    rested = []
    for step in range(6):
        before = {k: p.clone() for k, p in core.params.items()}
        g = gradient(0, step)
        push_parts(core, 0, step + 1, split(g, [2, 3]), clock=step)
        assert all(torch.equal(p, before[k].add(g[k], alpha=-0.1))
                   for k, p in core.params.items())
        rested.append(core.ahead.rest)
    assert core.ahead.committed == 0 and core.version == 6
    assert rested == [0, 1, 0, 3, 2, 1] and REST_ROUNDS >= 4  # tried at rounds 0, 1, 3
    busy[0] = False
    for step in range(6, 6 + 4):
        push_parts(core, 0, step + 1, split(gradient(0, step), [2, 3]), clock=step)
    assert core.ahead.committed >= 1 and core.ahead.misses == 0


def test_a_part_asking_for_early_weights_is_stepped_ahead_even_when_busy():
    """``eager`` (the server sets it for a part that asks for its next weights early):
    neither more work waiting nor a rest after busy tries keeps it from stepping
    ahead, since its weights' transfer is what it saves."""
    core = make_core(1, momentum=0.0)
    core.ahead.busy = lambda: True
    for step in range(2):
        push_parts(core, 0, step + 1, split(gradient(0, step), [2, 3]), clock=step)
    assert core.ahead.committed == 0 and core.ahead.rest > 0  # busy: dropped, resting
    core.ahead.eager = True
    before = {k: p.clone() for k, p in core.params.items()}
    g = gradient(0, 2)
    push_parts(core, 0, 3, split(g, [2, 3]), clock=2)
    assert core.ahead.committed == 1 and core.ahead.last_commit == core.version == 3
    assert all(torch.equal(p, before[k].add(g[k], alpha=-0.1)) for k, p in core.params.items())
