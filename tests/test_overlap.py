"""The overlapped mode (train.overlap) without Ray: steps that leave their unfinished groups running on the
engines, weights updated while they generate, and the drained step before a checkpoint."""
import asyncio

import pytest

from april_ray.config import ConfigError, load_config
from april_ray.rollout.local import resolve
from april_ray.types import SampleState
from driver.rollout import asked_ahead, overlaps
from tests.fakes import make_rollout_parts
from tests.test_rollout import cfg


def counting_aborts(pool) -> list:
    """The step tokens of every abort the monitor sends."""
    sent, abort_all = [], pool.abort_all

    async def abort(step, engines):
        sent.append(step)
        await abort_all(step, engines)

    pool.abort_all = abort
    return sent


def accounted(rollout, learner: dict) -> tuple[dict[int, int], dict[int, int]]:
    """Per step, as it returns (before the next one starts): the groups taken from the source but neither
    returned, dropped, stored nor left running (none, when nothing is lost); and as it begins, how many
    versions ahead of the learner's (`learner["version"]`, which the engines hold) its batch is trained."""
    inner, out, began = rollout._step, {}, {}

    async def step(n, version, keep_running):
        began[n] = version - learner["version"]
        result = await inner(n, version, keep_running)
        source, store = rollout.source.obj, rollout.store.obj
        out[n] = source.num_groups_taken - (rollout.num_returned_groups + rollout.num_dropped_groups
                                            + len(store) + len(result.running))
        return result

    rollout._step = step
    return out, began


def overlap_train(num_steps: int, save_every: int = 0, ahead: int = 1):
    """The train section of an overlapped job: `ahead` steps ahead, a checkpoint every `save_every` steps."""
    return load_config(None, ["train.overlap=true", f"train.num_steps={num_steps}", f"train.overlap_ahead={ahead}",
                              f"train.save_every={save_every or num_steps + 1}"]).train


async def overlapped(rollout, engines, train, kill=None, slow_learner: bool = False):
    """The driver's loop in the overlapped mode (`RolloutGroup.batch`: the steps of `asked_ahead` are asked
    for before a step's batch is waited for, each `after` the one before it), with a fake learner: the
    batch `trains` while they run, and the new weights reach the engines while they generate.
    `slow_learner`: the learner trains until the furthest step asked has begun, so the engines get as far
    ahead as they may. Returns each step's result with the groups unaccounted for when it returned, and
    per step how many versions ahead of the learner's it began."""
    learner, asked, results = {"version": 0}, {}, []
    unaccounted, began = accounted(rollout, learner)
    for step in range(train.num_steps):
        version = learner["version"]
        if step not in asked:
            asked[step] = asyncio.ensure_future(rollout.step(step, version, overlaps(train, step)))
        for n in asked_ahead(train, step):
            if n not in asked:
                asked[n] = asyncio.ensure_future(rollout.step(n, version + n - step, overlaps(train, n), after=n - 1))
        results.append(await asked.pop(step))
        if kill is not None and step == kill:
            rollout.pool.kill(0)
        while slow_learner and asked and max(asked) not in began:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the learner trains: the engines keep generating meanwhile
        learner["version"] += 1
        for e in engines:
            e.update_weights(None, learner["version"])  # in flight: running requests go on under the new version
        if kill is not None and step == kill + 1:
            rollout.pool.restart(0)
            rollout.revive([0])
    return [(r, unaccounted[r.step]) for r in results], began


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_overlapped_steps_never_abort_and_lose_nothing(ahead):
    """Kept steps send no abort; every group taken is returned, dropped, stored or running after each step;
    tokens of one sample span the versions it was generated under; a drained step leaves nothing running
    and is the only one a checkpoint may follow; no step begins more than `ahead` versions before its own."""
    c = cfg(max_response_len=120, max_versions=4, policy="mask")
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=3)
    aborts = counting_aborts(pool)
    results, began = asyncio.run(overlapped(rollout, engines, overlap_train(8, save_every=4, ahead=ahead)))

    seen, spanning = set(), 0
    for step, (r, unaccounted) in enumerate(results):
        assert unaccounted == 0 and bool(r.running) == (step not in (3, 7))
        samples = [resolve(h) for g in r.groups for h in g]
        assert len(r.groups) == c.rollout.rollout_batch_size
        for s in samples:
            assert s.sample_id not in seen and s.state == SampleState.FINISHED
            seen.add(s.sample_id)
            assert len(s.versions) == len(s.response_ids) == len(s.logprobs)
            spanning += len(set(s.versions)) > 1
        assert sum(r.staleness.values()) == sum(len(s.response_ids) for s in samples)
        assert min(r.staleness) >= 0  # ages counted against the version the batch trains at
    assert spanning > 0, "no sample's tokens spanned a weight update made while it generated"
    assert all(0 <= ahead_by <= ahead for ahead_by in began.values()), began
    # aborts only at the drained steps (3 and 7), each sent under the token of the run of kept steps it ends
    assert aborts and len(set(aborts)) == 2, aborts
    last = results[-1][0]
    assert last.running == [] and rollout.running is None
    assert source.num_groups_taken == rollout.num_returned_groups + rollout.num_dropped_groups + len(store)
    assert rollout.state_dict()["returned_groups"] == 8 * c.rollout.rollout_batch_size


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_a_slow_learner_lets_the_engines_run_ahead_as_far_as_asked_and_no_further(ahead):
    """With the learner slower than the rollout, the engines run `ahead` batches ahead of it: a step begins
    `ahead` versions before the one it trains at, never more, and only up to the drained step before a
    checkpoint. Every group is still accounted for after each step, none trained twice, and the batch's
    tokens are aged against its own version: those sampled `ahead` versions before it are there, and what
    is older than staleness.max_versions (= `ahead`) is what the learner masks."""
    c = cfg(max_response_len=120, max_versions=ahead, policy="mask")
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=6)
    train = overlap_train(9, save_every=5, ahead=ahead)
    results, began = asyncio.run(overlapped(rollout, engines, train, slow_learner=True))

    assert max(began.values()) == ahead and all(0 <= n <= ahead for n in began.values()), began
    assert all(began[n] <= n - 5 for n in range(5, 9)), began  # nothing asked past the drained step 4
    ids = [s.sample_id for r, _ in results for g in r.groups for s in map(resolve, g)]
    assert len(ids) == len(set(ids)) == 9 * c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt
    assert all(unaccounted == 0 for _, unaccounted in results)
    assert not results[4][0].running and not results[8][0].running and rollout.running is None
    ages = {age for r, _ in results for age in r.staleness}
    assert ahead in ages  # tokens sampled as far ahead as the engines ran
    for r, _ in results:
        masked = sum(n for age, n in r.staleness.items() if not c.staleness.trains(age))
        assert masked == sum(n for age, n in r.staleness.items() if age > ahead)
    assert source.num_groups_taken == rollout.num_returned_groups + rollout.num_dropped_groups + len(store)


def test_a_running_rollout_refuses_a_checkpoint_and_a_kept_step_carries_its_groups():
    c = cfg(max_response_len=200, policy="mask")
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=1)
    aborts = counting_aborts(pool)
    inner, seen = rollout._step, {}

    async def step(n, version, keep_running):  # as each step returns, before the next one starts
        result = await inner(n, version, keep_running)
        try:
            rollout.state_dict()
            seen[n] = "checkpointable"
        except RuntimeError as e:
            seen[n] = str(e)
        seen[n, "stored"] = len(store)
        return result

    rollout._step = step

    async def two_steps():
        first = asyncio.ensure_future(rollout.step(0, 0, keep_running=True))
        second = asyncio.ensure_future(rollout.step(1, 1, keep_running=False))  # asked before the first ends
        return await first, await second

    first, second = asyncio.run(two_steps())
    assert "needs the rollout drained" in seen[0] and seen[1] == "checkpointable"
    carried = set(first.running)
    assert carried and first.metrics["rollout/groups_running"] == len(carried)
    assert first.metrics["rollout/groups_partial"] == 0 and seen[0, "stored"] == 0  # nothing stored: all running
    # the second step went on with the first's groups: some of them are in its batch, none taken again
    assert carried & set(second.returned_group_ids)
    assert not set(first.returned_group_ids) & set(second.returned_group_ids)
    assert len(aborts) == 1 and second.running == []
    assert source.num_groups_taken == rollout.num_returned_groups + rollout.num_dropped_groups + len(store)


def test_a_step_asked_ahead_runs_after_its_predecessor_whichever_call_arrives_first():
    """An async actor may start two calls in either order (Ray promises no order there): the driver's
    look-ahead step, if it arrives first, waits for the step it was asked after (`after`), which then keeps its
    groups running into it. Without `after` the lowest step asked so far runs: the look-ahead step would run
    first, and the step before it would find nothing to keep running into."""
    def parts():
        rollout, _, source, store, _ = make_rollout_parts(cfg(max_response_len=200, policy="mask"), seed=1)
        order, inner = [], rollout._step

        async def step(n, version, keep_running):
            order.append(n)
            return await inner(n, version, keep_running)

        rollout._step = step
        return rollout, order

    async def look_ahead_first(rollout, after):
        second = asyncio.ensure_future(rollout.step(1, 1, keep_running=False, after=after))
        await asyncio.sleep(0)  # the look-ahead call is waiting for its turn before the first one arrives
        first = asyncio.ensure_future(rollout.step(0, 0, keep_running=True))
        return await first, await second

    rollout, order = parts()
    first, second = asyncio.run(look_ahead_first(rollout, after=0))
    assert order == [0, 1]
    assert first.running and first.metrics["rollout/groups_partial"] == 0
    assert set(first.running) & set(second.returned_group_ids)  # the second went on with the first's groups
    unordered, order = parts()
    first, _ = asyncio.run(look_ahead_first(unordered, after=None))
    assert order == [1, 0] and first.running == []


def test_a_kept_step_with_no_step_asked_after_it_stops_its_groups():
    """The rollout may not run further ahead than the steps the driver asked for: a step asked to keep its
    groups running, with none asked after it, interrupts and stores them as a synchronous step does."""
    c = cfg(max_response_len=200, policy="mask")
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=1)
    aborts = counting_aborts(pool)
    result = asyncio.run(rollout.step(0, 0, keep_running=True))
    assert result.running == [] and rollout.running is None and len(aborts) == 1
    assert result.metrics["rollout/groups_partial"] + result.metrics["rollout/groups_surplus"] == len(store) > 0
    assert source.num_groups_taken == rollout.num_returned_groups + rollout.num_dropped_groups + len(store)


def test_an_engine_death_in_a_kept_step_loses_no_group():
    """Engine 0 dies while a kept step's groups run on it; they go to engine 1 and, after its restart, the
    steps go on: every group is still accounted for and no sample is returned twice."""
    c = cfg(max_response_len=120, policy="mask")
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=5)
    results, _ = asyncio.run(overlapped(rollout, engines, overlap_train(6), kill=1))
    assert all(unaccounted == 0 for _, unaccounted in results)
    ids = [s.sample_id for r, _ in results for g in r.groups for s in map(resolve, g)]
    assert len(ids) == len(set(ids)) == 6 * c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt
    assert sum(r.metrics["rollout/engine_crashes"] for r, _ in results) == 1
    assert source.num_groups_taken == rollout.num_returned_groups + rollout.num_dropped_groups + len(store)


def test_overlaps_drains_before_each_checkpoint_and_at_the_end():
    train = load_config(None, ["train.overlap=true", "train.num_steps=7", "train.save_every=3"]).train
    assert [overlaps(train, s) for s in range(7)] == [True, True, False, True, True, False, False]
    sync = load_config(None, ["train.num_steps=7"]).train
    assert not any(overlaps(sync, s) for s in range(7))


@pytest.mark.parametrize("overrides, key", [
    (["placement.colocate=true"], "train.overlap: a colocated layout"),
    (["rollout.schedule=sync"], "train.overlap: keeps APRIL's"),
    (["staleness.max_versions=0"], "staleness.max_versions: the overlapped mode"),
    (["train.overlap_ahead=5"], "train.overlap_ahead: 5 steps ahead .* past staleness.max_versions=4"),
    (["train.overlap_ahead=0"], "train.overlap_ahead: must be > 0"),
])
def test_the_overlapped_mode_refuses_what_it_cannot_do(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, ["train.overlap=true", *overrides])


def test_running_ahead_needs_the_overlapped_mode_and_room_in_the_staleness_bound():
    with pytest.raises(ConfigError, match="train.overlap_ahead: 2 steps ahead needs the overlapped mode"):
        load_config(None, ["train.overlap_ahead=2"])
    keep = load_config(None, ["train.overlap=true", "train.overlap_ahead=6", "staleness.policy=keep"])
    assert keep.train.overlap_ahead == 6
    assert load_config(None, ["train.overlap=true", "train.overlap_ahead=4"]).train.overlap_ahead == 4


def test_the_steps_asked_ahead_stop_at_each_drained_step():
    """Up to train.overlap_ahead steps beyond the one waited for, never past the step before a checkpoint
    (steps 2 and 5 drain) nor the last (6); none in the synchronous mode."""
    train = overlap_train(7, save_every=3, ahead=3)
    assert [asked_ahead(train, s) for s in range(7)] == [[1, 2], [2], [], [4, 5], [5], [], []]
    assert [asked_ahead(overlap_train(7, ahead=2), s) for s in range(7)] == [
        [1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6], []]
    assert asked_ahead(overlap_train(7), 0) == [1]
    assert not any(asked_ahead(load_config(None, ["train.num_steps=7"]).train, s) for s in range(7))


def test_steps_asked_ahead_run_one_at_a_time_in_step_order():
    """The overlapped driver asks for the next steps before their turn: each starts when the one before it
    returned, whatever order the requests arrive in, and goes on with the groups that one left running."""
    c = cfg(max_response_len=120, policy="mask")
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=2)
    order = []
    step = rollout._step

    async def recorded(n, version, keep_running):
        order.append(n)
        return await step(n, version, keep_running)

    rollout._step = recorded

    async def asked_out_of_order():
        first = asyncio.ensure_future(rollout.step(0, 0, True))
        await asyncio.sleep(0)
        later = [asyncio.ensure_future(rollout.step(n, n, n < 2)) for n in (2, 1)]
        return [await first, *reversed(await asyncio.gather(*later))]

    results = asyncio.run(asked_out_of_order())
    assert order == [0, 1, 2] and [r.step for r in results] == [0, 1, 2]
    assert set(results[0].running) & set(results[1].returned_group_ids)
    assert results[2].running == [] and rollout.running is None


def random_reward(seed: int):
    import random

    rng = random.Random(seed)
    return lambda prompt, text, answer: 1.0 if answer == "True" else float(rng.random() < 0.5)


def by_length(prompts, responses, answers, metadatas):
    return [float(len(r)) for r in responses]


@pytest.mark.parametrize("kind", ["dynamic_filter", "reward_per_group"])
def test_the_filter_and_group_rewards_work_across_kept_steps(kind):
    """Groups that finish while no step collects, or whose samples finish in different steps, are filtered
    and scored as in a synchronous step: kept groups have reward signal, a group function sees whole groups."""
    c = cfg(max_response_len=120, policy="mask", dynamic_filter=kind == "dynamic_filter")
    per_group = kind == "reward_per_group"
    rollout, pool, source, store, engines = make_rollout_parts(
        c, seed=4, reward_fn=by_length if per_group else random_reward(4), reward_per_group=per_group)
    results, _ = asyncio.run(overlapped(rollout, engines, overlap_train(6)))
    assert all(unaccounted == 0 for _, unaccounted in results)
    for r, _ in results:
        for group in r.groups:
            samples = [resolve(h) for h in group]
            assert all(s.reward is not None for s in samples)
            if per_group:
                assert [s.reward for s in samples] == [float(len(s.response_ids)) for s in samples]
            else:
                assert len({s.reward for s in samples}) > 1
    if not per_group:
        assert sum(len(r.dropped) for r, _ in results) > 0
