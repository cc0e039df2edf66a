"""The training benchmark's report: hand-made runs through `report`, and the JSON keys of a tiny real run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from april_ray.config import load_config
from jobs.bench.grid import grid_configs, grid_report, grid_table, mismatch_record, parse_grid
from jobs.bench.train import (accuracy_at, configured_factor, late_accuracy, mode_configs, parse_modes, report,
                              reused_runs, table, time_to)
from tests.conftest import USER_ENV
from tests.prefetch import shared_job

ROOT = Path(__file__).resolve().parents[1]


def record(history, steps=20, final=None, off_policy=0.0):
    return {"history": history, "eval_steps": [0, 10, 20][: len(history)], "train_s": history[-1][0],
            "steps": steps, "accuracy_before": history[0][1], "final_accuracy": final or history[-1][1],
            "final_accuracy_greedy": 0.5, "greedy_history": [], "off_policy_token_ratio": off_policy,
            "staleness_mean": off_policy, "staleness_max": 2 if off_policy else 0,
            "staleness_hist": {"0": 1 - off_policy, "1": off_policy},
            "phase_s_per_step": {"rollout_s": 1.0, "learner_s": 1.0, "weight_sync_s": 0.1},
            "rollout_share": 0.5 + off_policy}


def test_report_by_hand():
    runs = {"sync": [record([(0, 0.3), (50, 0.36), (100, 0.41)]), record([(0, 0.3), (60, 0.33), (120, 0.34)]),
                     record([(0, 0.3), (55, 0.40), (110, 0.42)])],
            "april": [record([(0, 0.3), (30, 0.37), (70, 0.40)], off_policy=0.4),
                      record([(0, 0.3), (40, 0.36), (80, 0.42)], off_policy=0.2),
                      record([(0, 0.3), (35, 0.34), (75, 0.39)], off_policy=0.3)]}
    r = report([0, 1, 2], 0.35, 2048, runs, [50, 55])
    # sync: 50, never (its whole wall 120), 55 -> median 55; APRIL: 30, 40, 75 -> median 40
    assert r["sync"]["time_to_target_s"] == [50, 120, 55] and r["sync"]["time_to_target_median_s"] == 55
    assert r["sync"]["reached_target"] == [True, False, True]
    assert r["april"]["time_to_target_s"] == [30, 40, 75] and r["april"]["time_to_target_median_s"] == 40
    assert r["speedup"] == pytest.approx(55 / 40)
    assert r["april"]["final_accuracy"] == [0.40, 0.42, 0.39] and r["april"]["final_accuracy_median"] == 0.40
    assert r["eval_standard_error"] == pytest.approx((0.35 * 0.65 / 2048) ** 0.5)
    # at 50 s: sync 0.36, 0.3, 0.3 -> 0.3; at 55 s: 0.36, 0.3, 0.40 -> 0.36
    assert r["sync"]["accuracy_at_budget"]["50"]["median"] == pytest.approx(0.3)
    assert r["sync"]["accuracy_at_budget"]["55"]["median"] == pytest.approx(0.36)
    assert r["april"]["accuracy_by_step"] == {"0": 0.3, "10": 0.36, "20": 0.40}
    assert r["april"]["off_policy_token_ratio"]["median"] == pytest.approx(0.3)
    assert r["april"]["rollout_share"]["median"] == pytest.approx(0.8) and r["sync"]["rollout_share"]["max"] == 0.5
    assert r["april"]["staleness_hist"]["1"] == pytest.approx(0.3)
    assert time_to([(0, 0.1), (5, 0.2)], 0.3) is None and accuracy_at([(0, 0.1), (5, 0.2)], 4.9) == 0.1
    assert r["april"]["late_accuracy"] == [0.40, 0.42, 0.39] and r["april"]["late_accuracy_median"] == 0.40


def test_late_accuracy_averages_the_last_third_of_the_run_one_step_at_a_time():
    # 60 steps, evaluated every 10 and once more at the end: steps 40, 50 and 60 (its two evaluations
    # averaged first) count, each step once
    rec = {"steps": 60, "eval_steps": [0, 10, 20, 30, 40, 50, 60, 60],
           "history": [(0, 0.1), (1, 0.5), (2, 0.5), (3, 0.5), (4, 0.20), (5, 0.26), (6, 0.30), (6, 0.20)]}
    assert late_accuracy(rec) == pytest.approx((0.20 + 0.26 + 0.25) / 3)
    assert late_accuracy({"steps": 3, "eval_steps": [0, 3], "history": [(0, 0.1), (1, 0.4)]}) == 0.4


def test_factors_name_their_modes_and_auto_is_one_of_them():
    cfg = load_config(None, ["rollout.rollout_batch_size=16", "rollout.over_sampling_batch_size=24"])
    modes = mode_configs(cfg, [1.5, 2, "auto"])
    assert list(modes) == ["sync", "april", "april_2", "april_auto"]  # 1.5 is `april` as configured
    assert modes["april_auto"].rollout.over_sampling_batch_size == "auto"
    assert configured_factor(cfg, [1.5, "auto"]) == "april_1.5"
    auto = load_config(None, ["rollout.over_sampling_batch_size=auto"])
    assert configured_factor(auto, [1.5, "auto"]) == "april_auto" and "april_auto" not in mode_configs(auto, ["auto"])


def test_reuse_takes_runs_by_mode_and_seed_and_refuses_another_config(tmp_path):
    runs = {"sync": [record([(0, 0.3), (50, 0.36)]), record([(0, 0.3), (60, 0.33)])],
            "april": [record([(0, 0.3), (30, 0.37)]), record([(0, 0.3), (40, 0.36)])]}
    config = {"train": {"num_steps": 60}, "task": {"num_eval": 2048}}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(report([3, 4], 0.35, 2048, runs, [50]) | {"config": config}))
    reused = reused_runs(str(earlier), config)
    assert set(reused) == {("sync", 3), ("sync", 4), ("april", 3), ("april", 4)}
    assert reused["april", 4]["history"] == [[0, 0.3], [40, 0.36]]
    with pytest.raises(SystemExit, match=r"train\.num_steps: 60 there, 40 here"):
        reused_runs(str(earlier), {"train": {"num_steps": 40}, "task": {"num_eval": 2048}})
    # several results: another seed's, and a cell run at one seed only, each by its own seeds
    other = tmp_path / "other.json"
    other.write_text(json.dumps(report([5], 0.35, 2048, {"sync": runs["sync"][:1], "april": runs["april"][1:]}, [50])
                                | {"config": config}))
    cell = tmp_path / "cell.json"
    cell.write_text(json.dumps(report([4], 0.35, 2048, {"overlap_2_tis": runs["april"][:1]}, [50]) | {"config": config}))
    both = reused_runs([str(earlier), str(other), str(cell)], config)
    assert set(both) == set(reused) | {("sync", 5), ("april", 5), ("overlap_2_tis", 4)}
    assert both["april", 5]["history"] == [[0, 0.3], [40, 0.36]] and both["overlap_2_tis", 4]["history"][1] == [30, 0.37]
    with pytest.raises(SystemExit, match=r"sync seed 3 is in both .*earlier\.json and .*earlier\.json"):
        reused_runs([str(earlier), str(earlier)], config)


@shared_job(runs=2)
def bench_train_run(tmp_path_factory, model_dir):
    """Two jobs of two steps (sync and APRIL, one seed), each starting its actors: the report's lists over
    seeds and their medians are checked by hand above; here the keys of a real run, and its seed numbered
    from --first-seed."""
    tmp = tmp_path_factory.mktemp("bench-train")
    out = tmp / "bench.json"
    cmd = [sys.executable, "-m", "jobs.bench.train", "--config", "configs/tiny_cpu.yaml", "--seeds", "1",
           "--first-seed", "1", "--factors", "2", "--gain", "0.0", "--json", str(out), f"model.path={model_dir}",
           f"model.cache_dir={tmp}", f"train.output_dir={tmp}/out", "task.num_train=300",
           "task.num_eval=16", "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8",
           "rollout.n_samples_per_prompt=4", "sampling.max_response_len=24", "engine.max_model_len=64",
           "algorithm.overlong_buffer=8", "train.num_steps=2", "train.eval_every=1", "train.save_every=100",
           "train.eval_greedy=false", "logging.wandb_mode=disabled", "logging.dashboard=false",
           # the report's keys do not depend on the learner's backend or the number of engines: the fewest
           # processes to start, twice over
           "learner.backend=torch", "engine.num_engines=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                          timeout=1200)
    return proc, out


@pytest.mark.slow
@pytest.mark.timeout(1200)  # when its job was not started ahead, it runs in this test's setup
def test_bench_train_json_keys_on_a_tiny_run(bench_train_run):
    proc, out = bench_train_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["seeds"] == [1] and {"target_accuracy", "speedup", "speedup_2"} <= set(r)
    for mode in ("sync", "april", "april_2"):
        m = r[mode]
        assert len(m["time_to_target_s"]) == 1 and len(m["final_accuracy"]) == 1, mode
        assert {"time_to_target_median_s", "final_accuracy_median", "accuracy_at_budget", "accuracy_by_step",
                "off_policy_token_ratio", "staleness_hist", "phase_s_per_step", "rollout_share",
                "late_accuracy"} <= set(m), mode
        assert 0 < m["rollout_share"]["median"] < 1, mode
        assert list(m["accuracy_by_step"]) == ["0", "1", "2"]
    assert r["april_2"] == r["april"]  # N'/N = 2 is the configured 8 / 4: the same runs, not run twice
    mismatch = r["april"]["runs"][0]["mismatch"]  # the learner's mismatch/ keys reach the record
    assert mismatch["num_tokens"] >= mismatch["num_trained_tokens"] > 0 and mismatch["k3"] >= 0
    assert r["sync"]["off_policy_token_ratio"]["max"] == 0.0


def test_modes_make_an_overlap_config_and_refuse_unknown_names():
    cfg = load_config(None, ["rollout.rollout_batch_size=16", "rollout.over_sampling_batch_size=24"])
    modes = mode_configs(cfg, [2], parse_modes("sync,april,overlap"))
    assert list(modes) == ["sync", "april", "overlap", "april_2"]
    assert modes["overlap"].train.overlap and modes["overlap"].rollout.schedule == "april"
    assert modes["overlap"].rollout.over_sampling_batch_size == 24
    assert not modes["april"].train.overlap and not modes["sync"].train.overlap
    assert list(mode_configs(cfg, [], parse_modes("sync,april"))) == ["sync", "april"]
    with pytest.raises(SystemExit, match="--modes: async"):
        parse_modes("sync,async")


def test_report_with_an_overlap_mode_gives_its_ratios_and_idle_shares():
    def idle(rec, engine, learner):
        return rec | {"engine_idle_fraction": engine, "learner_idle_fraction": learner}

    runs = {"sync": [idle(record([(0, 0.3), (60, 0.36)]), 0.5, 0.6), idle(record([(0, 0.3), (80, 0.36)]), 0.4, 0.7)],
            "april": [idle(record([(0, 0.3), (40, 0.36)]), 0.3, 0.5), idle(record([(0, 0.3), (60, 0.36)]), 0.3, 0.5)],
            "overlap": [idle(record([(0, 0.3), (20, 0.36)]), 0.05, 0.2), idle(record([(0, 0.3), (40, 0.36)]), 0.09, 0.4)]}
    r = report([0, 1], 0.35, 1024, runs, [30])
    # time to target medians: sync 70, APRIL 50, overlapped 30
    assert r["speedup_overlap"] == pytest.approx(70 / 30) and r["overlap_over_april"] == pytest.approx(50 / 30)
    assert r["speedup"] == pytest.approx(70 / 50) and "speedup_overlap" not in r["overlap"]
    assert r["overlap"]["engine_idle_fraction"] == {"median": pytest.approx(0.07), "min": 0.05, "max": 0.09}
    assert r["overlap"]["engine_idle_fractions"] == [0.05, 0.09]
    assert r["sync"]["learner_idle_fraction"]["median"] == pytest.approx(0.65)
    assert r["sync"]["learner_idle_fractions"] == [0.6, 0.7]
    assert "| overlap | 30 [20, 40] |" in table(r) and "| 0.07 | 0.30 |" in table(r)


def test_grid_crosses_steps_ahead_with_corrections_and_raises_the_bound_only_where_needed():
    cfg = load_config(None, ["staleness.max_versions=2", "train.overlap=true"])
    overlap = mode_configs(cfg, [], ["overlap"])["overlap"]
    cells = grid_configs(overlap, *parse_grid("1,4", "tis,icepop", cfg))
    assert list(cells) == ["overlap_1_tis", "overlap_1_icepop", "overlap_4_tis", "overlap_4_icepop"]
    assert cells["overlap_4_icepop"].train.overlap_ahead == 4 and cells["overlap_4_icepop"].algorithm.correction == "icepop"
    assert cells["overlap_1_tis"].staleness.max_versions == 2 and cells["overlap_4_tis"].staleness.max_versions == 4
    assert list(grid_configs(overlap, *parse_grid("", "none", cfg))) == ["overlap_1_none"]  # the config's steps ahead
    with pytest.raises(SystemExit, match="cell overlap_1_ice.*algorithm.correction"):
        grid_configs(overlap, [1], ["ice"])
    with pytest.raises(SystemExit, match="--overlap-ahead: '0,2'"):
        parse_grid("0,2", "", cfg)


def test_grid_report_pairs_late_accuracy_with_sync_by_seed_and_weighs_mismatch_by_tokens():
    steps = [{"mismatch/num_tokens": 100, "mismatch/num_trained_tokens": 80, "mismatch/log_ratio_mean": -0.1,
              "mismatch/k2": 0.02, "mismatch/k3": 0.01, "mismatch/icepop_share": 0.5,
              "mismatch/age0/num_tokens": 100, "mismatch/age0/num_trained_tokens": 80,
              "mismatch/age0/log_ratio_mean": -0.1},
             {"mismatch/num_tokens": 300, "mismatch/num_trained_tokens": 20, "mismatch/log_ratio_mean": 0.1,
              "mismatch/k2": 0.02, "mismatch/k3": 0.03, "mismatch/icepop_share": 0.0,
              "mismatch/age2/num_tokens": 300, "mismatch/age2/num_trained_tokens": 20}]
    m = mismatch_record(steps)
    assert m["mismatch"]["log_ratio_mean"] == pytest.approx((-10 + 30) / 400) and m["mismatch"]["k3"] == pytest.approx(0.025)
    assert m["mismatch"]["icepop_share"] == pytest.approx(40 / 100) and m["mismatch"]["log_ratio_rms"] == pytest.approx(0.2)
    assert list(m["mismatch_by_age"]) == ["0", "2"] and m["mismatch_by_age"]["2"]["token_share"] == 0.75

    def rec(history, step_s, masked=0.0):
        r = record(history) | m | {"masked_token_ratio": masked}
        return r | {"train_s": step_s * r["steps"], "history": history[:-1] + [(step_s * r["steps"], history[-1][1])]}

    cfg = load_config(None, ["train.overlap=true"])
    cells = grid_configs(mode_configs(cfg, [], ["overlap"])["overlap"], [2], ["tis", "icepop"])
    runs = {"sync": [rec([(0, 0.3), (1, 0.3), (2, 0.40)], 2.0), rec([(0, 0.3), (1, 0.3), (2, 0.30)], 2.0)],
            "overlap_2_tis": [rec([(0, 0.3), (1, 0.3), (2, 0.37)], 1.0, 0.2), rec([(0, 0.3), (1, 0.3), (2, 0.29)], 1.0)],
            "overlap_2_icepop": [rec([(0, 0.3), (1, 0.3), (2, 0.41)], 1.6), rec([(0, 0.3), (1, 0.3), (2, 0.30)], 1.6)]}
    result = report([0, 1], 0.35, 512, runs, [10])
    grid = grid_report(result, late_accuracy, cells, cfg)
    tis, icepop = grid["cells"]["overlap_2_tis"], grid["cells"]["overlap_2_icepop"]
    assert tis["late_minus_sync_points_per_seed"] == pytest.approx([-3.0, -1.0]) and tis["late_minus_sync_points"] == pytest.approx(-2.0)
    assert tis["steps_per_s_over_sync"] == pytest.approx(2.0) and icepop["steps_per_s_over_sync"] == pytest.approx(1.25)
    assert tis["late_accuracy_mean"] == pytest.approx(0.33) and tis["late_accuracy_range"] == [0.29, 0.37]
    assert tis["masked_token_ratio"] == pytest.approx(0.1) and tis["correction_share"] == 0
    assert icepop["correction_share"] == pytest.approx(0.4) and icepop["ahead"] == 2
    assert grid["best_by_ahead"] == {"2": {"cell": "overlap_2_icepop", "correction": "icepop",
                                           "late_minus_sync_points": pytest.approx(0.5)}}
    assert "| overlap_2_tis | 2 | tis | 0.330 ± 0.057 [0.290, 0.370] | -2.0 | 2.00 |" in grid_table(grid)
