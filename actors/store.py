"""PartialRolloutStore actor: a shell around `april_ray.store.PartialRolloutStore`.

Groups arrive with object refs in place of samples; the store fetches them itself, so the values live
here (and in checkpoints) and do not depend on the monitor that created the refs staying alive.
"""
from __future__ import annotations

import asyncio

import ray

from april_ray.store import PartialRolloutStore, resolve_groups


async def _fetch(groups):
    refs = [s for g in groups for s in g.samples if isinstance(s, ray.ObjectRef)]
    # One batched get (off the event loop) instead of awaiting each ref: a step stores ~250 samples.
    values = dict(zip(refs, await asyncio.get_running_loop().run_in_executor(None, ray.get, refs)))
    return resolve_groups(groups, lambda s: values[s] if isinstance(s, ray.ObjectRef) else s)


@ray.remote(num_cpus=0)
class StoreActor:
    def __init__(self, max_staleness: int, stale_policy: str):
        self.store = PartialRolloutStore(max_staleness, stale_policy)

    async def put_partial(self, groups) -> None:
        self.store.put_partial(await _fetch(groups))

    async def put_complete(self, groups) -> None:
        self.store.put_complete(await _fetch(groups))

    async def take_complete(self):
        return self.store.take_complete()

    async def take_partial(self, max_groups: int, version: int):
        return self.store.take_partial(max_groups, version)

    async def size(self) -> int:
        return len(self.store)

    async def stats(self, version: int) -> dict:
        return self.store.stats(version)

    async def state_dict(self) -> dict:
        return self.store.state_dict()

    async def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state)
