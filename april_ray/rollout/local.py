"""The rollout without Ray: an in-process `EnginePool` over `EngineWorker`s and async views of the source
and store, all on one event loop. The rollout tests run on it (with fake engines), and so does
`jobs/bench_schedule.py` (with the real engine), which measures the schedules without any transport.

A sample handle here is a `LocalHandle`: element `index` of a call's result, like `actors.refs.SampleRef`
on Ray.
"""
from __future__ import annotations

import asyncio

from april_ray.rollout.monitor import EngineFailure
from april_ray.rollout.store import resolve_groups


class LocalHandle:
    def __init__(self, call: asyncio.Future, index: int):
        self.call = call
        """The worker's call: its result is (metas, samples)."""
        self.index = index

    def value(self):
        return self.call.result()[1][self.index]


def resolve(x):
    return x.value() if isinstance(x, LocalHandle) else x


class LocalPool:
    """`EnginePool` over in-process workers; `kill(e)` makes engine e fail its calls like a dead actor,
    `restart(e)` makes it serve again."""

    def __init__(self, workers, capacities: list[int], abort_delay: float = 0.0):
        self.workers = workers
        self.capacities = capacities
        self.abort_delay = abort_delay
        self.dead: set[int] = set()

    def generate(self, engine, samples, step):
        """(a future of the call's metas, a handle per sample), the call being the worker's
        `EngineWorker.start_group` (a future, no task). The worker starts in a callback of its own, after
        the caller's, as in its own process: a clocked monitor (april_ray/sim/clock.py) is not billed the
        worker's CPU."""
        loop = asyncio.get_running_loop()
        call, metas = loop.create_future(), loop.create_future()
        loop.call_soon(self._start, engine, [resolve(s) for s in samples], step, call)

        def done(c: asyncio.Future) -> None:
            if c.cancelled():
                metas.cancel()
            elif c.exception() is not None:
                metas.set_exception(c.exception())
            elif engine in self.dead:
                metas.set_exception(EngineFailure(f"engine {engine} died mid-call"))
            else:
                metas.set_result(c.result()[0])

        call.add_done_callback(done)
        return metas, [LocalHandle(call, i) for i in range(len(samples))]

    def _start(self, engine, samples, step, call: asyncio.Future) -> None:
        if engine in self.dead:
            if not call.done():
                call.set_exception(EngineFailure(f"engine {engine} is dead"))
            return
        try:
            self.workers[engine].start_group(samples, step, call)
        except Exception as e:  # (it fails its future instead; a worker that raises would hang the call)
            if not call.done():
                call.set_exception(e)

    async def abort_all(self, step, engines):
        if self.abort_delay:  # completions race with the abort while it is on its way
            await asyncio.sleep(self.abort_delay)
        for e in engines:
            self.workers[e].abort_all(step)

    def kill(self, engine):
        self.dead.add(engine)
        self.workers[engine].engine.abort_all()

    def restart(self, engine):
        """Engine e serves again (the monitor takes it back when told: `CompletionMonitor.revive`)."""
        self.dead.discard(engine)


class LocalProxy:
    """Async view of a plain object (source, store), resolving sample handles in what is put into it, as
    the Ray shells do."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)

        async def call(*args):
            args = [resolve_groups(a, resolve) if name.startswith("put_") else a for a in args]
            return fn(*args)

        return call
