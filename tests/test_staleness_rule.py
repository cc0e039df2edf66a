"""One staleness rule: the store's restarts, the learner's loss mask and the engine's KV reuse all follow
`StalenessConfig` (april_ray/config.py), age by age around the bound, under each policy."""
import pytest
import torch

from april_ray.config import StalenessConfig
from april_ray.engine.scheduler import ParkedKV
from april_ray.learn.algorithms import off_policy_weights
from april_ray.learn.corrections import TruncatedIS
from april_ray.rollout.store import PartialRolloutStore
from april_ray.types import Group, Sample, SampleState

BOUND, VERSION = 2, 10
AGES = range(0, 5)


def stored(age: int) -> Group:
    s = Sample(f"g{age}/0", f"g{age}", "p", "a", [1], 100, response_ids=[7, 7], logprobs=[0.0, 0.0],
               versions=[VERSION - age, VERSION], state=SampleState.PARTIAL)
    return Group(f"g{age}", age, [s])


@pytest.mark.parametrize("policy", ["mask", "restart", "keep"])
def test_the_store_and_the_learner_ask_the_one_rule(policy):
    staleness = StalenessConfig(max_versions=BOUND, policy=policy)
    store = PartialRolloutStore(staleness)
    store.put_partial([stored(age) for age in AGES])
    restarted = [g.samples[0].state == SampleState.QUEUED for g in store.take_partial(len(AGES), VERSION)]
    assert restarted == [staleness.restarts(age) for age in AGES]
    assert restarted == [policy == "restart" and age > BOUND for age in AGES]

    versions = torch.tensor([[VERSION - age for age in AGES]])
    mask = torch.ones(1, len(AGES))
    _, keep, _ = off_policy_weights(mask, mask, versions, VERSION, mask, correction=TruncatedIS(2.0),
                                    staleness=staleness)
    assert keep[0].bool().tolist() == [bool(staleness.trains(age)) for age in AGES]
    assert keep[0].bool().tolist() == [policy == "keep" or age <= BOUND for age in AGES]


@pytest.mark.parametrize("reuse_stale_kv", [False, True])
def test_a_parked_kv_cache_is_reused_within_the_bound_the_config_gives(reuse_stale_kv):
    staleness = StalenessConfig(max_versions=BOUND, policy="mask")
    bound = staleness.kv_max_versions(reuse_stale_kv)
    assert bound == (BOUND if reuse_stale_kv else 0)
    for age in AGES:
        parked = ParkedKV(first_slot=0, num_slots=1, max_versions=bound)
        parked.park([1, 2, 3], version=VERSION - age)
        assert (parked.usable([1, 2, 3], VERSION) is not None) == (age <= bound)
