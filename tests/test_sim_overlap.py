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


def test_with_a_free_learner_the_overlapped_mode_is_its_engines_alone(small):
    """Learner and weight sync cost nothing: the learner never holds the engines up, no pause is charged,
    and the overlapped speedup over a rollout-only sync is the ratio of their utilizations times the
    engines' share of the GPUs."""
    from jobs.simulate import overlap_figures, run_overlap, run_one
    from sim import study

    cfg, sim, ceiling = small
    setting = study.gpu_setting(cfg, sim, 6)
    n = study.batch_for(cfg, 8)
    rollout = study.rollout_for(cfg, n, 2.0, "april")
    from sim.overlap import run_overlap as raw

    out = raw(setting, rollout, n, rollout.over_sampling_batch_size, 4, 1, 0.0, 0.0, ceiling)
    assert out["learner_busy_fraction"] == 0 and out["pause_factor"] == 1.0
    assert out["tok_s"] == pytest.approx(out["utilization"] * ceiling * setting.workload.block * 6)
    assert out["admission_held_call_s"] == 0  # a learner that takes each batch at once never closes admission
    assert 0 < out["utilization"] <= 1.05 and out["masked_token_ratio"] == 0
    sync = run_one(cfg, sim, 8, None, "sync", ceiling)
    e2e_sync = study.end_to_end_tok_s(sync["unmasked_tok_s"], sync["rollout_s"], 0.0, 0.0)
    figures = overlap_figures([out | {"engines": 6, "learner": 2, "sim_cpu_s": 0.0}], e2e_sync)
    assert figures["overlap_end_to_end_speedup"] == pytest.approx(
        out["utilization"] * 6 / (sync["unmasked_utilization"] * 8))
    # with the learner's real cost on 2 GPUs it is slower, never faster
    slow = run_overlap(cfg, sim, 8, 6, 2.0, ceiling)
    assert 0 < slow["tok_s"] < out["tok_s"] and 0 < slow["learner_busy_fraction"] <= 1


def test_the_best_split_is_the_one_with_the_most_trained_tokens_per_second():
    from jobs.simulate import overlap_figures

    parts = {"utilization": 0.5, "learner_busy_fraction": 0.5, "period_s": 10.0, "pause_factor": 1.0,
             "masked_token_ratio": 0.0, "off_policy_token_ratio": 0.5, "staleness_hist": {}, "sim_cpu_s": 0.0}
    splits = [parts | {"engines": e, "learner": 8 - e, "tok_s": t} for e, t in [(4, 300.0), (6, 500.0), (7, 400.0)]]
    out = overlap_figures(splits, 200.0)
    assert out["overlap_split"] == {"engines": 6, "learner": 2} and out["overlap_end_to_end_speedup"] == 2.5
    assert [s["end_to_end_speedup"] for s in out["overlap_splits"]] == [1.5, 2.5, 2.0]
    assert overlap_figures([], 200.0) == {"overlap_splits": []}
