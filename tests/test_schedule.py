"""The schedule registry's contract: each schedule's decisions pinned, chosen once by `rollout.schedule`."""
import pytest

from april_ray.config import ConfigError, RolloutConfig, load_config
from april_ray.rollout.over_sampling import build_over_sampling
from april_ray.schedule import SCHEDULES, April, Oversample, Sync, build_schedule

N, N_PRIME = 4, 8


def test_the_registry_holds_the_three_schedules_and_the_config_takes_its_choices_from_it():
    assert list(SCHEDULES) == ["april", "sync", "oversample"]
    assert [type(build_schedule(name)) for name in SCHEDULES] == [April, Sync, Oversample]
    assert all(build_schedule(name).name == name for name in SCHEDULES)
    for name in SCHEDULES:
        assert load_config(None, [f"rollout.schedule={name}"]).rollout.schedule == name


def test_an_unknown_schedule_is_refused_at_config_time_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.schedule: must be one of april, sync, oversample, got 'fifo'"):
        load_config(None, ["rollout.schedule=fifo"])


@pytest.mark.parametrize("name, at_start, mid_step, after_a_drop", [
    ("april", 8, 5, 6),       # N' - in flight, whatever is complete: the in-flight set topped back up to N'
    ("sync", 4, 0, 1),        # N - complete - in flight: only what the filter dropped is refilled
    ("oversample", 8, 0, 1),  # N' at the step's start, then as sync
])
def test_how_many_groups_each_schedule_starts(name, at_start, mid_step, after_a_drop):
    s = build_schedule(name)
    n_prime = N_PRIME if s.over_provisions else N
    assert s.num_to_start(N, n_prime, num_complete=0, num_incomplete=0, started=False) == at_start
    # mid-step: 1 complete, 3 finished and left (april: topped up to N' = 8 in flight, 3 in flight)
    assert s.num_to_start(N, n_prime, num_complete=1, num_incomplete=3, started=True) == mid_step
    # a group dropped by the filter: 1 complete, 2 in flight
    assert s.num_to_start(N, n_prime, num_complete=1, num_incomplete=2, started=True) == after_a_drop


@pytest.mark.parametrize("name, over_provisions, keeps_running, keeps_leftovers", [
    ("april", True, True, True),
    ("sync", False, False, True),
    ("oversample", True, False, False),
])
def test_what_each_schedule_does_at_the_nth_complete_group(name, over_provisions, keeps_running, keeps_leftovers):
    s = build_schedule(name)
    assert (s.over_provisions, s.keeps_running, s.keeps_leftovers) == (over_provisions, keeps_running, keeps_leftovers)


def test_n_prime_follows_whether_the_schedule_over_provisions():
    for name in SCHEDULES:
        rollout = RolloutConfig(rollout_batch_size=N, over_sampling_batch_size=N_PRIME, schedule=name)
        assert build_over_sampling(rollout).batch_size == (N_PRIME if build_schedule(name).over_provisions else N)


def test_each_schedules_own_config_rule_names_the_key():
    auto = RolloutConfig(over_sampling_batch_size="auto")
    assert build_schedule("april").config_error(auto) is None and build_schedule("sync").config_error(auto) is None
    assert build_schedule("oversample").config_error(auto).startswith("rollout.over_sampling_batch_size: auto")
    with pytest.raises(ConfigError, match=r"rollout\.over_sampling_batch_size: auto adapts APRIL's N'"):
        load_config(None, ["rollout.schedule=oversample", "rollout.over_sampling_batch_size=auto"])
    for name in ("sync", "oversample"):  # only a schedule that keeps running may overlap the learner
        with pytest.raises(ConfigError, match=f"train.overlap: .* needs rollout.schedule=april, got {name}"):
            load_config(None, [f"rollout.schedule={name}", "train.overlap=true", "placement.colocate=false"])
