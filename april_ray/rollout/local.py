"""The rollout without Ray: an in-process `EnginePool` over `EngineWorker`s and async views of the source
and store, all on one event loop. The rollout tests run on it (with fake engines), and so does
`jobs/bench/schedule.py` (with the real engine), which measures the schedules without any transport.

A sample handle here is a `LocalHandle`: element `index` of a call's result, like `actors.refs.SampleRef`
on Ray.
"""
from __future__ import annotations

import asyncio

from april_ray.engine.base import EngineFailure
from april_ray.rollout.store import held, resolve_groups


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
        self.reward_per_group = any(w.reward_per_group for w in workers)

    def generate(self, engine, samples, step, context=()):
        """(a task of the call's metas, a handle per sample and per context sample), the call being the
        worker's `generate_group`."""
        context = [resolve(s) for s in context]
        call = asyncio.ensure_future(self._call(engine, [resolve(s) for s in samples], step, context))
        metas = asyncio.ensure_future(self._metas(engine, call))
        metas.add_done_callback(lambda m: call.cancel() if m.cancelled() else None)
        return metas, [LocalHandle(call, i) for i in range(len(samples) + len(context))]

    async def _call(self, engine, samples, step, context):
        if engine in self.dead:
            raise EngineFailure(f"engine {engine} is dead")
        return await self.workers[engine].generate_group(samples, step, context)

    async def _metas(self, engine, call: asyncio.Future):
        metas, _ = await asyncio.shield(call)
        if engine in self.dead:
            raise EngineFailure(f"engine {engine} died mid-call")
        return metas

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
            if name.startswith("put_"):  # (groups, reward errors by sample id)
                args = [resolve_groups(*args[:1], resolve, *args[1:])]
            out = fn(*args)
            return [held(g, g.samples) for g in out] if name.startswith("take_") else out

        return call
