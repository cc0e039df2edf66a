"""The overlapped mode's prediction (sim/overlap.py and its figures in `jobs.simulate`'s rows): the splits
evaluated, the learner on the virtual clock, and the end-to-end speedups built from their parts."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    """Qwen3-4B on 8 H100s with short responses: a run of a few batches costs a fraction of a second."""
    from april_ray.config import load_config
    from sim import study
    from sim.config import load_simulate_config

    cfg = load_config(str(ROOT / "configs/qwen3_4b_dapo.yaml"), ["sampling.max_response_len=2048"])
    sim = load_simulate_config(["simulate.steps=3", "simulate.warmup_steps=1", "simulate.length_median=300"])
    ceiling = study.ceiling_of(study.gpu_setting(cfg, sim, 8), cfg.rollout.n_samples_per_prompt)
    return cfg, sim, ceiling


def test_the_splits_give_the_learner_a_halving_share_in_whole_engines():
    from sim.overlap import splits

    assert [(s["engines"], s["learner"]) for s in splits(8)] == [(4, 4), (5, 3), (6, 2), (7, 1)]
    assert [s["learner"] for s in splits(64)] == [32, 24, 16, 12, 8, 4]
    assert splits(8, gpus_per_engine=2) == [{"engines": 4, "learner": 4}, {"engines": 6, "learner": 2}]
    assert splits(1) == [] and all(s["engines"] + s["learner"] == 64 for s in splits(64))


def test_the_steps_asked_ahead_are_those_of_the_job():
    """As RolloutGroup.batch: before step k's batch is waited for, steps k + 1 .. k + train.overlap_ahead,
    none past the last (the one that drains)."""
    from april_ray.config import load_config
    from driver.rollout import asked_ahead as asked_by_the_job
    from sim.overlap import asked_ahead

    assert asked_ahead(0, 9) == [1] and asked_ahead(8, 9) == [9] and asked_ahead(9, 9) == []
    assert asked_ahead(0, 9, 3) == [1, 2, 3] and asked_ahead(7, 9, 3) == [8, 9] and asked_ahead(9, 9, 3) == []
    for ahead in (1, 2, 3):
        train = load_config(None, ["train.overlap=true", "train.num_steps=10", f"train.overlap_ahead={ahead}"]).train
        assert all(asked_ahead(k, 9, ahead) == asked_by_the_job(train, k) for k in range(10))


@pytest.fixture(scope="module")
def free_and_real(small):
    """6 engines of an 8-GPU job, 6 learner steps after 1 warm-up: with a learner that costs nothing, and
    with the learner's and the weight sync's modelled cost on the other 2 GPUs."""
    from sim import study
    from sim.overlap import run_overlap

    cfg, sim, ceiling = small
    setting = study.gpu_setting(cfg, sim, 6)
    n = study.batch_for(cfg, 8)
    rollout = study.rollout_for(cfg, n, 2.0, "april")
    free = run_overlap(setting, rollout, n, rollout.over_sampling_batch_size, 6, 1, 0.0, 0.0, ceiling)
    real = run_overlap(setting, rollout, n, rollout.over_sampling_batch_size, 6, 1,
                       study.learner_s_on(cfg, sim, 2, 1.0), study.weight_sync_s(cfg, sim), ceiling)
    return setting, free, real


@pytest.fixture(scope="module")
def two_ahead(small, free_and_real):
    """free_and_real's slow learner with the engines allowed two batches ahead (train.overlap_ahead=2)."""
    from sim import study
    from sim.overlap import run_overlap

    cfg, sim, ceiling = small
    setting = free_and_real[0]
    n = study.batch_for(cfg, 8)
    rollout = study.rollout_for(cfg, n, 2.0, "april")
    return run_overlap(setting, rollout, n, rollout.over_sampling_batch_size, 6, 1,
                       study.learner_s_on(cfg, sim, 2, 1.0), study.weight_sync_s(cfg, sim), ceiling, ahead=2)


def test_two_batches_ahead_the_engines_stop_less_and_their_tokens_age_more(free_and_real, two_ahead):
    """Two steps asked ahead of a slow learner: nothing is lost or trained twice, the step at the look-ahead's
    end is reached (and interrupted) less often, and the batches' tokens are older on average."""
    real = free_and_real[2]
    assert two_ahead["lost_groups"] == 0 and two_ahead["duplicated_samples"] == 0
    assert two_ahead["samples_with_wrong_length"] == 0
    assert 1 <= two_ahead["aborts"] < real["aborts"]
    assert two_ahead["staleness_mean"] > real["staleness_mean"]
    assert two_ahead["learner_busy_fraction"] == pytest.approx(1.0)


def test_kept_steps_never_abort_and_lose_nothing(free_and_real):
    """With a learner that never holds the engines back only the last step, which drains, aborts (a step at
    the look-ahead's end may too, when the learner is slower); every group is accounted for after it, no
    sample is trained twice and each has the tokens it was drawn to end with."""
    assert free_and_real[1]["aborts"] == 1
    for out in free_and_real[1:]:
        assert out["aborts"] >= 1 and out["lost_groups"] == 0
        assert out["duplicated_samples"] == 0 and out["samples_with_wrong_length"] == 0


def test_with_a_free_learner_the_overlapped_mode_is_its_engines_alone(small, free_and_real):
    """Learner and weight sync cost nothing: no pause is charged, the engines never wait for the learner,
    and the overlapped speedup over a rollout-only sync is the ratio of their utilizations times the
    engines' share of the GPUs."""
    from jobs.simulate import overlap_figures, run_one
    from sim import study

    cfg, sim, ceiling = small
    setting, out, _ = free_and_real
    assert out["learner_busy_fraction"] < 1e-3 and out["pause_factor"] == 1.0
    assert out["engine_busy_fraction"] > 0.95  # never held back: the learner takes each batch at once
    assert out["tok_s"] == pytest.approx(out["utilization"] * ceiling * setting.workload.block * 6)
    assert 0 < out["utilization"] <= 1.05 and out["masked_token_ratio"] == 0
    assert out["staleness_max"] <= cfg.staleness.max_versions
    sync = run_one(cfg, sim, 8, None, "sync", ceiling)
    e2e_sync = study.end_to_end_tok_s(sync["unmasked_tok_s"], sync["rollout_s"], 0.0, 0.0)
    figures = overlap_figures([out | {"engines": 6, "learner": 2, "sim_cpu_s": 0.0}], e2e_sync)
    assert figures["overlap_end_to_end_speedup"] == pytest.approx(
        out["utilization"] * 6 / (sync["unmasked_utilization"] * 8))


def test_a_slow_learner_holds_the_engines_one_batch_ahead_and_ages_their_tokens(small, free_and_real):
    """The learner on 2 GPUs is slower than 6 engines: it is always busy, batches wait for it, the engines
    idle once they are one batch ahead, and the tokens of groups spilling into later steps age up to the
    bound and past it (masked)."""
    cfg, _, _ = small
    _, free, real = free_and_real
    assert real["learner_busy_fraction"] == pytest.approx(1.0) and real["pause_factor"] == 1.0
    assert 0 < real["tok_s"] < free["tok_s"] and real["engine_busy_fraction"] < free["engine_busy_fraction"]
    assert free["batches_waiting_mean"] == 0 < real["batches_waiting_mean"]  # the rollout ran ahead of it
    assert real["staleness_mean"] > free["staleness_mean"] and real["staleness_max"] > cfg.staleness.max_versions
    assert 0 < real["masked_token_ratio"] < 0.5 and real["off_policy_token_ratio"] == 1.0


def test_the_best_split_is_the_one_with_the_most_trained_tokens_per_second():
    from jobs.simulate import overlap_figures

    parts = {"utilization": 0.5, "learner_busy_fraction": 0.5, "period_s": 10.0, "pause_factor": 1.0,
             "masked_token_ratio": 0.0, "off_policy_token_ratio": 0.5, "staleness_hist": {}, "sim_cpu_s": 0.0,
             "staleness_mean": 0.5, "staleness_max": 1, "engine_busy_fraction": 1.0, "batches_waiting_mean": 0.0}
    splits = [parts | {"engines": e, "learner": 8 - e, "tok_s": t} for e, t in [(4, 300.0), (6, 500.0), (7, 400.0)]]
    out = overlap_figures(splits, 200.0)
    assert out["overlap_split"] == {"engines": 6, "learner": 2} and out["overlap_end_to_end_speedup"] == 2.5
    assert [s["end_to_end_speedup"] for s in out["overlap_splits"]] == [1.5, 2.5, 2.0]
    assert overlap_figures([], 200.0) == {"overlap_splits": []}
