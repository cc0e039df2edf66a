"""An elastic rollout fleet (engine.min_engines): engines that leave gracefully hand back every token, the
monitor runs on whatever engines are live and takes new ones in; and, on a small multi-raylet cluster, a
node preempted mid-run and a node joining."""
import asyncio

import pytest

from april_ray.engine.base import EngineLeft
from april_ray.rollout.engine_worker import EngineWorker
from april_ray.rollout.prompt_source import PromptSource
from april_ray.types import SampleState, SamplingParams
from tests.fakes import TOKEN, FakeEngine, length_examples, make_rollout_parts, parity_reward
from tests.test_rollout import cfg, check_invariants


def test_a_leaving_engine_hands_back_every_partial_with_its_tokens_then_refuses_work():
    engine = FakeEngine(tick=0.002)
    worker = EngineWorker(engine, lambda ids: "x" * len(ids), parity_reward, SamplingParams(temperature=1.0))
    [group] = PromptSource(length_examples(1, 0, median=400, tail=400), lambda text: [int(text)], 4, 500, 0).take(1)

    async def main():
        call = asyncio.ensure_future(worker.generate_group(list(group.samples), "step-0"))
        while engine.ticks < 5:
            await asyncio.sleep(0.002)
        aborted = await worker.leave()
        metas, samples = await call
        with pytest.raises(EngineLeft):
            await worker.generate_group(list(samples), "step-0")
        return aborted, metas, samples

    aborted, metas, samples = asyncio.run(main())
    assert aborted == len(group.samples) and not engine.running
    for meta, s in zip(metas, samples):
        assert s.state == meta.state == SampleState.PARTIAL
        # every token the engine generated came back, each with its logprob and policy version
        assert 5 <= len(s.response_ids) == len(s.logprobs) == len(s.versions) == meta.num_new_tokens
        assert set(s.response_ids) == {TOKEN}


def test_the_monitor_runs_on_the_live_engines_and_takes_new_ones_in():
    """Engine 2 is not placed at the start; engine 1 leaves mid-step (its node preempted): its samples go on
    elsewhere with their tokens, a leave and no crash; then a new engine 1 (Ray placed it on a node that
    joined) and engine 2 are taken in and get work; engine 0 then leaves between steps (its node drained
    while the learner trained), which the next step's row counts as a leave."""
    c = cfg(max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=9, num_engines=3, tick=0.001)
    rollout.leave([2], counted=False)

    async def main():
        seen = set()
        r0 = await rollout.step(0, 0)
        check_invariants(r0, rollout, source, store, c, seen)
        assert engines[2].num_calls == 0 and r0.metrics["engines/live"] == 2
        loop = asyncio.get_running_loop()
        leaving = loop.call_later(0.01, lambda: loop.create_task(pool.workers[1].leave()))
        r1 = await rollout.step(1, 0)
        leaving.cancel()
        check_invariants(r1, rollout, source, store, c, seen)
        assert pool.workers[1].leaving and rollout.engines.left == [False, True, True]
        pool.workers[1] = EngineWorker(FakeEngine(0.001, 5, 16), lambda ids: "x" * len(ids), parity_reward,
                                       SamplingParams(temperature=1.0))
        rollout.revive([1, 2])
        r2 = await rollout.step(2, 0)
        check_invariants(r2, rollout, source, store, c, seen)
        alive = list(rollout.alive)
        rollout.leave([0])
        r3 = await rollout.step(3, 0)
        check_invariants(r3, rollout, source, store, c, seen)
        return r0, r1, r2, r3, alive

    r0, r1, r2, r3, alive = asyncio.run(main())
    assert r0.metrics["rollout/engine_leaves"] == 0  # not placed at the start: no leave
    m = r1.metrics
    assert (m["rollout/engine_leaves"], m["rollout/engine_crashes"], m["rollout/crash_tokens_lost"]) == (1, 0, 0)
    assert m["engines/live"] == 1 and rollout.num_engine_crashes == 0
    assert r2.metrics["engines/live"] == 3 and alive == [True, True, True]
    m = r3.metrics
    assert (m["rollout/engine_leaves"], m["rollout/engine_crashes"], m["engines/live"]) == (1, 0, 2)
    assert pool.workers[1].engine.num_calls > 0 and engines[2].num_calls > 0


@pytest.mark.slow
def test_an_engine_sigtermed_mid_step_leaves_gracefully_and_is_taken_back_once_placed_again(tmp_path,
                                                                                             random_model_dir):
    """An elastic fleet on a local Ray (a placement group per engine): engine 1 gets SIGTERM mid-step (a
    preemption notice) and hands back its partial samples, a leave and no crash, no token lost; the job goes
    on with engine 0 alone (engine.min_engines=1). Its process then ends as its node would, Ray places it
    again, and the next step's start catches it up and takes it back."""
    import os
    import signal
    import threading
    import time

    import ray

    from actors.refs import fetch
    from tests.test_ray_rollout import small_cfg, start_engines, start_rollout

    owned = not ray.is_initialized()  # another module's local Ray, if still up, has room for these bundles
    if owned:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    engines = actors = None
    try:
        cfg = small_cfg(tmp_path, "sampling.max_response_len=200", "engine.max_model_len=256", "engine.min_engines=1")
        model_dir, victim = str(random_model_dir), 1
        engines = start_engines(cfg, model_dir)  # returns once one engine is placed (engine.min_engines=1)
        actors, weights = start_rollout(cfg, model_dir, engines), ray.put(None)
        deadline = time.time() + 120
        while len(actors.refresh(0)) < 2 and time.time() < deadline:  # one placed late is taken in
            time.sleep(1.0)
        assert len(engines.engine_groups) == 2 and not engines.missing
        before = ray.get(engines.actors[victim].status.remote())

        def preempt_when_busy():
            deadline = time.time() + 60
            while ray.get(engines.actors[victim].stats.remote(False)).num_running == 0 and time.time() < deadline:
                time.sleep(0.005)
            os.kill(before["pid"], signal.SIGTERM)

        seen, rows = set(), []
        for step in range(4):
            if step == 1:
                threading.Thread(target=preempt_when_busy, daemon=True).start()
            if step == 3:  # the preempted process ends with its node; Ray places it again (here: the same node)
                os.kill(before["pid"], signal.SIGKILL)
                deadline = time.time() + 120
                while len(actors.refresh(step)) < 2 and time.time() < deadline:
                    time.sleep(1.0)
            result = actors.batch(step, step, cfg.train)
            rows.append({k: result.metrics[k] for k in ("engines/live", "rollout/engine_leaves",
                                                        "rollout/engine_crashes", "rollout/crash_tokens_lost")})
            for s in fetch([h for group in result.groups for h in group]):
                assert s.state == SampleState.FINISHED and s.sample_id not in seen
                seen.add(s.sample_id)
                assert len(s.response_ids) == len(s.logprobs) == len(s.versions) and max(s.versions) <= step
            taken = ray.get(actors.source.num_groups_taken.remote())
            counters = ray.get(actors.monitor.state_dict.remote())
            assert taken == counters["returned_groups"] + counters["dropped_groups"] + ray.get(actors.store.size.remote())
            engines.publish(weights, step + 1)
        leaves = [r["rollout/engine_leaves"] for r in rows]
        assert sum(leaves) == 1 and sum(r["rollout/engine_crashes"] + r["rollout/crash_tokens_lost"] for r in rows) == 0
        assert rows[leaves.index(1)]["engines/live"] == 1 and rows[3]["engines/live"] == 2, rows
        after = ray.get(engines.actors[victim].status.remote())
        assert after["pid"] != before["pid"] and after["serving"] and after["version"] == 4
    finally:
        for group in (actors, engines):
            if group is not None:
                group.shutdown()
        if owned:
            ray.shutdown()


def test_the_renewing_thread_outlives_a_failed_try(monkeypatch):
    """`watch_nodes` keeps renewing after a try that raised (the monitor dead while it is restored in place):
    the next tick tries again, until `stop`."""
    import threading

    from driver.rollout import RolloutGroup

    group = RolloutGroup(None, None, None, None, "run")
    tries = []

    def renew():
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("the monitor died")
        if len(tries) == 3:
            group.stop.set()
        return []

    monkeypatch.setattr(group, "renew", renew)
    thread = threading.Thread(target=group.watch_nodes, kwargs={"every_s": 0.01})
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and len(tries) == 3
