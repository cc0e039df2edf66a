"""CompletionMonitor actor: runs `april_ray.rollout.monitor.CompletionMonitor` against engine, source and store actors."""
from __future__ import annotations

import asyncio

import ray
from ray.exceptions import OutOfMemoryError, RayActorError

from actors.metrics import MonitorMetrics
from actors.refs import SampleRef
from actors.store import with_refs
from april_ray.config import RolloutConfig, StalenessConfig
from april_ray.engine.base import EngineFailure, EngineLeft
from april_ray.rollout.monitor import CompletionMonitor


class RayProxy:
    """`proxy.method(*args)` is `actor.method.remote(*args)`: an awaitable object ref."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        return getattr(self.actor, name).remote


class RayStore(RayProxy):
    """The store actor, its groups taken with their samples as the call's second return, which this process
    then owns (actors/store.py)."""

    async def take_complete(self) -> list:
        groups, samples = self.actor.take_complete.remote()
        return with_refs(await groups, samples)

    async def take_partial(self, max_groups: int, version: int) -> list:
        groups, samples = self.actor.take_partial.remote(max_groups, version)
        return with_refs(await groups, samples)


class RayEnginePool:
    def __init__(self, engines, capacities: list[int], reward_per_group: bool = False):
        self.engines = engines
        self.capacities = capacities
        self.reward_per_group = reward_per_group

    def generate(self, engine: int, samples: list, step, context: list = ()):
        """A call sends its context only when there is one: the per-sample reward's calls are unchanged."""
        args = (step, samples, list(context)) if context else (step, samples)
        meta_ref, samples_ref = self.engines[engine].generate_group.options(num_returns=2).remote(*args)
        return self._meta(meta_ref), [SampleRef(samples_ref, i) for i in range(len(samples) + len(context))]

    @staticmethod
    async def _meta(ref):
        try:
            return await ref
        # dead (also: killed by Ray's OOM killer), or restarted and not yet given the current weights
        except (RayActorError, OutOfMemoryError, EngineFailure) as e:
            raise (EngineLeft if isinstance(e, EngineLeft) else EngineFailure)(str(e)) from e

    async def abort_all(self, step, engines: list[int]) -> None:
        results = await asyncio.gather(*[self.engines[e].abort_all.remote(step) for e in engines],
                                       return_exceptions=True)
        for r in results:  # a dead engine's calls fail on their own; anything else is a bug
            if isinstance(r, Exception) and not isinstance(r, (RayActorError, OutOfMemoryError)):
                raise r


@ray.remote(num_cpus=0)
class CompletionMonitorActor:
    def __init__(self, cfg: RolloutConfig, staleness: StalenessConfig, engines, capacities: list[int], source, store,
                 reward_per_group: bool = False):
        """`reward_per_group`: task.reward_per_group (each engine call takes its group's finished samples)."""
        self.pool = pool = RayEnginePool(engines, capacities, reward_per_group)
        self.monitor = CompletionMonitor(cfg, pool, RayProxy(source), RayStore(store), staleness)
        self.metrics = MonitorMetrics(cfg, len(engines))

    async def step(self, step: int, version: int, keep_running: bool = False, after: int | None = None):
        result = await self.monitor.step(step, version, keep_running, after)
        self.metrics.record(result.metrics, result.staleness, self.monitor.engines)
        return result

    async def run_id(self) -> str:
        """The first part of every step token this monitor sends the engines (driver/rollout.py's `abandon`)."""
        return self.monitor.run_id

    async def revive(self, engines: list[int]) -> None:
        """Engines restarted and brought to the current weights by the driver (driver/engines.py)."""
        self.monitor.revive(engines)

    async def renewed(self, engines: dict[int, object]) -> None:
        """Engines started again under new handles (an elastic fleet's lost node: driver/engines.py's `renew`);
        out of work, as they were, until `revive`."""
        assert not any(self.monitor.engines.alive[e] for e in engines), engines
        for e, actor in engines.items():
            self.pool.engines[e] = actor

    async def leave(self, engines: list[int], left: bool = True, counted: bool = True) -> None:
        """Engines leaving gracefully, not placed yet (`counted=False`), or (`left=False`) found dead while
        idle (driver/rollout.py): no work until `revive`."""
        self.monitor.leave(engines, left, counted)
        self.metrics.engines_seen(self.monitor.engines)

    async def live_engines(self) -> list[int]:
        """The engines that take work now (the driver's step start: which to catch up, how many run)."""
        return self.monitor.engines.live()

    async def dead_engines(self, known: list[int], step: int) -> list[int]:
        """Returns once the dead engines differ from `known` or `step` has ended (the driver waits on it)."""
        dead = await self.monitor.dead_engines(known, step)
        self.metrics.engines_seen(self.monitor.engines)
        return dead

    async def state_dict(self) -> dict:
        """The monitor's part of a checkpoint: the accounting counters and the auto N'."""
        return self.monitor.state_dict()

    async def load_state_dict(self, state: dict) -> None:
        self.monitor.load_state_dict(state)
