"""The adaptive N' (`rollout.over_sampling_batch_size=auto`, april_ray/rollout/over_sampling.py): the rule on
synthetic observations, its config, and the production monitor on the simulator against fixed factors."""
import json

import pytest

from april_ray.config import ConfigError, RolloutConfig, StalenessConfig, load_config
from april_ray.rollout.over_sampling import AdaptiveOverSampling, FixedOverSampling, build_over_sampling
from sim.calibrate import cpu_step_cost
from sim.clock import run_virtual
from sim.cluster import Schedule, Setting, saturated
from sim.workload import LengthModel, Workload


def auto(n=8, max_factor=4.0) -> AdaptiveOverSampling:
    return build_over_sampling(RolloutConfig(rollout_batch_size=n, over_sampling_batch_size="auto",
                                             over_sampling_max_factor=max_factor))


def test_idle_slots_raise_n_prime_and_a_queue_lowers_it():
    idle, queued = auto(), auto()
    idle.observe(occupancy=0.6, masked_share=0.0)
    queued.observe(occupancy=2.4, masked_share=0.0)
    assert idle.factor > 1.5 > queued.factor
    assert idle.batch_size > 12 > queued.batch_size


def test_masked_tokens_lower_n_prime_even_with_idle_slots():
    c = auto()
    c.observe(occupancy=0.6, masked_share=0.1)
    assert c.factor == pytest.approx(1.5 * AdaptiveOverSampling.STEP_DOWN)


def test_after_masked_tokens_n_prime_climbs_back_a_step_at_a_time():
    c = auto(max_factor=8.0)
    c.observe(occupancy=0.2 * c.factor, masked_share=0.0)  # a fifth of the slots held per unit of N'/N
    assert c.factor == pytest.approx(6.0)  # what the occupancy alone asks for: 1.2 / 0.2
    c.observe(occupancy=0.2 * c.factor, masked_share=0.2)
    low = c.factor
    assert low == pytest.approx(6.0 * AdaptiveOverSampling.STEP_DOWN)
    for k in range(1, 4):  # still idle slots, and no masked tokens
        c.observe(occupancy=0.2 * c.factor, masked_share=0.0)
        assert c.factor == pytest.approx(min(6.0, low + k * AdaptiveOverSampling.STEP_UP))


def test_n_prime_stays_within_n_and_the_max_factor():
    c = auto(n=8, max_factor=3.0)
    for _ in range(50):
        c.observe(occupancy=0.01, masked_share=0.0)
    assert c.factor == 3.0 and c.batch_size == 24
    for _ in range(50):
        c.observe(occupancy=0.5, masked_share=0.5)
    assert c.factor == 1.0 and c.batch_size == 8


def test_the_rule_is_deterministic_and_its_state_goes_through_json():
    steps = [(0.7, 0.0), (1.4, 0.0), (1.1, 0.02), (0.9, 0.0), (1.3, 0.0)]
    a, b = auto(), auto()
    for occ, masked in steps[:3]:
        a.observe(occ, masked)
        b.observe(occ, masked)
    resumed = auto()
    resumed.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for occ, masked in steps[3:]:
        a.observe(occ, masked)
        b.observe(occ, masked)
        resumed.observe(occ, masked)
    assert a.factor == b.factor == resumed.factor


def test_a_state_saved_without_a_ceiling_loads_with_the_ceiling_open():
    c = auto(max_factor=3.0)
    c.load_state_dict({"factor": 2.0, "occupancy_per_factor": 0.5})
    assert c.factor == 2.0 and c.ceiling == 3.0


def test_the_config_takes_an_integer_or_auto_and_names_the_key():
    assert load_config(None, ["rollout.over_sampling_batch_size=auto"]).rollout.over_sampling_batch_size == "auto"
    fixed = build_over_sampling(load_config(None, ["rollout.over_sampling_batch_size=24"]).rollout)
    assert isinstance(fixed, FixedOverSampling) and fixed.batch_size == 24 and fixed.factor == 1.5
    sync = build_over_sampling(load_config(None, ["rollout.schedule=sync",
                                                  "rollout.over_sampling_batch_size=auto"]).rollout)
    assert sync.batch_size == 16
    with pytest.raises(ConfigError, match=r"rollout.over_sampling: no longer a key; use "
                                          r"rollout.over_sampling_batch_size \(an integer N', or auto\)"):
        load_config(None, ["rollout.over_sampling=2"])
    with pytest.raises(ConfigError, match="rollout.over_sampling_batch_size: must be an integer"):
        load_config(None, ["rollout.over_sampling_batch_size=more"])
    with pytest.raises(ConfigError, match="auto adapts APRIL's N'"):
        load_config(None, ["rollout.schedule=oversample", "rollout.over_sampling_batch_size=auto"])


# One CPU engine as jobs/bench/schedule.py runs one of tiny_cpu.yaml's two: N = 8 groups of 8 samples, 64
# slots, parked caches reused up to the bound, staleness.max_versions=4 masked; step costs fitted on that
# bench (docs/benchmarks/bench_schedule.json, step_costs.fit). Lengths in tokens: the countdown task's
# median (6 terms of 5 tokens, and EOS) and its two families, and configs/tiny_cpu_longtail.yaml's tail
# (sigma 1.8, capped at 2,016 tokens); the samples of one prompt correlate as the tiny model's measured
# lengths do (0.74 in log space, docs/benchmarks/simulate_cpu.json's by_row).
FIT = {"a": 0.00169, "b": 4.56e-05, "c": 3.3e-07, "prefill_per_token": 2.65e-05, "prefill_per_step": 0.00036,
       "per_admitted": 0.0, "per_restored_token": 2.45e-06, "per_attended": 3.4e-07}
FACTORS = (1, 1.5, 2, 3)


def bench_setting(family: str) -> Setting:
    if family == "longtail":
        lengths, budget = LengthModel("lognormal", 31, 1.8, 0.75, seed=0), 2016
    else:
        lengths, budget = LengthModel(family, 31, 1.0, 0.75, seed=0, alpha=1.2), 512
    return Setting(Workload(lengths, [8] * 20000, 1, budget), cpu_step_cost(FIT), 1, 64, 64 * (budget + 128),
                   8192, StalenessConfig(4, "mask"), park_slots=128, max_versions=4)


def simulate(setting: Setting, n_prime, ceiling: float) -> dict:
    async def main(loop):
        rollout = RolloutConfig(rollout_batch_size=8, over_sampling_batch_size=n_prime, n_samples_per_prompt=8)
        s = Schedule("april", setting, rollout, loop)
        await s.run(60, 3)
        return s.summary(ceiling) | {"factor": s.monitor.over_sampling.factor}

    return run_virtual(main)


@pytest.mark.parametrize("family", ["lognormal", "pareto", "longtail"])
def test_auto_is_as_fast_as_the_best_fixed_factor_and_masks_no_more(family):
    """Virtual time: deterministic, whatever the machine's load."""
    setting = bench_setting(family)
    ceiling = run_virtual(lambda loop: saturated(setting, loop, 8))
    fixed = {f: simulate(setting, round(8 * f), ceiling) for f in FACTORS}
    best = max(FACTORS, key=lambda f: fixed[f]["utilization"])
    got = simulate(setting, "auto", ceiling)
    assert got["utilization"] >= fixed[best]["utilization"] - 0.02
    assert got["masked_token_ratio"] <= fixed[best]["masked_token_ratio"]
    assert 1.0 <= got["factor"] <= 4.0
