"""PartialRolloutStore actor: a shell around `april_ray.rollout.store.PartialRolloutStore`.

Groups arrive with object refs in place of samples; the store fetches them itself, so the values live
here (and in checkpoints) and do not depend on the monitor that created the refs staying alive. Groups
leave the same way: one `ray.put` of their samples, and the monitor gets handles and metas, never the
tokens, which go from here to the engine (or the learner) that fetches them.
"""
from __future__ import annotations

import ray

from actors.metrics import StoreMetrics
from actors.refs import SampleRef, fetch
from april_ray.config import StalenessConfig
from april_ray.rollout.store import PartialRolloutStore, held, resolve_groups
from april_ray.types import Group, HeldGroup


def _fetch(groups):
    # One batched get, not an await per ref: a step stores ~250 samples. The actor is
    # synchronous for this: its calls come one at a time from the monitor anyway.
    values = iter(fetch([s for g in groups for s in g.samples]))
    return resolve_groups(groups, lambda _: next(values))


def _held(groups: list[Group]) -> list[HeldGroup]:
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return []
    ref, index = ray.put(samples), iter(range(len(samples)))
    return [held(g, [SampleRef(ref, next(index)) for _ in g.samples]) for g in groups]


@ray.remote(num_cpus=0)
class StoreActor:
    def __init__(self, staleness: StalenessConfig):
        self.store = PartialRolloutStore(max_versions=staleness.max_versions, policy=staleness.policy)
        self.metrics = StoreMetrics()

    def put_partial(self, groups) -> None:
        self.store.put_partial(_fetch(groups))

    def put_complete(self, groups) -> None:
        self.store.put_complete(_fetch(groups))

    def take_complete(self) -> list[HeldGroup]:
        return _held(self.store.take_complete())

    def take_partial(self, max_groups: int, version: int) -> list[HeldGroup]:
        return _held(self.store.take_partial(max_groups, version))

    def size(self) -> int:
        return len(self.store)

    def stats(self, version: int) -> dict:
        """The store's statistics at policy `version` (the driver asks once per step), also as metrics."""
        stats = self.store.stats(version)
        self.metrics.record(stats)
        return stats

    def state_dict(self) -> dict:
        return self.store.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state)
