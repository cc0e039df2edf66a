"""The monitor, store, source and dispatch logic without Ray, on fake engines with long-tailed lengths."""
import asyncio

import pytest

from april_ray.config import Config, RolloutConfig, SamplingConfig, StalenessConfig
from april_ray.rollout.local import LocalHandle, resolve
from april_ray.rollout.store import PartialRolloutStore
from april_ray.types import SampleMeta, SampleState
from tests.fakes import TOKEN, make_rollout_parts


def cfg(max_response_len=300, max_versions=4, policy="keep", **kw):
    """A root config: the monitor's section from `kw`, the response budget and the staleness bound."""
    base = dict(rollout_batch_size=4, over_sampling_batch_size=8, n_samples_per_prompt=4)
    return Config(rollout=RolloutConfig(**{**base, **kw}), sampling=SamplingConfig(max_response_len=max_response_len),
                  staleness=StalenessConfig(max_versions=max_versions, policy=policy))


def returned_samples(result):
    return [resolve(h) for group in result.groups for h in group]


def check_invariants(result, rollout, source, store, c, seen: set):
    # Accounting: every group taken from the source is returned, dropped, or in the store.
    assert source.num_groups_taken == rollout.num_returned_groups + rollout.num_dropped_groups + len(store)
    assert len(result.groups) == c.rollout.rollout_batch_size
    for s in returned_samples(result):
        assert s.sample_id not in seen, f"{s.sample_id} returned twice"
        seen.add(s.sample_id)
        assert s.state == SampleState.FINISHED and s.reward is not None
        assert len(s.response_ids) == len(s.logprobs) == len(s.versions) <= c.sampling.max_response_len
        assert set(s.response_ids) <= {TOKEN}
        target = s.prompt_ids[0]  # the fake's length; a sample never grows past it or the budget
        assert len(s.response_ids) == min(target, c.sampling.max_response_len) or s.num_discarded_tokens
    for g in store.partial.values():
        assert not g.is_complete and all(isinstance(s.state, SampleState) for s in g.samples)
        assert all(s.state != SampleState.RUNNING for s in g.samples)


async def run_steps(rollout, source, store, engines, c, num_steps, bump_version=True):
    seen, results = set(), []
    for step in range(num_steps):
        version = step if bump_version else 0
        for e in engines:
            e.update_weights(None, version)
        result = await rollout.step(step, version)
        check_invariants(result, rollout, source, store, c, seen)
        results.append(result)
    return results


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("abort_delay", [0.0, 0.003])
def test_april_many_steps_nothing_lost_or_duplicated(seed, abort_delay):
    c = cfg(max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=seed, abort_delay=abort_delay)
    results = asyncio.run(run_steps(rollout, source, store, engines, c, 12))
    assert any(r.metrics["rollout/groups_resumed"] > 0 for r in results)
    assert any(r.metrics["rollout/off_policy_token_ratio"] > 0 for r in results)
    resumed = [s for r in results for s in returned_samples(r) if s.num_resumes]
    assert resumed and any(len(set(s.versions)) > 1 for s in resumed)  # tokens from several policies
    # every returned sample is behind a handle of this monitor, also the finished members of groups that
    # went through the store (which holds values): no new object per sample (a ray.put each on Ray)
    assert all(isinstance(h, LocalHandle) for r in results for g in r.groups for h in g)
    assert not rollout.finished_handles.keys() - {s.sample_id for g in store.partial.values() for s in g.samples} \
        - {s.sample_id for g in store.complete for s in g.samples}
    # versions never decrease along a response, and are at most the step that returned it
    for r in results:
        for s in returned_samples(r):
            assert s.versions == sorted(s.versions) and max(s.versions, default=0) <= r.step


def test_resume_continues_with_remaining_budget_across_steps():
    c = cfg(max_response_len=60, over_sampling_batch_size=12, max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=4, tick=0.001)
    results = asyncio.run(run_steps(rollout, source, store, engines, c, 10))
    capped = [s for r in results for s in returned_samples(r) if s.prompt_ids[0] > 60]
    assert capped and all(len(s.response_ids) == 60 and s.finish_reason.value == "length" for s in capped)
    assert any(s.num_resumes >= 1 for s in capped)


def test_sync_baseline_waits_for_every_group_and_stores_nothing():
    c = cfg(schedule="sync", over_sampling_batch_size=4)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=5)
    results = asyncio.run(run_steps(rollout, source, store, engines, c, 4))
    assert len(store) == 0 and source.num_groups_taken == 16
    assert all(r.metrics["rollout/abort_latency_s"] == 0 and r.metrics["rollout/off_policy_token_ratio"] == 0
               for r in results)


def test_over_provisioned_baseline_discards_what_it_interrupts():
    """slime's rollout without partial rollout (the APRIL paper's baseline): N' groups start each step, no
    top-up, and at the N-th complete group the rest are aborted and thrown away, tokens and prompts, with
    any surplus complete group: counted as dropped, never stored, never returned; every token on-policy."""
    c = cfg(schedule="oversample", over_sampling_batch_size=8)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=5)
    results = asyncio.run(run_steps(rollout, source, store, engines, c, 4))
    assert len(store) == 0 and all(r.metrics["rollout/groups_partial"] == 0 for r in results)
    # over-provisioned at the start, never topped up (no filter here)
    assert all(r.metrics["rollout/groups_fresh"] == 8 for r in results)
    discarded = sum(r.metrics["rollout/groups_discarded"] for r in results)
    assert discarded > 0 and sum(r.metrics["rollout/discarded_tokens"] for r in results) > 0
    assert rollout.num_dropped_groups == discarded  # no filter here: every drop is a discard
    assert all(r.metrics["rollout/off_policy_token_ratio"] == 0 for r in results)


def test_over_provisioned_baseline_with_the_dynamic_filter_refills_only_to_reach_n():
    """With DAPO's filter the baseline tops up only when the filter's drops leave fewer than N groups that
    could still complete, one group per missing one; every group taken is returned, dropped or discarded."""
    import random

    rng = random.Random(0)

    def reward(prompt, text, answer):  # every third prompt is "too easy": all its samples score 1
        return 1.0 if answer == "True" else float(rng.random() < 0.5)

    c = cfg(schedule="oversample", dynamic_filter=True, over_sampling_batch_size=6)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=8, reward_fn=reward)
    results = asyncio.run(run_steps(rollout, source, store, engines, c, 6))
    assert sum(len(r.dropped) for r in results) > 0 and len(store) == 0
    for r in results:
        fresh, dropped, discarded = (r.metrics["rollout/groups_fresh"], len(r.dropped), len(r.discarded))
        assert fresh == 4 + dropped + discarded  # N returned, the rest dropped or discarded
        assert fresh <= 6 + max(0, dropped - 2)  # N' at the start, then one per drop past N' - N
    assert rollout.num_dropped_groups == sum(len(r.dropped) + len(r.discarded) for r in results)


def test_the_schedule_is_one_field_and_the_old_keys_name_it(tmp_path):
    """`rollout.schedule` holds the three schedules; the two retired booleans fail at start naming it, from a
    file or an override; a benchmark mode that picks a schedule gets exactly that one."""
    from april_ray.config import ConfigError, load_config, validate, with_rollout

    with pytest.raises(ConfigError, match="rollout.schedule: must be one of april, sync, oversample"):
        validate(cfg(schedule="discard"))
    for override in ("rollout.partial_rollout=false", "rollout.discard_unfinished=true"):
        with pytest.raises(ConfigError, match=rf"{override.split('=')[0]}: no longer a key; use rollout.schedule"):
            load_config(None, [override])
    path = tmp_path / "old.yaml"
    path.write_text("rollout:\n  partial_rollout: false\n")
    with pytest.raises(ConfigError, match="rollout.partial_rollout: no longer a key; use rollout.schedule"):
        load_config(str(path))
    baseline = cfg(schedule="oversample")
    assert with_rollout(baseline, schedule="april").rollout.schedule == "april"
    assert with_rollout(baseline, schedule="sync").rollout.schedule == "sync"
    assert with_rollout(baseline, rollout_batch_size=2).rollout.schedule == "oversample"


def test_dispatch_balances_load_across_engines():
    c = cfg(rollout_batch_size=8, over_sampling_batch_size=16)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=6, num_engines=3, cap=5)
    asyncio.run(run_steps(rollout, source, store, engines, c, 3))
    calls = [e.num_calls for e in engines]
    assert min(calls) > 0.6 * max(calls)


def test_aborts_racing_completions_keep_surplus_groups_for_next_step():
    c = cfg(rollout_batch_size=4, over_sampling_batch_size=16, n_samples_per_prompt=2, max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=7, abort_ticks=100, cap=64)

    async def main():
        seen, checked = set(), 0
        for step in range(6):
            carried = [g.group_id for g in store.complete]  # surplus of the previous step, in order
            result = await rollout.step(step, step)
            check_invariants(result, rollout, source, store, c, seen)
            # the carried groups are returned first, before any group of this step
            assert result.returned_group_ids[: len(carried)] == carried[: c.rollout.rollout_batch_size]
            checked += bool(carried)
        return checked

    assert asyncio.run(main()) > 0, "the racing abort should have produced surplus groups"


def test_dynamic_filter_drops_uniform_groups_with_reason_and_refills():
    import random

    rng = random.Random(0)

    def reward(prompt, text, answer):  # every third prompt is "too easy": all its samples score 1
        return 1.0 if answer == "True" else float(rng.random() < 0.5)

    c = cfg(dynamic_filter=True, max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=8, reward_fn=reward)
    results = asyncio.run(run_steps(rollout, source, store, engines, c, 4))
    assert all(set(r.dropped.values()) <= {"zero_reward_variance"} for r in results)
    assert sum(len(r.dropped) for r in results) > 0 and rollout.num_dropped_groups > 0
    for r in results:  # what was kept has signal; what was dropped is handed over too, with its samples
        for group in r.groups:
            assert len({resolve(h).reward for h in group}) > 1
        assert len(r.dropped_groups) == len(r.dropped)
        for gid, group in zip(r.dropped, r.dropped_groups):
            samples = [resolve(h) for h in group]
            assert {s.group_id for s in samples} == {gid} and len({s.reward for s in samples}) == 1


def test_dynamic_filter_that_drops_everything_fails_clearly_and_keeps_samples():
    c = cfg(dynamic_filter=True, max_filtered_groups=10)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=8)  # parity reward: uniform per group
    with pytest.raises(RuntimeError, match="dynamic filter dropped"):
        asyncio.run(rollout.step(0, 0))
    assert source.num_groups_taken == rollout.num_dropped_groups + len(store)
    assert all(not e.running for e in engines)  # nothing left generating for nobody


def test_engine_death_mid_step_redispatches_without_loss():
    c = cfg(max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=9, tick=0.001)

    async def main():
        seen = set()
        r0 = await rollout.step(0, 0)
        check_invariants(r0, rollout, source, store, c, seen)
        killer = asyncio.get_running_loop().call_later(0.01, pool.kill, 1)
        r1 = await rollout.step(1, 0)
        killer.cancel()
        check_invariants(r1, rollout, source, store, c, seen)
        return r1

    asyncio.run(main())
    assert rollout.alive == [True, False]


def test_a_failing_engine_call_stores_every_sample_then_fails_the_step():
    """A call that fails for any reason but a dead engine (a bug, a bad sample) is not resent: the step
    aborts and drains the rest, stores every group with the samples as they were sent, and raises."""
    c = cfg(max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=4, tick=0.001)
    asyncio.run(rollout.step(0, 0))
    calls = []

    def failing_third(generate_group):
        async def call(samples, step, context=()):
            calls.append(step)
            if len(calls) != 3:
                return await generate_group(samples, step, context)
            raise ValueError("bad sample")
        return call

    for w in pool.workers:
        w.generate_group = failing_third(w.generate_group)
    before = {g.group_id: [s.state for s in g.samples] for g in store.partial.values()}
    with pytest.raises(RuntimeError, match="an engine call failed: group .* ValueError"):
        asyncio.run(rollout.step(1, 1))
    assert source.num_groups_taken == rollout.num_returned_groups + rollout.num_dropped_groups + len(store)
    assert all(not e.running for e in engines) and rollout.alive == [True, True]
    assert set(before) <= set(store.partial) | {g.group_id for g in store.complete}
    for w in pool.workers:  # the next step goes on with every group
        del w.generate_group
    result = asyncio.run(rollout.step(2, 2))
    check_invariants(result, rollout, source, store, c, set())


def test_store_staleness_restart_and_keep():
    from april_ray.types import Group, Sample

    def group(versions):
        s = Sample("g/0", "g", "p", "a", [1], 100, response_ids=[7] * len(versions), logprobs=[0.0] * len(versions),
                   versions=versions, state=SampleState.PARTIAL)
        return Group("g", 0, [s])

    store = PartialRolloutStore(StalenessConfig(max_versions=2, policy="restart"))
    store.put_partial([group([1, 1, 3])])
    [g] = store.take_partial(5, version=4)  # 4 - 1 > 2: restarted from the prompt
    s = g.samples[0]
    assert s.response_ids == [] and s.state == SampleState.QUEUED and s.num_discarded_tokens == 3
    store.put_partial([group([2, 3])])
    [g] = store.take_partial(5, version=4)  # 4 - 2 = 2: within the bound, resumed as is
    assert g.samples[0].response_ids == [7, 7]
    keep = PartialRolloutStore(StalenessConfig(max_versions=0, policy="keep"))
    keep.put_partial([group([0])])
    assert keep.take_partial(1, version=9)[0].samples[0].versions == [0]


def test_store_hands_out_oldest_first():
    from april_ray.types import Group, Sample

    store = PartialRolloutStore(StalenessConfig(max_versions=5))
    for i in range(4):
        s = Sample(f"g{i}/0", f"g{i}", "p", "a", [1], 10, response_ids=[7], logprobs=[0.0], versions=[0],
                   state=SampleState.PARTIAL)
        store.put_partial([Group(f"g{i}", i, [s])])
    assert [g.group_id for g in store.take_partial(3, 0)] == ["g0", "g1", "g2"]


def test_save_restore_mid_run_loses_and_repeats_nothing():
    import pickle

    c = cfg(max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=10)
    first = asyncio.run(run_steps(rollout, source, store, engines, c, 3))
    saved = pickle.dumps((source.state_dict(), store.state_dict(), rollout.num_returned_groups))
    # a fresh process: new source and store, restored from the checkpoint
    rollout2, pool2, source2, store2, engines2 = make_rollout_parts(c, seed=10)
    src_state, store_state, returned = pickle.loads(saved)
    source2.load_state_dict(src_state)
    store2.load_state_dict(store_state)
    rollout2.num_returned_groups = returned
    partial_before = set(store2.partial)

    async def more():
        seen = {s.sample_id for r in first for s in returned_samples(r)}
        out = []
        for step in range(3, 6):
            r = await rollout2.step(step, step)
            check_invariants(r, rollout2, source2, store2, c, seen)
            out.append(r)
        return out

    later = asyncio.run(more())
    ids_first = {g for r in first for g in r.returned_group_ids}
    ids_later = [g for r in later for g in r.returned_group_ids]
    assert not ids_first & set(ids_later) and len(ids_later) == len(set(ids_later))
    resumed = partial_before & set(ids_later) | partial_before & set(store2.partial)
    assert resumed == partial_before  # every stored prompt came back or is still waiting
    # the restored cursor continues exactly where it stopped
    assert source2.num_groups_taken == rollout2.num_returned_groups + len(store2)


def test_resumed_groups_go_back_to_the_engine_that_ran_them():
    """Their KV caches may be parked there; with room on that engine, the dispatcher sends them back."""
    c = cfg(max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=3, cap=64)

    async def main():
        checked = 0
        for step in range(8):
            where = {s.sample_id: g.engine for g in store.partial.values() for s in g.samples
                     if s.state == SampleState.PARTIAL}
            assert all(e in (0, 1) for e in where.values())
            for e in engines:
                e.request_ids.clear()
            await rollout.step(step, step)
            for sid, e in where.items():
                assert f"{sid}@{(rollout.run_id, step)}" in engines[e].request_ids
                checked += 1
        return checked

    assert asyncio.run(main()) > 0


def test_a_store_found_empty_is_not_asked_again_in_the_same_step():
    """Top-ups after every completed group ask the store only until it comes back short (the monitor is
    its only writer, and writes at the end of a step); the next step asks again, and gets its groups."""
    c = cfg()
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=3)
    calls = []
    take = store.take_partial
    store.take_partial = lambda n, v: calls.append(n) or take(n, v)
    seen = set()
    for step in range(4):
        calls.clear()
        result = asyncio.run(rollout.step(step, step))
        check_invariants(result, rollout, source, store, c, seen)
        resumed = result.metrics["rollout/groups_resumed"]
        assert len(calls) == 1, calls  # the first top-up empties it (it holds fewer than N' groups)
        assert step == 0 or resumed > 0


def test_engines_all_dead_mid_step_wait_for_revival_and_lose_nothing():
    """Both engines die mid-step: their samples wait, the step resumes when one is restarted and handed
    back (`revive`), and the crashes and the work thrown away are counted."""
    c = cfg(max_versions=100, engine_wait_s=5.0)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=9, tick=0.001)

    async def main():
        seen = set()
        check_invariants(await rollout.step(0, 0), rollout, source, store, c, seen)

        async def chaos(t0, step):  # on progress, not at fixed times: each engine has returned a call of
            while min(rollout.heard_s) <= t0:  # step 1 (the work thrown away is estimated from that return on)
                assert not step.done(), "step 1 ended before both engines had returned a call"
                await asyncio.sleep(0.001)
            pool.kill(0)
            await asyncio.sleep(0.005)
            pool.kill(1)
            await asyncio.sleep(0.2)
            pool.restart(1)
            rollout.revive([1])

        t0, step = rollout.clock(), asyncio.ensure_future(rollout.step(1, 0))
        deaths = asyncio.ensure_future(rollout.dead_engines([], 1))  # what the driver waits on
        await chaos(t0, step)
        assert deaths.done() and set(deaths.result()) <= {0, 1} and deaths.result()  # told at the first death
        r1 = await step
        check_invariants(r1, rollout, source, store, c, seen)
        assert rollout.alive == [False, True]
        assert await rollout.dead_engines([1], 1) == [0]  # differs from what the caller knew: at once
        # a death is counted with the call it takes: the second engine, killed 5 ms after the first, may be
        # between calls then (its dispatch on its way), and lose nothing
        assert r1.metrics["rollout/engine_crashes"] in (1, 2) and r1.metrics["rollout/crash_tokens_lost"] > 0
        pool.restart(0)
        rollout.revive([0])
        quiet = asyncio.ensure_future(rollout.dead_engines([], 2))
        r2 = await rollout.step(2, 0)  # the engine taken back gets work again
        check_invariants(r2, rollout, source, store, c, seen)
        assert await quiet == []  # no death in step 2: the wait ended with the step
        assert r2.metrics["rollout/engine_crashes"] == 0 and r2.metrics["rollout/crash_tokens_lost"] == 0
        return r1

    asyncio.run(main())
    assert rollout.num_engine_crashes == 2 and rollout.alive == [True, True]
    assert engines[0].request_ids and any(f"@{(rollout.run_id, 2)}" in r for r in engines[0].request_ids)


def test_no_engine_back_in_time_fails_the_step_with_every_sample_stored():
    c = cfg(max_versions=100, engine_wait_s=0.05)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=9, tick=0.001)
    asyncio.run(rollout.step(0, 0))

    async def main():
        loop = asyncio.get_running_loop()
        for e in (0, 1):
            loop.call_later(0.01, pool.kill, e)
        await rollout.step(1, 1)

    with pytest.raises(RuntimeError, match="no engine came back within rollout.engine_wait_s"):
        asyncio.run(main())
    assert source.num_groups_taken == rollout.num_returned_groups + rollout.num_dropped_groups + len(store)
    pool.restart(0)
    rollout.revive([0])
    check_invariants(asyncio.run(rollout.step(2, 2)), rollout, source, store, c, set())


def test_mask_bounds_every_trained_token_also_finished_members_and_surplus():
    """Under staleness.policy=mask the learner's mask (collate + off_policy_weights at the version the
    batch is trained at) drops exactly the tokens older than the bound: also those of finished samples
    that waited in the store for their group's siblings, which no store policy restarts."""
    from april_ray.learn.algorithms import off_policy_weights
    from april_ray.learn.corrections import TruncatedIS
    from april_ray.learn.learner import collate

    bound = 1
    c = cfg(max_response_len=300, max_versions=bound, policy="mask", over_sampling_batch_size=16)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=2, tick=0.0005)
    results = asyncio.run(run_steps(rollout, source, store, engines, c, 10))
    stale_finished, masked = 0, 0
    for r in results:
        samples = returned_samples(r)
        batch = collate(samples, pad_id=0)
        _, keep, _ = off_policy_weights(batch["behaviour_logp"], batch["behaviour_logp"], batch["versions"], r.step,
                                        batch["mask"], correction=TruncatedIS(2.0),
                                        staleness=StalenessConfig(max_versions=bound, policy="mask"))
        age = (r.step - batch["versions"]) * batch["mask"]
        assert not (keep * (age > bound)).any()  # nothing older than the bound is trained
        assert (keep == batch["mask"] * (age <= bound)).all()  # and everything within it is
        masked += int((batch["mask"] - keep).sum())
        assert StalenessConfig(max_versions=bound, policy="mask").oldest_trained(r.staleness) <= bound
        stale_finished += sum(1 for s in samples if s.versions and r.step - s.versions[0] > bound)
    assert masked > 0 and stale_finished > 0, "the run should have trained some stale tokens to mask"


def test_trained_staleness_max_and_the_mask_per_policy_by_hand():
    import torch

    from april_ray.learn.algorithms import off_policy_weights
    from april_ray.learn.corrections import TruncatedIS

    hist = {0: 10, 2: 5, 4: 3, 7: 1, 9: 0}
    def trained_max(h, bound, policy="mask"):
        return StalenessConfig(max_versions=bound, policy=policy).oldest_trained(h)

    assert trained_max(hist, 0, "keep") == 7  # keep: every token is trained (9 has none)
    assert trained_max(hist, 4) == 4 and trained_max(hist, 3) == 2 and trained_max(hist, 3, "restart") == 2
    assert trained_max(hist, 0) == 0 and trained_max({}, 4) == 0
    assert [StalenessConfig(max_versions=3, policy=p).trains(4) for p in ("keep", "restart", "mask")] == [True, False, False]
    assert all(StalenessConfig(max_versions=3, policy=p).trains(3) for p in ("keep", "restart", "mask"))
    assert StalenessConfig().policy == "mask"
    versions = torch.tensor([[5, 5, 7, 8, 0], [2, 3, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.float)
    logp = torch.zeros(2, 5)
    _, keep, m = off_policy_weights(logp, logp, versions, 8, mask,  # trained at version 8, bound 2
                                    correction=TruncatedIS(2.0), staleness=StalenessConfig(max_versions=2, policy="mask"))
    assert keep.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0]]  # ages 3 3 1 0 | 6 5 2
    assert m["off_policy/masked_token_ratio"] == pytest.approx(4 / 7)


def test_first_prompts_are_the_prompts_a_source_hands_out_first():
    from april_ray.rollout.prompt_source import PromptSource, first_prompts
    from april_ray.task.data import Example

    examples = [Example(i, str(i), "") for i in range(50)]
    encode = lambda text: [int(text), 0]  # noqa: E731
    groups = PromptSource(examples, encode, 4, 16, seed=7).take(12)
    assert first_prompts(examples, encode, 7, 12) == [g.samples[0].prompt_ids for g in groups]
    assert first_prompts(examples, encode, 7, 12) != first_prompts(examples, encode, 8, 12)


def test_version_counts_are_exact_for_runs_and_for_lists_out_of_order():
    import random
    from collections import Counter

    from april_ray.types import Sample

    def version_counts(versions):
        s = Sample("g0s0", "g0", "p", "a", [1], 40, response_ids=[7] * len(versions), logprobs=[0.0] * len(versions),
                   versions=versions, state=SampleState.PARTIAL)
        return SampleMeta.of(s, 0).version_counts

    assert version_counts([]) == {}
    assert version_counts([4, 4, 4]) == {4: 3}
    assert list(version_counts([2, 2, 3, 5, 5, 5]).items()) == [(2, 2), (3, 1), (5, 3)]
    # runs whose value recurs later, or a list in descending order, are counted in full, oldest first
    assert list(version_counts([1, 1, 2, 1]).items()) == [(1, 3), (2, 1)]
    assert list(version_counts([5, 5, 3, 3]).items()) == [(3, 2), (5, 2)]
    assert list(version_counts([3, 3, 7]).items()) == [(3, 2), (7, 1)]
    assert list(version_counts([2, 1, 2, 1, 1]).items()) == [(1, 3), (2, 2)]
    assert list(version_counts([1, 2, 3, 3]).items()) == [(1, 1), (2, 1), (3, 2)]
    rng = random.Random(0)
    for _ in range(2000):
        v = [rng.randint(0, 4) for _ in range(rng.randint(1, 30))]
        for versions in (v, sorted(v), sorted(v, reverse=True)):
            assert list(version_counts(versions).items()) == sorted(Counter(versions).items())


def test_a_resent_and_extended_sample_is_a_new_one_and_the_original_stays_as_sent():
    import dataclasses

    from april_ray.types import FinishReason, GenerateOutput, Sample

    s = Sample("g0s0", "g0", "p", "a", [1, 2], 8)
    fresh = s.resend()
    assert fresh.num_resumes == 0 and fresh.response_ids == []
    part = fresh.extended(GenerateOutput("r", [7, 8], [-1.0, -1.0], [0, 0], FinishReason.ABORT))
    assert part.state == SampleState.PARTIAL and part.response_ids == [7, 8]
    assert s.response_ids == [] and s.state == SampleState.QUEUED  # the original is as it was sent
    again = part.resend()
    assert again.num_resumes == 1 and part.num_resumes == 0 and again.input_ids == [1, 2, 7, 8]
    done = again.extended(GenerateOutput("r", [9], [-0.5], [1], FinishReason.STOP))
    assert done.state == SampleState.FINISHED and done.versions == [0, 0, 1] and part.response_ids == [7, 8]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.reward = 1.0


def test_a_failed_step_keeps_no_handle_of_the_groups_it_dropped():
    """A failing step stores every group; the filter's drops leave the run, and the handles of their
    finished samples (each pins its call's result) go with them, as after a step that succeeds."""
    from april_ray.rollout.monitor import StepFailed

    c = cfg(max_versions=100)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=3, cap=6)

    async def main():
        for step in range(3):
            await monitor.step(step, step)
        monitor.cfg.dynamic_filter, monitor.cfg.max_filtered_groups = True, 2  # parity rewards: all dropped
        with pytest.raises(StepFailed, match="dynamic filter dropped"):
            await monitor.step(3, 3)

    asyncio.run(main())
    in_store = {s.sample_id for g in [*store.partial.values(), *store.complete] for s in g.samples}
    assert set(monitor.finished_handles) <= in_store
