"""fsync.ft on torchft: each step a transaction; replicas die, restart and heal.

The process tests start real replica processes (``tests/_replicas.py``) with a
lighthouse in this process and short torchft timeouts, kill one with SIGKILL at
a step drawn at random (printed, so a failure can be replayed with ``FT_SEED``),
and check what the replicas left: their final states and a log of every step.
The unit tests drive the transaction with a stand-in Manager.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import re
import signal
import time
import types
from unittest import mock

import pytest
import torch

pytest.importorskip(
    "torchft", reason="fsync.ft needs torchft: pip install -e '.[test]' (or '.[ft]')"
)

import fsync
import fsync.ft
from fsync import _comm
from fsync._comm import _failures, _groups
from fsync.ft import _heal, _quorum, _transaction
from tests import _replicas
from tests.conftest import get_world

TIMEOUT_S = 5  # torchft's timeout in the replicas: a hung peer costs the survivors this
STEPS = 8
CLOSE_AFTER_S = 1.5  # how long rank 1 of a two-rank replica group waits before it closes
SEED = int(os.environ.get("FT_SEED", random.randrange(1 << 16)))


def _config():
    return {"replicas": 2, "steps": STEPS, "hook": "mean", "mode": "grad", "timeout_s": TIMEOUT_S}


def _leaves(state):
    return [x for x in fsync._tree.flatten(state)[0] if isinstance(x, torch.Tensor)]


def _identical(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    return all(x.is_meta or torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _without_error(state):
    hook = state.sync.hook
    return state._replace(sync=state.sync._replace(hook=hook._replace(error=())))


def _commits(log):
    """The committed steps of one replica's log (over its restarts), checked for order."""
    steps = [e for e in log if e["event"] == "step"]
    committed = [e for e in steps if e["committed"]]
    for e in committed:
        # The update count in the state is the job's committed count: no step applied
        # twice (count would run ahead) or lost (behind), across discards and heals.
        assert e["count"] == e["step"], e
    numbers = [e["step"] for e in committed]
    assert numbers == sorted(set(numbers)), f"a step committed twice: {numbers}"
    return committed


def _run(tmp_path, config, *, victim=None, when="backward", rank=0, restart=True, **restart_with):
    job = _replicas.Job(tmp_path, config)
    step = random.Random(SEED).randrange(2, config["steps"] - 2)
    print(f"FT_SEED={SEED}: replica {victim} (its rank {rank}) killed ({when}) at step {step}")
    try:
        for k in range(config["replicas"]):
            kill = {"step": step, "when": when, "rank": rank} if k == victim else None
            job.start(k, kill=kill)
        codes = {}
        if victim is not None:
            codes[victim] = job.wait(victim, 120)
            assert codes[victim] == -signal.SIGKILL, job.stderr(victim)
            if restart:
                job.start(victim, restarted=True, **restart_with)
                codes[victim] = job.wait(victim, 120)
        for k in range(config["replicas"]):
            if k != victim:
                codes[k] = job.wait(k, 120)
        return job, codes, step
    finally:
        job.close()


@pytest.mark.timeout(200)
def test_without_failures_the_replicas_compute_what_plain_fsync_does(tmp_path):
    config = {**_config(), "min_replicas": 2}  # both in every quorum, from the first
    job, codes, _ = _run(tmp_path, config)
    assert codes == {0: 0, 1: 0}, job.stderr(0) + job.stderr(1)
    states = [job.final(k) for k in range(2)]
    assert _identical(states[0], states[1])
    for k in range(2):
        assert len(_commits(job.log(k))) == STEPS
    plain = get_world(2).run(_replicas.plain, config)
    # Bit for bit: both reduce the same buffers with gloo's sum over 2 ranks, each
    # gradient multiplied by 1/2 (exact) while packed; only the transport differs.
    assert _identical(states[0], plain[0])


@pytest.mark.timeout(200)
def test_a_replica_killed_in_backward_heals_the_replicated_steps_state(tmp_path):
    # fsync.ops.replicated over the replicas: each bucket updated as its sum across replicas
    # arrives. A replica dies in backward with buckets in flight; the survivor waits for it
    # (min_replicas=2), discards the step, and the restarted one heals the ZeroState whole.
    config = {**_config(), "min_replicas": 2, "mode": "replicated"}
    job, codes, step = _run(tmp_path, config, victim=1, when="backward")
    assert codes == {0: 0, 1: 0}, job.stderr(0) + job.stderr(1)
    failed = [e for e in job.log(0) if e["event"] == "step" and not e["committed"]]
    assert failed and failed[0]["step"] == step and failed[0]["error"], failed
    restarted = job.log(1)
    second = [i for i, e in enumerate(restarted) if e["event"] == "start"][1]
    assert restarted[second + 1]["healed"], restarted
    for k in range(2):
        assert len(_commits(job.log(k))) == STEPS
    assert _identical(job.final(0), job.final(1))
    # Every committed step had both replicas with the same batches: plain fsync over two
    # ranks then the optimizer, bit for bit (the same sums; SGD's operations elementwise,
    # on a flat bucket or on the parameter alike in float32), the momentum whole included.
    plain = get_world(2).run(_replicas.plain, {**config, "mode": "grad"})
    final = job.final(0)
    assert _identical((final.params, final.count), (plain[0].params, plain[0].count))
    for k in range(2):
        assert _identical(job.full_optimizer_state(k), plain[0].opt), k


@pytest.mark.timeout(240)
def test_a_replica_killed_in_backward_restarts_and_heals_powersgd_state(tmp_path):
    # The lighthouse waits for all 3 (the survivors wait for the restart, at the quorum):
    # with fewer, they could finish before the restarted replica is back to heal from them.
    config = {**_config(), "replicas": 3, "hook": "powersgd", "min_replicas": 3}
    job, codes, step = _run(tmp_path, config, victim=1, when="backward")
    assert codes == {0: 0, 1: 0, 2: 0}, [job.stderr(k) for k in range(3)]
    states = [job.final(k) for k in range(3)]
    # PowerSGD's error feedback is each replica's own residual (what compression has not
    # yet delivered of its gradients), so it differs by design; the restarted replica took
    # its source peer's. Everything else is the same everywhere: params, momentum, Q, counts.
    own = [s.sync.hook.error for s in states]
    for other in states[1:]:
        assert _identical(_without_error(states[0]), _without_error(other))
    assert all(e.isfinite().all() for errors in own for e in errors)
    assert all(a.shape == b.shape for a, b in zip(own[0], own[1], strict=True))
    assert int(states[0].count) == STEPS
    for k in (0, 2):  # the survivors discarded the step the victim died in, and went on
        log = job.log(k)
        _commits(log)
        failed = [e for e in log if e["event"] == "step" and not e["committed"]]
        assert failed and all(e["error"] for e in failed), log
        assert failed[0]["step"] == step, (failed, step)
    restarted = job.log(1)
    second = [i for i, e in enumerate(restarted) if e["event"] == "start"][1]
    assert restarted[second + 1]["healed"], restarted
    _commits(restarted)


@pytest.mark.timeout(240)
def test_a_replica_killed_between_steps_restarts_and_heals_diloco_state(tmp_path):
    # One sync, at the last step: the restarted replica heals in an inner step, which
    # issues no collective across replicas. Before the transaction met its peers in such a
    # step, the source committed (withdrawing its state) while the other was fetching it,
    # and the heal timed out step after step.
    config = {**_config(), "mode": "diloco", "min_replicas": 2, "inner_steps": STEPS}
    job, codes, _ = _run(tmp_path, config, victim=1, when="between")
    assert codes == {0: 0, 1: 0}, job.stderr(0) + job.stderr(1)
    states = [job.final(k) for k in range(2)]
    # DiLoCo's inner optimizer is each replica's own (its momentum follows its own batches);
    # the rest is the same: the parameters (step 8 is the sync), the anchor, the outer
    # momentum, the counts.
    assert _identical(states[0]._replace(opt=None), states[1]._replace(opt=None))
    assert not _identical(states[0].opt, states[1].opt)  # so the comparison above is needed
    assert int(states[0].count) == STEPS
    for k in range(2):
        _commits(job.log(k))
    restarted = job.log(1)
    second = [i for i, e in enumerate(restarted) if e["event"] == "start"][1]
    assert restarted[second + 1]["healed"] and restarted[second + 1]["committed"], restarted


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["grad", "zero"])
def test_replica_groups_of_two_ranks_survive_a_rank_killed_in_backward(tmp_path, mode):
    # Two replica groups of two ranks (a node each, say), each with a gloo group of its own:
    # the sync is hierarchical (fsync.ft.ReplicaMesh), each bucket reduce-scattered within
    # the group during backward, each rank's shard across replicas with rank r of the
    # other, gathered within; with the ZeRO step ("zero"), the update split over the group's
    # two ranks, each half of the momentum replicated across replicas. Rank 1 of replica 1
    # dies in backward; as under torchrun, its whole group stops and starts again, and each
    # of its ranks heals from the same rank of replica 0 (for ZeRO: its own half).
    # Rank 1 of each group is slow to close: rank 0, whose process serves the group's
    # torchft ManagerServer, must wait for it (Replica.close meets the group's ranks).
    slow = {"close_after_s": {"1": CLOSE_AFTER_S}}
    config = {**_config(), "ranks": 2, "min_replicas": 2, "mode": mode, **slow}
    job, codes, step = _run(tmp_path, config, victim=1, when="backward", rank=1)
    assert codes == {0: 0, 1: 0}, job.stderr(0) + job.stderr(1)
    ranks = [(k, r) for k in range(2) for r in range(2)]
    for k in range(2):
        # Both ranks leave the last should_commit together (the server answers all ranks
        # of a group at once) and save their state before closing: rank 0's close lasts
        # rank 1's wait less the difference of two saves of a small model (milliseconds).
        closed = [e for e in job.log(k, 0) if e["event"] == "closed"]
        assert closed and closed[0]["s"] >= CLOSE_AFTER_S / 2, (k, closed)
    for k, r in ranks:
        assert len(_commits(job.log(k, r))) == STEPS
    for r in range(2):  # replica 0 discarded the step its peer died in, on both ranks
        failed = [e for e in job.log(0, r) if e["event"] == "step" and not e["committed"]]
        assert failed and failed[0]["step"] == step and failed[0]["error"], failed
        restarted = job.log(1, r)
        second = [i for i, e in enumerate(restarted) if e["event"] == "start"][1]
        assert restarted[second + 1]["healed"], restarted
    # Every committed step had both replicas (min_replicas=2) with the same batches, so the
    # job computed what plain fsync does over a 2 x 2 DeviceMesh, bit for bit (the same
    # reduce-scatter within, a sum of two shards across: gloo's through torchft, exact in
    # either order): the discarded step left no trace, and none was applied twice.
    plain = get_world(4).run(_replicas.plain, {**config, "mode": "grad"})
    if mode == "grad":
        for k, r in ranks:
            assert _identical(job.final(k, r), plain[2 * k + r]), (k, r)
        return
    # ZeRO: rank r of each replica holds the same part (a heal brought rank r its own);
    # the parameters and the momentum whole are plain fsync's with torch.optim's SGD
    # operations on the same synced gradients (elementwise: split or not, the same bits).
    for r in range(2):
        assert _identical(job.final(0, r).sync, job.final(1, r).sync), r
    for k, r in ranks:
        final = job.final(k, r)
        assert _identical((final.params, final.count), (plain[0].params, plain[0].count))
    for k in range(2):
        assert _identical(job.full_optimizer_state(k), plain[0].opt), k


@pytest.mark.timeout(200)
def test_the_others_go_on_without_a_replica_that_stays_dead(tmp_path):
    job, codes, step = _run(tmp_path, _config(), victim=1, when="backward", restart=False)
    assert codes == {0: 0, 1: -signal.SIGKILL}, job.stderr(0)
    log = _commits(job.log(0))
    assert len(log) == STEPS
    assert {e["participants"] for e in log if e["step"] > step} == {1}  # the mean of one
    assert int(job.final(0).count) == STEPS


# --- the lighthouse away -------------------------------------------------------------------------

OUTAGE_S = 6.0  # the lighthouse down this long
# A replica finds a lighthouse back within about a second (fsync.ft's retries) and the quorum
# then forms in its join timeout (1 s here); the target: no step longer than the outage + 5 s.
SLACK_S = 5.0


def _progress(job, index, at_least, timeout=60.0):
    """Waits until replica ``index`` has committed ``at_least`` steps."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = job.dir / f"log-{_replicas.name(index, 0, 1)}.jsonl"
        if path.exists() and len(_commits(job.log(index))) >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"replica {index} did not commit {at_least} steps:\n{job.stderr(index)}")


@pytest.mark.timeout(200)
def test_a_lighthouse_restarted_at_its_address_costs_the_outage_and_no_replica(tmp_path):
    # The lighthouse stops while the replicas train, replica 1 is killed and restarted
    # meanwhile (a membership change only a lighthouse can settle), and a new lighthouse starts
    # at the same address OUTAGE_S later: both replicas go on and end identical, and the
    # survivor's longest step is the outage and a few seconds, not torchft's quorum timeout.
    # A step needs both (min_replicas=2), so that the restarted one heals from the survivor;
    # with one, whichever reaches the new lighthouse first may step alone for a while, and the
    # other heals from it when they meet (torchft's rule: the most steps wins).
    until = tmp_path / "stop"
    config = {**_config(), "steps": 6, "until": str(until), "outage_s": 30, "min_replicas": 2}
    job = _replicas.Job(tmp_path, config)
    try:
        for k in range(2):
            job.start(k)
        _progress(job, 0, 3)
        job.stop_lighthouse()
        job.kill(1)
        job.start(1, restarted=True)  # its Manager finds no lighthouse yet
        time.sleep(OUTAGE_S)
        job.start_lighthouse()
        _progress(job, 1, 1)  # the restarted one healed and committed again
        committed = _commits(job.log(0))[-1]["step"]
        _progress(job, 0, committed + 3)  # both train on together
        until.touch()
        codes = {k: job.wait(k, 60) for k in range(2)}
    finally:
        job.close()
    assert codes == {0: 0, 1: 0}, job.stderr(0) + job.stderr(1)
    survivor = [e for e in job.log(0) if e["event"] == "step"]
    longest = max(b["t"] - a["t"] for a, b in itertools.pairwise(survivor))
    assert OUTAGE_S <= longest <= OUTAGE_S + SLACK_S, longest
    assert not [e for e in job.log(0) + job.log(1) if e["event"] == "no quorum"]
    restarted = job.log(1)
    second = [i for i, e in enumerate(restarted) if e["event"] == "start"][1]
    # It heals from the survivor at its first quorum (a heal whose fetch fails discards that
    # step on both, and the next heals), and commits nothing before.
    healed = next(e for e in restarted[second + 1 :] if e.get("healed"))
    assert not [e for e in restarted[second + 1 :] if e.get("committed") and e["t"] < healed["t"]]
    assert _identical(job.final(0), job.final(1))
    assert int(job.final(0).count) == _commits(job.log(0))[-1]["step"]
    _commits(job.log(1))  # no step applied twice or lost, across the restart


@pytest.mark.timeout(120)
def test_a_lighthouse_that_never_returns_is_fsyncs_error_on_every_replica(tmp_path):
    # Away for good: each replica's step gives up after quorum_timeout plus lighthouse_outage
    # and raises fsync's QuorumError, naming the lighthouse and the last quorum (the replica
    # catches it: exit 4), never torchft's own timeout.
    quorum_s, outage_s = 3, 4
    config = {**_config(), "steps": 1000, "quorum_timeout_s": quorum_s, "outage_s": outage_s}
    job = _replicas.Job(tmp_path, config)
    try:
        for k in range(2):
            job.start(k)
        _progress(job, 0, 3)
        _progress(job, 1, 3)
        job.stop_lighthouse()
        stopped = time.time()
        codes = {k: job.wait(k, 90) for k in range(2)}
    finally:
        job.close()
    assert codes == {0: 4, 1: 4}, job.stderr(0) + job.stderr(1)
    for k in range(2):
        (lost,) = [e for e in job.log(k) if e["event"] == "no quorum"]
        assert job.config["lighthouse"] in lost["error"], lost
        assert "the last quorum" in lost["error"] and "lighthouse_outage" in lost["error"], lost
        # It waited the budget out, and not much longer.
        assert outage_s <= lost["t"] - stopped <= quorum_s + outage_s + SLACK_S, lost


@pytest.mark.timeout(200)
def test_a_replica_rejoining_with_another_tree_is_refused_alone(tmp_path):
    until = tmp_path / "refused"  # replica 0 steps on until replica 1 has been refused
    job = _replicas.Job(tmp_path, {**_config(), "until": str(until)})
    try:
        job.start(0)
        job.start(1, kill={"step": 2, "when": "between"})
        assert job.wait(1, 120) == -signal.SIGKILL, job.stderr(1)
        job.start(1, restarted=True, width=8)
        assert job.wait(1, 120) == 3, job.stderr(1)
        until.touch()
        assert job.wait(0, 120) == 0, job.stderr(0)
    finally:
        job.close()
    refused = [e for e in job.log(1) if e["event"] == "refused"]
    assert len(refused) == 1, refused
    error = refused[0]["error"]
    assert "the state received from a peer replica differs at leaf" in error, error
    assert "this replica has a torch.float32 tensor of shape (8, 8) but the job has" in error
    commits = _commits(job.log(0))  # the other replica, unharmed: it went on alone
    assert len(commits) >= STEPS and commits[-1]["participants"] == 1
    assert int(job.final(0).count) == commits[-1]["step"]


# --- the transaction with a stand-in Manager ------------------------------------------------------


class _Manager:
    """The parts of torchft's Manager the transaction uses, for one replica alone."""

    _use_async_quorum = False

    def __init__(self, *, fail_commit=False):
        self.errors, self.step, self.fail_commit, self.fns = [], 0, fail_commit, {}
        self._quorum_id, self.reduced = 1, []  # torchft's quorum id; what was all-reduced
        self._pg = self  # the Manager's process group: fsync issues its collectives there

    def allreduce(self, tensors, options):
        self.reduced.extend(x.clone() for x in tensors)
        return _Done()

    def wait_quorum(self):
        pass

    def is_participating(self):
        return True

    def register_state_dict_fn(self, key, load, save):
        self.fns[key] = (load, save)

    def start_quorum(self):
        self.errors.clear()

    def report_error(self, error):
        self.errors.append(error)

    def errored(self):
        return self.errors[0] if self.errors else None

    def should_commit(self):
        ok = not self.errors and not self.fail_commit
        self.step += ok
        return ok

    def current_step(self):
        return self.step

    def num_participants(self):
        return 1

    def participating_rank(self):
        return 0


class _Done:
    """A collective of one replica: done at once."""

    def wait(self):
        return True


def _step(state, fail):
    new = {"w": state["w"] + 1}
    if fail:
        raise _failures.CollectiveError("a peer died", stage="bucket 1 of 2")
    return new, "loss"


def test_a_failed_collective_discards_the_step_and_is_reported():
    manager = _Manager()
    replica = fsync.ft.Replica(manager)
    state = {"w": torch.zeros(2)}
    step = replica.step(_step)
    new, outcome = step(state, False)
    assert outcome.committed and outcome.step == 1 and outcome.value == "loss"
    kept, outcome = step(new, True)
    assert kept is new and not outcome.committed and outcome.value is None
    assert outcome.error == "a peer died" and isinstance(
        manager.errors[0], _failures.CollectiveError
    )
    assert torch.equal(new["w"], torch.ones(2)) and torch.equal(state["w"], torch.zeros(2))


def test_a_step_the_replica_group_does_not_commit_keeps_the_old_state():
    replica = fsync.ft.Replica(_Manager(fail_commit=True))
    state = {"w": torch.zeros(2)}
    kept, outcome = replica.step(_step)(state, False)
    assert kept is state and not outcome.committed and outcome.error is None


def test_the_step_must_return_a_pair():
    replica = fsync.ft.Replica(_Manager())
    with pytest.raises(TypeError, match=r"expected a pair \(new_state, value\)"):
        replica.step(lambda state: state)({"w": torch.zeros(1)})


def test_an_async_quorum_manager_is_refused():
    manager = _Manager()
    manager._use_async_quorum = True
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        fsync.ft.Replica(manager)


def test_the_state_served_is_the_last_committed_and_a_heal_replaces_the_next_one():
    manager = _Manager()
    replica = fsync.ft.Replica(manager)
    load, save = manager.fns["fsync"]
    state = {"w": torch.zeros(2)}
    step = replica.step(_step)
    new, _ = step(state, False)
    assert save()["state"] is new
    step(new, True)  # discarded: still the committed one
    assert save()["state"] is new
    load(_heal.payload({"w": torch.full((2,), 7.0)}))
    healed, outcome = step(new, False)
    assert outcome.healed and torch.equal(healed["w"], torch.full((2,), 8.0))


# --- the heal's check -----------------------------------------------------------------------------


def test_a_healed_state_must_fit_this_replicas_tree():
    mine = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match="has another structure"):
        _heal.received(mine, _heal.payload({"w": torch.zeros(2, 3)}))
    with pytest.raises(ValueError, match=r"differs at leaf \('w',\): this replica has a torch"):
        _heal.received(mine, _heal.payload({"w": torch.zeros(3, 3), "b": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"not an fsync\.ft state"):
        _heal.received(mine, {"w": 1})
    sent = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    got = _heal.received(mine, _heal.payload(sent))
    assert torch.equal(got["w"], sent["w"]) and torch.equal(mine["w"], torch.zeros(2, 3))


def test_a_healed_sync_state_must_be_made_for_the_same_plan():
    group = fsync.ft.ManagerGroup(_Manager())  # between steps: this replica alone
    params = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
    mine = fsync.GradSync(group=group).init(params)
    theirs = fsync.GradSync(group=group, reduce_dtype=torch.bfloat16).init(params)
    assert not torch.equal(mine.fingerprint, theirs.fingerprint)  # ...which the heal reads
    with pytest.raises(ValueError, match="made for another bucket plan"):
        _heal.received(mine, _heal.payload(theirs))


# --- the group ------------------------------------------------------------------------------------


class _TwoReplicas(_Manager):
    def num_participants(self):
        return 2


def test_the_replica_group_refuses_torch_compile():
    group = fsync.ft.ManagerGroup(_TwoReplicas())
    group.live = True  # inside a step, with a peer: collectives to issue

    @torch.compile(fullgraph=True, backend="eager")
    def step(g):
        return fsync.sync_grads(g, group=group)

    with pytest.raises(Exception, match="runs eagerly only"):
        step({"w": torch.ones(2)})


class _Arriving:
    """An all-reduce of two replicas that hold the same: it arrives (doubles) when waited
    for, and fails then if told to."""

    def __init__(self, x, log, k, fail):
        self.x, self.log, self.k, self.fail = x, log, k, fail

    def wait(self):
        self.log.append(("wait", self.k))
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        self.x.mul_(2)
        return True


class _InFlight(_TwoReplicas):
    def __init__(self, fail_at=None):
        super().__init__()
        self.log, self.fail_at = [], fail_at

    def allreduce(self, tensors, options):
        (x,) = tensors
        k = sum(event == "issue" for event, _ in self.log)
        self.log.append(("issue", k))
        return _Arriving(x, self.log, k, fail=k == self.fail_at)


def test_the_replicas_buckets_are_on_the_wire_together_and_a_failure_names_its_bucket():
    # Over one rank per replica group every bucket's all-reduce is issued before the first
    # is waited for, as over a c10d group (waited at once, the link idled between buckets:
    # fsync.ops.replicated over torchft at 8 Gbit/s took 1.09-1.11x plain fsync's step,
    # 0.98-1.01x in flight); each result waits where it is first needed.
    grads = {"w": torch.arange(300.0), "v": torch.ones(300), "b": torch.full((300,), 3.0)}
    small = {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001}
    manager = _InFlight()
    group = fsync.ft.ManagerGroup(manager)
    group.live = True
    got = fsync.sync_grads(grads, group=group, **small)
    assert all(torch.equal(got[k], grads[k]) for k in grads)  # the mean of two equal replicas
    # The agreement (0), then the buckets: every one issued before the first is waited for.
    buckets = manager.log[2:]
    n = len(buckets) // 2
    assert n >= 3 and manager.log[:2] == [("issue", 0), ("wait", 0)], manager.log
    assert buckets == [("issue", k) for k in range(1, n + 1)] + [
        ("wait", k) for k in range(1, n + 1)
    ]
    failing = _InFlight(fail_at=2)
    group = fsync.ft.ManagerGroup(failing)
    group.live = True
    with pytest.raises(_failures.CollectiveError, match=r"bucket 2 of \d") as failure:
        fsync.sync_grads(grads, group=group, **small)
    assert "Connection closed by peer" in str(failure.value)
    # Bucket 3 was issued behind it and never waited for: c10d holds its work until the
    # step settles (Replica.step does), which does not wait on the wire for a lost step.
    registry = torch._C._distributed_c10d._get_work_registry_size
    assert registry() == 1 and group.unsettled
    _transaction.settle(group)
    assert registry() == 0 and not group.unsettled and ("wait", 3) not in failing.log
    # Over a replica group of several ranks each crossing is waited for at once (and agreed
    # within), whatever the replicas' group does alone: nothing of it is left in flight.
    across = fsync.ft.ManagerGroup(_Manager())
    across.live = True
    crossing, _ = _comm.hierarchy(fsync.ft.ReplicaMesh(_groups.ALONE, across))
    assert crossing.all_reduce(torch.ones(3), "sum").works == ()
    assert torch.equal(_comm.all_reduce(torch.ones(3), "sum", crossing), torch.ones(3))
    assert not across.unsettled


def test_a_spare_replica_adds_zeros_and_a_lost_step_issues_nothing_more():
    manager = _TwoReplicas()
    group = fsync.ft.ManagerGroup(manager)
    group.live = True
    manager.is_participating = lambda: False  # outside the quorum: torchft zeroes its part
    assert group.all_reduce(torch.ones(3), "sum").works[0].wait()
    assert torch.equal(manager.reduced[0], torch.zeros(3))
    manager.is_participating = lambda: True
    manager.report_error(RuntimeError("Connection reset by peer"))
    lost = group.all_reduce(torch.ones(3), "sum")
    assert len(manager.reduced) == 1  # nothing issued: the step is lost already
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        lost.works[0].wait()
    with pytest.raises(ValueError, match="gloo has no average"):
        group.all_reduce(torch.ones(3), "avg")


def test_between_steps_the_replica_group_is_this_replica_alone():
    group = fsync.ft.ManagerGroup(_Manager())
    grads = {"w": torch.ones(2)}
    assert _comm.size(group) == 1 and _comm.rank(group) == 0
    assert fsync.sync_grads(grads, group=group)["w"] is not None


def test_without_torchft_the_error_names_the_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def missing(name, *args):
        if name.startswith("torchft"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ImportError, match=r"pip install 'fsync\[ft\]'"):
        fsync.ft.lighthouse()


def test_a_step_without_collectives_meets_its_peers_where_the_quorum_changed():
    # A peer healing from this replica fetches its state after the quorum; should_commit
    # withdraws it. A step with no collective of its own (DiLoCo's inner steps) meets the
    # others once before committing where the quorum is new, and only there.
    manager = _Manager()
    step = fsync.ft.Replica(manager).step(_step)
    state = {"w": torch.zeros(2)}
    state, outcome = step(state, False)  # the first quorum: new
    assert outcome.committed and len(manager.reduced) == 1
    assert torch.equal(manager.reduced[0], torch.ones(1))
    state, _ = step(state, False)
    assert len(manager.reduced) == 1  # the same quorum: no meeting
    manager._quorum_id = 2  # a replica joined (or left)
    state, outcome = step(state, False)
    assert outcome.committed and len(manager.reduced) == 2
    assert torch.equal(state["w"], torch.full((2,), 3.0))


def test_a_quorum_keeps_its_number_and_a_restarted_lighthouses_quorums_take_new_ones():
    # torchft rendezvous each process group under its quorum's number, and a restarted
    # lighthouse numbers from 1 again: fsync's number changes where the lighthouse's or the
    # replicas do (each id carries a Manager's uuid), the same on every replica of the quorum.
    def quorum(number, replicas, step):
        return types.SimpleNamespace(
            quorum_id=number, replica_ids=replicas, max_step=step, store_address="s:1"
        )

    class Client:
        def __init__(self, quorums):
            self.quorums = iter(quorums)

        def _quorum(self, **options):
            return next(self.quorums)

        def should_commit(self, *args):
            return True

    a, b, b2 = "0:aa", "1:bb", "1:cc"  # replica 1 restarted: a new uuid
    rounds = [
        quorum(1, [a, b], 0),
        quorum(1, [a, b], 1),  # the same quorum, one step on
        quorum(2, [a], 3),  # replica 1 lost
        quorum(1, [b2, a], 5),  # a new lighthouse, replica 1 back (the survivor's old id)
        quorum(2, [a, b2], 6),  # and its next: the survivor's id before
    ]
    survivor = _quorum.Renumbered(Client(rounds))
    given = [survivor._quorum(timeout=None) for _ in rounds]
    numbers = [q.quorum_id for q in given]
    assert numbers[0] == numbers[1] and len(set(numbers[1:])) == 4, numbers
    restarted = _quorum.Renumbered(Client([quorum(1, [a, b2], 5)]))
    assert restarted._quorum().quorum_id == numbers[3]  # the replicas agree on it
    assert survivor.lighthouse_id == 2 and survivor.should_commit() is True
    assert given[4].store_address == "s:1" and given[4].max_step == 6  # the rest as torchft's
    assert [q.quorum_id for q in rounds] == [1, 1, 2, 1, 2]  # torchft's own results untouched


class _Mirror(_groups.ReplicaGroup):
    """A second replica group that holds what this one holds: a sum across doubles, a gather
    repeats. Records the elements each collective sends across."""

    def __init__(self):
        self.sent = []

    def size(self):
        return 2

    def rank(self):
        return 0

    def all_reduce(self, x, op):
        self.sent.append(x.numel())
        return _groups.Pending(x.mul_(2) if op == "sum" else x, ())

    def all_gather(self, x):
        self.sent.append(x.numel())
        return _groups.Pending(torch.cat([x, x]), ())

    def broadcast(self, x, src):
        return _groups.Pending(x, ())


class _Broken:
    """A crossing whose peer died: its wait fails."""

    def wait(self):
        raise RuntimeError("Connection reset by peer")


class _FailsHere(_Mirror):
    """A ``_Mirror`` whose ``fail_at``-th crossing fails on this rank alone: its peer across
    died, while the peers of the other ranks of its replica group had answered theirs."""

    def __init__(self, fail_at):
        super().__init__()
        self.fail_at = fail_at

    def all_reduce(self, x, op):
        done = super().all_reduce(x, op)
        return _groups.Pending(x, (_Broken(),)) if len(self.sent) == self.fail_at else done


def _on_rank_a_crossing_failed_on_one_rank(entry):
    """A sync over a ReplicaMesh whose third crossing (a bucket's, after the agreement's)
    fails on rank 1 alone: every rank leaves the step, and the group is still in step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mesh = fsync.ft.ReplicaMesh(dist.group.WORLD, _FailsHere(3) if rank == 1 else _Mirror())
    params = {k: torch.randn(*s) for k, s in [("w", (33, 7)), ("v", (50,)), ("b", (5,))]}
    small = {"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.0001}

    def loss(p):
        return sum((x * x).sum() for x in p.values())

    if entry == "sync_grads":
        call, args = functools.partial(fsync.sync_grads, group=mesh, **small), (params,)
    elif entry == "grad_and_value":
        sync = fsync.GradSync(group=mesh, **small)
        call, args = sync.grad_and_value(loss), (sync.init(params), params)
    else:
        zero = fsync.ops.zero(fsync.optim.sgd(0.1), group=mesh, **small)
        call, args = zero.value_and_step(loss), (zero.init(params), params)
    with pytest.raises(_failures.CollectiveError) as failure:
        call(*args)
    # Both ranks still meet over their group: neither waits in a collective within that the
    # other left.
    one = torch.ones(1)
    dist.all_reduce(one)
    assert one.item() == 2, rank
    # What the failed crossing left is the replicas' group's to settle, as the step does.
    assert mesh.across.unsettled
    _transaction.settle(mesh.across)
    assert not mesh.across.unsettled
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    said = str(failure.value)
    own, peers = "Connection reset by peer" in said, "1 other rank(s) of this replica group" in said
    return own, peers, failure.value.stage


@pytest.mark.parametrize("entry", ["sync_grads", "grad_and_value", "zero"])
def test_a_crossing_that_fails_on_one_rank_of_a_replica_group_stops_all_of_them(entry):
    # Rank r of a replica group crosses with rank r of the others: where a peer replica dies
    # during a bucket, one rank's crossing can fail while another's went through (its peer had
    # answered before it was stopped). Without the group's ranks agreeing on each crossing,
    # the rank that went through waited within for the one that had left the step (seen once
    # in test_replica_groups_of_two_ranks_survive_a_rank_killed_in_backward: a should_commit
    # timed out, the replica group never finished its step; here each entry point hung).
    said = get_world(2).run(_on_rank_a_crossing_failed_on_one_rank, entry, timeout=60)
    # Rank 1 names its own failure; rank 0, whose crossing went through, learns it from rank 1.
    assert [s[:2] for s in said] == [(False, True), (True, False)], said
    # Both name the bucket whose crossing failed, as a failure in flight does.
    assert said[0][2] == said[1][2] and re.match(r"bucket \d of \d", said[0][2]), said


def _on_rank_replica_mesh():
    import torch.distributed as dist

    rank = dist.get_rank()
    across = _Mirror()
    mesh = fsync.ft.ReplicaMesh(dist.group.WORLD, across)
    assert (mesh.size(), mesh.rank()) == (4, rank)  # replica by replica, as a mesh's ranks
    crossing, within = _comm.hierarchy(mesh)  # across: each crossing agreed within
    assert crossing.across is across and within is dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    grads = {
        k: torch.randn(*s, generator=g) for k, s in [("w", (33, 7)), ("v", (50,)), ("b", (5,))]
    }
    got = fsync.sync_grads(grads, group=mesh, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    # Across, only this rank's shards travel (half of every bucket, padded to 2 shards), and
    # the agreement; nothing else. The mirror doubles the within-group sum, so the mean over
    # the 4 ranks is the mean of the two real ones.
    plan = fsync.plan_buckets(grads, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    shards = [-(-spec.numel // 2) for spec in plan.specs]
    assert len(shards) > 1 and across.sent[1:] == shards, (across.sent, shards)
    expected = fsync.sync_grads(grads, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
    # The same sums of two rank's values (each exact in either order); the mesh divides once
    # by 4 after doubling, the flat sync by 2: both exact scalings.
    assert all(torch.equal(got[k], expected[k]) for k in grads), rank
    return True


def test_a_replica_mesh_sends_a_shard_of_each_bucket_across():
    assert all(get_world(2).run(_on_rank_replica_mesh))


def _on_rank_replica_mesh_as_a_device_mesh():
    """Every entry point over a ReplicaMesh whose other replica group mirrors this one: the
    same as over a 2 x 2 DeviceMesh whose node 1 holds node 0's data, bit for bit (a sum of
    two equal values across is exactly a doubling)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    replicas = fsync.ft.ReplicaMesh(pairs[rank // 2], _Mirror())

    def tree(seed):
        g = torch.Generator().manual_seed(seed)  # node 1 holds node 0's values
        return {k: torch.randn(*s, generator=g) for k, s in [("w", (9, 8)), ("b", (30,))]}

    small = {"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.0001}
    results = []
    for group in (mesh, replicas):
        params = tree(rank % 2)
        compressed = fsync.GradSync(
            group=group, hook=fsync.ops.powersgd(rank=1, start_step=0), **small
        )
        deferred = fsync.DeferredSync(group=group, **small)
        outer = fsync.diloco(2, group=group, **small)
        sync_state = compressed.init(params)
        acc, diloco_state = deferred.init(params), outer.init(params)
        got = []
        for step in range(2):
            grads = tree(10 * step + rank % 2)
            synced, sync_state = compressed(grads, sync_state)
            acc = deferred.add(grads, deferred.add(tree(99), acc))
            summed, acc = deferred.finish(acc)
            params = {k: p - 0.1 * grads[k] for k, p in params.items()}
            params, diloco_state = outer.update(params, diloco_state)
            got.append((synced, summed, params))
        results.append((got, sync_state))
    (expected, expected_state), (got, state) = results
    mine = fsync._tree.flatten((got, state.hook))[0]
    theirs = fsync._tree.flatten((expected, expected_state.hook))[0]
    assert len(mine) == len(theirs) and all(map(torch.equal, mine, theirs)), rank
    return True


def test_every_entry_point_over_a_replica_mesh_takes_the_meshs_path():
    assert all(get_world(4).run(_on_rank_replica_mesh_as_a_device_mesh))


def _on_rank_zero_over_a_replica_mesh(shard_buckets):
    """The ZeRO step over a ReplicaMesh whose other replica group mirrors this one: its update
    split over the group's two ranks, every part replicated across; the same bits as the
    plain optimizer after a sync over a 2 x 2 DeviceMesh whose node 1 holds node 0's data."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    replicas = fsync.ft.ReplicaMesh(pairs[rank // 2], _Mirror())

    def tree(seed):
        g = torch.Generator().manual_seed(seed)
        shapes = [("w", (9, 8)), ("v", (5, 7)), ("b", (31,))]
        return {k: torch.randn(*s, generator=g) for k, s in shapes}

    def linear(params, grads):  # its gradient is `grads`, bit for bit (d(p * g)/dp = 1 * g)
        return sum((params[k] * grads[k]).sum() for k in params)

    small = {"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.0001}
    opt = fsync.optim.adamw(1e-2, weight_decay=0.1)
    zero = fsync.ops.zero(opt, group=replicas, shard_buckets=shard_buckets, **small)
    assert zero.shard_group is pairs[rank // 2]
    plain = fsync.GradSync(group=mesh, **small)
    params = expected = tree(7)  # the same on every rank
    state, plain_state, opt_state = zero.init(params), plain.init(params), opt.init(params)
    assert zero.layout(state).world_size == 2  # split within the replica group alone
    for step in range(3):
        grads = tree(10 * step + rank % 2)  # node 1 holds node 0's gradients
        if step % 2:
            (params, _), state = zero.value_and_step(linear)(state, params, grads)
        else:
            params, state = zero(params, grads, state)
        synced, plain_state = plain(grads, plain_state)
        expected, opt_state = opt.update(expected, synced, opt_state)
        assert all(torch.equal(params[k], expected[k]) for k in params), (rank, step)
    # Within the replica group one all-gather per bucket and step: the parameters' parts with
    # shard_buckets (the shard that crossed is this rank's part, not gathered first), else
    # the reduced gradients, whole for their owners (the parameters then go by broadcast).
    with mock.patch.object(_comm, "all_gather", wraps=_comm.all_gather) as gathers:
        zero(params, grads, state)
    within = [c for c in gathers.call_args_list if c.args[1] is pairs[rank // 2]]
    assert len(within) == len(zero.layout(state).plan.specs) > 1, (rank, len(within))
    full = fsync.ops.zero_state_dict(state, zero)  # gathered within the replica group
    if rank % 2:
        return full is None
    mine, theirs = fsync._tree.flatten(full)[0], fsync._tree.flatten(opt_state)[0]
    return len(mine) == len(theirs) and all(map(torch.equal, mine, theirs))


@pytest.mark.parametrize("shard_buckets", [True, False])
def test_the_zero_step_over_a_replica_mesh_splits_within_and_replicates_across(shard_buckets):
    assert all(get_world(4).run(_on_rank_zero_over_a_replica_mesh, shard_buckets))


def test_the_zero_step_is_refused_over_replicas_of_one_rank():
    # Nothing to split the update over: the optimizer itself, its state healed whole.
    with pytest.raises(ValueError, match="a replica group of one rank has nothing to split"):
        fsync.ops.zero(fsync.optim.adam(1e-3), group=_Mirror())


def test_the_replicated_step_over_replicas_of_one_rank_is_the_optimizer_after_the_sync():
    # What the refusal above points to: the state whole on each replica, each bucket updated
    # as its sum across replicas arrives; the bits of GradSync over the replicas, then the
    # optimizer, with the mean divided by the step's replicas.
    small = {"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.0001}
    opt = fsync.optim.adamw(1e-2, weight_decay=0.1)
    replicas = _Mirror()
    step = fsync.ops.replicated(opt, group=replicas, **small)
    sync = fsync.GradSync(group=_Mirror(), **small)
    g = torch.Generator().manual_seed(0)
    params = expected = {"w": torch.randn(9, 8, generator=g), "b": torch.randn(31, generator=g)}
    state, sync_state, opt_state = step.init(params), sync.init(params), opt.init(params)
    assert step.layout(state).world_size == 1 and len(step.layout(state).plan.buckets) > 1
    call = step.value_and_step(lambda p, c: sum((p[k] * c[k]).sum() for k in p))
    for s in range(3):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        (params, _), state = call(state, params, grads)  # the linear loss's gradient: grads
        synced, sync_state = sync(grads, sync_state)
        expected, opt_state = opt.update(expected, synced, opt_state)
        assert all(torch.equal(params[k], expected[k]) for k in params), s
    # Each bucket crossed once per step, whole, and nothing else did but the agreement.
    buckets = [spec.numel for spec in step.layout(state).plan.specs]
    assert sorted(n for n in replicas.sent if n in buckets) == sorted(buckets * 3)
    full = fsync.ops.zero_state_dict(state, step)
    mine, theirs = fsync._tree.flatten(full)[0], fsync._tree.flatten(opt_state)[0]
    assert len(mine) == len(theirs) and all(map(torch.equal, mine, theirs))


def test_a_replica_group_of_several_ranks_needs_its_store_and_its_ranks_group():
    # Its ranks meet over `within` before their Managers start (a restarted group would read
    # the dead Manager's address from torchrun's store otherwise): refused before any is made.
    for missing in ({"store": ("localhost", 1)}, {"within": object()}):
        with pytest.raises(ValueError, match="needs its TCPStore and its ranks' process group"):
            fsync.ft.Replica.connect("http://localhost:1", "replica_0", world_size=2, **missing)
