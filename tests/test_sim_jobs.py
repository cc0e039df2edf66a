"""The simulator's entry points: `jobs.simulate` (its inputs, its processes, the keys it writes) and
`jobs.bench.simulation` (its counts per sample call)."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bad_input_to_the_simulator_names_the_flag_or_the_entry(tmp_path):
    import argparse

    from sim.config import number_list
    from sim.workload import load_lengths_file

    path = tmp_path / "lengths.json"
    for content, where in [({"lengths": [1, 2, "x"]}, "lengths[2]"), ({"lengths": [5, 0]}, "lengths[1]"),
                           ({"by_row": {"3": [5, 2.5]}}, "by_row['3'][1]"), ({"by_row": {"a": [1]}}, "by_row key 'a'"),
                           ({"by_row": {"3": 5}}, "by_row['3']"), ([1, 2], "expected an object")]:
        path.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=re.escape(f"response lengths file {path}: {where}")):
            load_lengths_file(str(path))
    path.write_text(json.dumps({"by_row": {"3": [5, 6]}, "lengths": [100, 200]}))
    assert load_lengths_file(str(path)) == ([100, 200], {3: [5, 6]})

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    gpus = dict(kind=int, ok=lambda g: g >= 2 and g % 2 == 0, rule="multiples of 2")
    assert number_list(Parser(), "--gpus", "8,16", **gpus) == [8, 16]
    for text, message in [("8,x", "--gpus 8,x: expected comma-separated int"), ("8,7,0", "--gpus: 7, 0: expected")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            number_list(Parser(), "--gpus", text, **gpus)
    for workers, message in [("x", "--workers x: expected a number of processes or auto"),
                             ("0", "--workers 0: must be at least 1")]:
        proc = subprocess.run([sys.executable, "-m", "jobs.simulate", "--config", "configs/qwen3_4b_dapo.yaml",
                               "--workers", workers], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_simulate_overrides_load_as_the_job_config_does_and_errors_name_the_key():
    from april_ray.config import ConfigError
    from sim.config import load_simulate_config

    sim = load_simulate_config(["simulate.steps=3", "simulate.length_family=pareto", "simulate.length_alpha=2"])
    assert (sim.steps, sim.length_family, sim.length_alpha, sim.warmup_steps) == (3, "pareto", 2.0, 3)
    for overrides, message in [(["simulate.steps=0"], "simulate.steps: must be > 0, got 0"),
                               (["simulate.steps=x"], "simulate.steps: Value 'x'"),
                               (["simulate.nokey=1"], "simulate.nokey: Key 'nokey' not in 'SimulateConfig'"),
                               (["simulate.steps"], "override 'simulate.steps': expected key=value"),
                               (["simulate.group_correlation=1.5"], "simulate.group_correlation: must be <= 1"),
                               (["simulate.length_family=task"], "simulate.length_file: length_family=task needs")]:
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            load_simulate_config(overrides)


def test_usable_cores_follow_the_affinity_and_the_lowest_cpu_quota_on_the_cgroups_path(tmp_path):
    from jobs.common import usable_cores

    affinity = len(os.sched_getaffinity(0))
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    assert usable_cores(str(tmp_path / "none"), str(proc)) == affinity  # nothing readable: the affinity alone
    assert usable_cores(str(tmp_path / "none"), str(tmp_path / "no-proc-file")) == affinity
    v2 = tmp_path / "v2"
    v2.mkdir()
    for text, cores in [("max 100000\n", affinity), ("150000 100000\n", min(affinity, 2)),
                        ("50000 100000\n", 1), ("garbage\n", affinity), ("100000 0\n", affinity)]:
        (v2 / "cpu.max").write_text(text)  # a container's own cgroup, seen at the root
        assert usable_cores(str(v2), str(proc)) == cores, text
    # v2, a unit's cgroup below the root: its own quota and its parents' count, the lowest wins
    (v2 / "cpu.max").unlink()
    unit = v2 / "system.slice" / "job.service"
    unit.mkdir(parents=True)
    proc.write_text("0::/system.slice/job.service\n")
    (unit / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(v2), str(proc)) == affinity
    (unit.parent / "cpu.max").write_text("100000 100000\n")
    assert usable_cores(str(v2), str(proc)) == 1
    # v1: the cpu controller's hierarchy, the path from /proc/self/cgroup, or the root when not there
    v1 = tmp_path / "v1" / "cpu"
    (v1 / "batch").mkdir(parents=True)
    for d in (v1, v1 / "batch"):
        (d / "cpu.cfs_period_us").write_text("100000\n")
        (d / "cpu.cfs_quota_us").write_text("-1\n")
    proc.write_text("4:memory:/batch\n3:cpu,cpuacct:/batch\n")
    for where, quota, cores in [(v1 / "batch", "250000", min(affinity, 3)), (v1, "100000", 1)]:
        (where / "cpu.cfs_quota_us").write_text(quota + "\n")
        assert usable_cores(str(tmp_path / "v1"), str(proc)) == cores, (where, quota)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    proc.write_text("3:cpu,cpuacct:/docker/0123abcd\n")  # a container's host path, not under its mount
    assert usable_cores(str(tmp_path / "v1"), str(proc)) == affinity
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # outside the mount: never read
    (tmp_path / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    mount = tmp_path / "m" / "n"
    (mount / "cpu").mkdir(parents=True)
    for text in ("0::/../..\n", "3:cpu:/../../..\n"):
        proc.write_text(text)
        assert usable_cores(str(mount), str(proc)) == affinity
    proc.write_bytes(b"0::/\xff\xfe\n")  # not UTF-8: no quota read, no error
    assert usable_cores(str(v2), str(proc)) == affinity


def test_bench_simulation_counts_the_calls_each_schedule_makes():
    """`jobs.bench.simulation`'s per-call figures rest on its counts: sync sends every sample of its N
    groups once a step (nothing is filtered here); APRIL sends more (resumes), and one span ends per event;
    the worker alone sends each sample of each round's groups once."""
    from jobs.bench.simulation import schedule_cost, worker_alone
    from april_ray.config import load_config
    from sim import study
    from sim.config import load_simulate_config

    cfg = load_config(str(ROOT / "configs/qwen3_4b_dapo.yaml"), ["sampling.max_response_len=2048"])
    sim = load_simulate_config(["simulate.length_median=300"])
    sync = schedule_cost(cfg, sim, 8, None, steps=2, warmup=0)
    april = schedule_cost(cfg, sim, 8, 2.0, steps=2, warmup=1)
    assert sync["sample_calls_per_step"] == 32 * 8
    assert april["sample_calls_per_step"] > 32 * 8
    for r in (sync, april):
        assert 0 < r["spans_per_call"] <= 2 and r["control_plane_us_per_call"] > 0 and r["rest_us_per_call"] > 0
    alone = worker_alone(study.gpu_setting(cfg, sim, 8), groups=16, n_samples=8, rounds=2)
    assert alone["sample_calls"] == 2 * 16 * 8 and alone["us_per_call"] > 0


def test_bench_simulation_counts_the_same_python_operations_in_every_run():
    """`--ops`: a schedule's Python operations per sample call, counted by a tracer, are the same from one
    run to the next (what makes them a measure free of timing noise), and are charged to the files that
    ran them: the rollout's own code and the simulator's."""
    from jobs.bench.simulation import schedule_ops
    from april_ray.config import load_config
    from sim.config import load_simulate_config

    cfg = load_config(str(ROOT / "configs/qwen3_4b_dapo.yaml"), ["sampling.max_response_len=2048"])
    sim = load_simulate_config(["simulate.length_median=300"])
    first, again = (schedule_ops(cfg, sim, 8, 2.0, steps=1, warmup=1, schedule="april") for _ in range(2))
    assert first == again
    assert first["sample_calls"] > 32 * 8 and first["ops_per_call"] > first["python_calls_per_call"] > 1
    files = first["ops_per_call_by_file"]
    assert files["april_ray/rollout/monitor.py"] > 0 and files["sim/engine.py"] > 0
    assert sum(files.values()) == pytest.approx(first["ops_per_call"], rel=1e-3)


def test_jobs_simulate_writes_the_promised_keys(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    cmd = [sys.executable, "-m", "jobs.simulate", "--config", "configs/qwen3_4b_dapo.yaml", "--gpus", "8",
           "--factors", "1,2", "--json", str(out), "--plot", str(png), "simulate.steps=2", "simulate.warmup_steps=1",
           "simulate.length_median=300", "sampling.max_response_len=2048", "engine.max_model_len=3072"]
    proc = subprocess.run([*cmd, "--workers", "1"], check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    from sim import overlap

    assert result["workers"] == 1 and proc.stdout.rstrip().endswith("of CPU in 1 process")
    assert {"wall_s", "assumptions", "results"} <= result.keys() and png.stat().st_size > 0
    assert [(row["gpus"], row["factor"]) for row in result["results"]] == [(8, 1), (8, 2)]
    for row in result["results"]:
        assert {"gpus", "factor", "sync_utilization", "april_utilization", "speedup", "off_policy_token_ratio",
                "step_s", "control_plane_cpu_s_per_step"} <= row.keys()
        assert 0 < row["sync_utilization"] <= 1.05 and 0 < row["april_utilization"] <= 1.05
        # the over-provisioned baseline throws away what is unfinished at the N-th group; at N'/N = 1 it is sync
        if row["factor"] == 1:
            assert row["oversample_utilization"] == row["sync_utilization"] and row["oversample_sim_cpu_s"] == 0
        else:
            assert 0 < row["oversample_utilization"] <= 1.05 and row["oversample_generated_per_trained"] > 1
        assert row["sample_speedup_vs_oversample"] > 0 and row["speedup_vs_oversample"] > 0
        assert row["lost_groups"] == row["duplicated_samples"] == row["samples_with_wrong_length"] == 0
        assert math.isfinite(row["step_s"]) and row["step_s"] > 0
        # end to end (learner and weight sync in the step): trained tokens per wall second over sync's
        assert row["april_end_to_end_tok_s"] == pytest.approx(row["april_tok_s"] * row["rollout_s"] / row["step_s"])
        assert row["sync_end_to_end_tok_s"] == pytest.approx(row["sync_tok_s"] * row["sync_rollout_s"] / row["sync_step_s"])
        assert row["april_end_to_end_speedup"] == pytest.approx(row["april_end_to_end_tok_s"] / row["sync_end_to_end_tok_s"])
        # the overlapped mode: each split of the GPUs, the best one named
        splits = row["overlap_splits"]
        assert [(s["engines"], s["learner"]) for s in splits] == [(s["engines"], s["learner"])
                                                                  for s in overlap.splits(row["gpus"])]
        assert all(s["engines"] + s["learner"] == row["gpus"] for s in splits) and len(splits) >= 3
        for s in splits:
            assert s["end_to_end_speedup"] == pytest.approx(s["end_to_end_tok_s"] / row["sync_end_to_end_tok_s"])
            assert 0 < s["engine_utilization"] <= 1.05 and 0 < s["learner_busy_fraction"] <= 1
        best = max(splits, key=lambda s: s["end_to_end_tok_s"])
        assert row["overlap_split"] == {"engines": best["engines"], "learner": best["learner"]}
        assert row["overlap_end_to_end_speedup"] == best["end_to_end_speedup"]
    assert result["assumptions"]["accelerator"]["bandwidth"] == 3.35e12
    # side by side in two processes, and by default in a process per usable core (at most one per schedule:
    # 12 here, 8 of them the overlapped mode's splits): the same schedules (the control plane's measured CPU,
    # which passes on the virtual clock, moves the figures by a hair)
    from jobs.common import usable_cores

    sides = []
    # (on two usable cores the default is the two-process run: run once)
    for expected, workers in {2: ["--workers", "2"], min(12, usable_cores()): []}.items():
        both = tmp_path / f"side{expected}.json"
        subprocess.run([*cmd[:cmd.index("--json") + 1], str(both), *cmd[cmd.index("--plot") + 2:], *workers],
                       check=True, capture_output=True, text=True, timeout=300)
        sides.append(json.loads(both.read_text()))
        assert sides[-1]["workers"] == expected and len(sides[-1]["results"]) == len(result["results"]) == 2
    for a, b in ((a, b) for side in sides for a, b in zip(result["results"], side["results"])):
        assert (a["gpus"], a["factor"], a["rollout_batch_size"]) == (b["gpus"], b["factor"], b["rollout_batch_size"])
        assert a["off_policy_token_ratio"] == pytest.approx(b["off_policy_token_ratio"], abs=0.02)
        for key in ("sync_utilization", "april_utilization", "speedup"):  # ~0.1% apart on a quiet machine
            assert a[key] == pytest.approx(b[key], rel=0.03), key
    # no more processes than schedules (here 6: sync, APRIL at N'/N = 1 and the overlapped mode's 4 splits),
    # and a bad count named
    from jobs.simulate import simulate_gpus
    from april_ray.config import load_config
    from sim.config import load_simulate_config

    small = load_config(str(ROOT / "configs/qwen3_4b_dapo.yaml"), ["sampling.max_response_len=2048"])
    sim = load_simulate_config(["simulate.steps=1", "simulate.warmup_steps=0", "simulate.length_median=300"])
    assert simulate_gpus(small, sim, [8], [1.0], workers=8)["workers"] == 6
    with pytest.raises(ValueError, match="workers: expected a number of processes of at least 1 or 'auto', got 0"):
        simulate_gpus(small, sim, [8], [1.0], workers=0)
