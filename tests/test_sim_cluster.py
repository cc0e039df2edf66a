"""The real rollout on simulated engines (sim/cluster.py): the accounting invariant after every step, the
real filter, the schedules' utilization, the staleness mask, steps timed on the virtual clock."""
import pytest

from april_ray.config import RolloutConfig, StalenessConfig
from sim.clock import run_virtual
from sim.cluster import CONTROL_PLANE, Schedule, Setting, saturated
from sim.workload import LengthModel, Workload
from tests.test_sim_engine import FLAT


def small_setting(cost=FLAT, engines=2, lengths=None, block=1, max_len=400, staleness=None) -> Setting:
    lengths = lengths or LengthModel("lognormal", 40, 1.0, 0.5, seed=0)
    wl = Workload(lengths, [8] * 500, block, max_len)
    return Setting(wl, cost, engines, 16, 100_000, 4096, staleness or StalenessConfig(4, "keep"))


def rollout(n=4, factor=None, dynamic_filter=False):
    return RolloutConfig(rollout_batch_size=n, over_sampling_batch_size=n if factor is None else int(factor * n),
                         n_samples_per_prompt=4, schedule="april" if factor is not None else "sync", dynamic_filter=dynamic_filter)


@pytest.mark.parametrize("factor", [None, 1.0, 2.0])
def test_accounting_invariant_after_every_simulated_step(factor):
    async def main(loop):
        loop.clocked.add(CONTROL_PLANE)
        s = Schedule("x", small_setting(), rollout(factor=factor, dynamic_filter=True), loop)
        for step in range(10):
            await s.step(step, measured=True)  # asserts: taken = returned + dropped + stored
            assert sum(e.running.__len__() + len(e.waiting) for e in s.engines) == 0
        return s

    s = run_virtual(main)
    summary = s.summary(1.0)
    assert summary["duplicated_samples"] == 0 and summary["samples_with_wrong_length"] == 0
    assert s.monitor.num_returned_groups == 40 and s.monitor.num_dropped_groups == 0
    if factor:
        assert summary["off_policy_token_ratio"] > 0 and s.store.partial


def test_a_filtered_share_of_prompts_is_dropped_by_the_real_filter_and_refilled():
    async def main(loop):
        wl = Workload(LengthModel("lognormal", 20, 0.5, 0.5, 0), [8] * 500, 1, 200, filtered_fraction=0.3)
        setting = Setting(wl, FLAT, 2, 16, 100_000, 4096, StalenessConfig(4, "keep"))
        s = Schedule("x", setting, rollout(factor=2.0, dynamic_filter=True), loop)
        for step in range(6):
            await s.step(step, measured=True)
        return s

    s = run_virtual(main)
    assert s.monitor.num_returned_groups == 24 and s.monitor.num_dropped_groups > 0


def test_flat_step_cost_leaves_sync_far_below_april():
    """A step that costs the same at any batch (a GPU bound by its weights): the draining synchronous
    batch wastes most of it, APRIL keeps it full."""

    def util(factor):
        async def main(loop):
            setting = small_setting(engines=1, lengths=LengthModel("lognormal", 40, 1.0, 0.5, seed=1))
            ceiling = await saturated(setting, loop, 4)
            s = Schedule("x", setting, rollout(n=4, factor=factor), loop)
            await s.run(8, 3)
            return s.summary(ceiling)["utilization"]

        return run_virtual(main)

    sync, april = util(None), util(2.0)
    assert sync < 0.45 and april > sync + 0.25


def test_sixty_virtual_seconds_of_rollout_run_on_the_virtual_clock():
    """A minute of APRIL rollout on the virtual clock: the steps' walls add up to the clock's time (no step
    waited for real), and every step's accounting holds (`Schedule.step` asserts it)."""
    async def main(loop):
        s = Schedule("x", small_setting(), rollout(factor=2.0), loop)
        while loop.time() < 60.0:
            await s.step(len(s.records), measured=True)
        return s, loop.time()

    s, now = run_virtual(main)
    assert now >= 60.0 and len(s.records) >= 3
    assert sum(r.wall_s for r in s.records) == pytest.approx(now, rel=1e-6)
    assert s.summary(1.0)["duplicated_samples"] == s.summary(1.0)["samples_with_wrong_length"] == 0


def test_tokens_the_learners_staleness_mask_drops_do_not_count_as_throughput():
    """Under staleness.policy mask, tokens older than max_versions reach the learner and are masked out of
    the loss: the simulated throughput leaves them out (`unmasked_*`); under keep every token counts."""
    def summary(policy):
        async def main(loop):
            s = Schedule("x", small_setting(staleness=StalenessConfig(1, policy)), rollout(factor=3.0), loop)
            await s.run(8, 2)
            return s.summary(1.0)

        return run_virtual(main)

    masked, kept = summary("mask"), summary("keep")
    assert kept["masked_token_ratio"] == 0 and kept["unmasked_tok_s"] == kept["effective_tok_s"]
    ages = {int(a): share for a, share in masked["staleness_hist"].items()}
    assert masked["masked_token_ratio"] > 0
    assert masked["masked_token_ratio"] == pytest.approx(sum(v for a, v in ages.items() if a > 1), abs=1e-3)
    assert masked["unmasked_tok_s"] == pytest.approx(masked["effective_tok_s"] * (1 - masked["masked_token_ratio"]))


def test_a_step_served_whole_from_the_stores_surplus_is_timed_on_the_virtual_clock():
    """Short responses and N'/N = 4: some steps find N complete groups in the store and dispatch nothing;
    on the virtual clock such a step lasts the monitor's CPU (no division by a zero wall)."""
    async def main(loop):
        loop.clocked.add(CONTROL_PLANE)
        lengths = LengthModel("histogram", 1, 1.0, 0.0, seed=0, histogram=[2, 3, 4])
        s = Schedule("x", small_setting(lengths=lengths), rollout(n=2, factor=4.0), loop)
        await s.run(6, 0)
        return s, loop.time()

    s, now = run_virtual(main)
    assert any(r.generated == 0 for r in s.records)  # served from the surplus
    assert all(r.wall_s > 0 for r in s.records) and sum(r.wall_s for r in s.records) == pytest.approx(now)
