"""The monitor's per-step bookkeeping: the least-loaded engine and the completion queue."""
import asyncio
import random

from april_ray.rollout.step_state import Completions, EngineLoads


def test_least_loaded_matches_a_scan_under_random_loads_and_deaths():
    rng = random.Random(0)
    caps = [rng.choice([4, 8, 16]) for _ in range(12)]
    loads, alive = EngineLoads(caps), [True] * len(caps)
    for _ in range(5000):
        if rng.random() < 0.05:
            alive[rng.randrange(len(caps))] ^= True
        e = rng.randrange(len(caps))
        loads.add(e, rng.choice([-1, 1, 2]) if loads[e] > 1 else 1)
        live = [i for i, ok in enumerate(alive) if ok]
        expected = min(live, key=lambda i: loads[i] / caps[i]) if live else None
        assert loads.least(alive) == expected
    assert len(loads.heap) <= 8 * len(caps) + 64


def test_least_loaded_none_when_every_engine_is_dead_and_back_when_revived():
    loads = EngineLoads([2, 2])
    loads.add(1, 1)
    assert loads.least([False, False]) is None
    assert loads.least([False, True]) == 1
    assert loads.least([True, True]) == 0


def test_completions_come_in_resolution_order_and_time_out_empty():
    async def main():
        loop = asyncio.get_running_loop()
        done = Completions()
        futs = [loop.create_future() for _ in range(3)]
        for f in futs:
            done.watch(f)
        assert await done.wait(timeout=0.01) == []
        futs[2].set_result(2)
        futs[0].set_result(0)
        assert [f.result() for f in await done.wait()] == [2, 0]
        loop.call_later(0.01, futs[1].set_result, 1)
        assert [f.result() for f in await done.wait()] == [1]

    asyncio.run(main())
