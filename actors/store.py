"""PartialRolloutStore actor: a shell around `april_ray.rollout.store.PartialRolloutStore`.

Groups arrive with object refs in place of samples; the store fetches them itself, so the values live
here (and in checkpoints) and do not depend on the monitor that created the refs staying alive. Groups
leave as two returns of one call (`take_complete`, `take_partial`): the metas with each sample's index,
and the list of the samples, which the monitor holds as a handle and never fetches; the tokens go from
here to the engine (or the learner) that fetches them. The caller owns a call's returns, so the driver
and the learner ranks borrow those samples from the monitor, as they do an engine call's; samples the
store put itself would have the store as their owner, and Ray can free an object whose owner's last
reference goes while a borrower of a borrower (the learner, through the monitor and the driver) still
needs it.
"""
from __future__ import annotations

from dataclasses import replace

import ray

from actors.metrics import StoreMetrics
from actors.refs import SampleRef, fetch
from april_ray.config import StalenessConfig
from april_ray.rollout.store import PartialRolloutStore, held, resolve_groups
from april_ray.types import Group, HeldGroup


def _fetch(groups, reward_errors: dict | None = None):
    # One batched get, not an await per ref: a step stores ~250 samples. The actor is
    # synchronous for this: its calls come one at a time from the monitor anyway.
    values = iter(fetch([s for g in groups for s in g.samples]))
    return resolve_groups(groups, lambda _: next(values), reward_errors)


def _held(groups: list[Group]) -> tuple[list[HeldGroup], list]:
    """(each group with its samples' indices in the list as handles, the list of its samples)."""
    samples = [s for g in groups for s in g.samples]
    index = iter(range(len(samples)))
    return [held(g, [next(index) for _ in g.samples]) for g in groups], samples


def with_refs(groups: list[HeldGroup], samples_ref) -> list[HeldGroup]:
    """Groups from `take_complete`/`take_partial`, their indices made handles into the samples' return."""
    return [replace(g, handles=[SampleRef(samples_ref, i) for i in g.handles]) for g in groups]


@ray.remote(num_cpus=0)
class StoreActor:
    def __init__(self, staleness: StalenessConfig):
        self.store = PartialRolloutStore(staleness)
        self.metrics = StoreMetrics()

    def put_partial(self, groups, reward_errors: dict | None = None) -> None:
        """`reward_errors`: by sample id, each finished sample's from its meta (kept with the sample)."""
        self.store.put_partial(_fetch(groups, reward_errors))

    def put_complete(self, groups, reward_errors: dict | None = None) -> None:
        self.store.put_complete(_fetch(groups, reward_errors))

    @ray.method(num_returns=2)
    def take_complete(self) -> tuple[list[HeldGroup], list]:
        return _held(self.store.take_complete())

    @ray.method(num_returns=2)
    def take_partial(self, max_groups: int, version: int) -> tuple[list[HeldGroup], list]:
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
