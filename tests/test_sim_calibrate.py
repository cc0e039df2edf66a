"""The simulator against the CPU engine (sim/calibrate.py, `jobs.simulate --measure-cpu / --calibrate`):
the step-cost fits and the comparison with `jobs.bench.schedule`'s measurements."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import USER_ENV
from tests.prefetch import shared_job

ROOT = Path(__file__).resolve().parents[1]


def simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.simulate", "--config", "configs/tiny_cpu.yaml", *args],
                          cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True, timeout=900)


@shared_job
def calibrate_run(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("calibrate")
    out = tmp / "cal.json"
    return simulate("--calibrate", "--json", str(out), f"model.path={model_dir}", f"model.cache_dir={tmp}",
                    "task.num_train=2000"), out


@pytest.mark.slow
def test_calibrate_compares_the_simulation_with_both_measurements(calibrate_run):
    """`--calibrate` on the committed measurements: every mode compared in wall-clock and CPU time, the
    simulated schedules lose nothing (the tokenizer is a random model's, so only the keys are checked)."""
    proc, out = calibrate_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["comparison"]] == ["sync", "april_1.5", "april_3"]
    for r in result["comparison"]:
        assert 0 < r["simulated_utilization"] <= 1.05 and r["error"] == pytest.approx(
            r["simulated_utilization"] - r["measured_utilization"])
        assert r["in_situ_utilization"] is not None and r["duplicated_samples"] == r["samples_with_wrong_length"] == 0
        if r["measured_cpu_utilization"] is not None:
            assert r["cpu_error"] == pytest.approx(r["simulated_utilization"] - r["measured_cpu_utilization"])
        assert r["bench_probe_error"] == pytest.approx(r["simulated_vs_bench_probe"] - r["measured_utilization"])
        assert r["replayed_error"] == pytest.approx(r["replayed_vs_bench_probe"] - r["measured_utilization"])
        assert r["simulated_vs_bench_probe"] < r["simulated_utilization"]  # a restarted probe runs short contexts
        # the committed bench run carries its own step costs; the recording's are the cross-check
        assert r["recording_costs_error"] == pytest.approx(r["recording_costs_vs_bench_probe"] - r["measured_utilization"])
        assert r["measured_attended_per_context"] >= 1 and r["simulated_attended_per_context"] >= 1
    assert result["setup"]["costs_from"] == "the bench run's own engine steps"
    assert {"within_0.05", "within_0.05_cpu", "within_0.05_in_situ", "within_0.05_bench_probe",
            "within_0.05_replayed"} <= result.keys()
    assert result["ceiling_tok_s"]["simulated_bench_probe"] > result["ceiling_tok_s"]["simulated"]
    assert set(result["fit_over_measured_steps"]) == {"sync", "april_1.5", "april_3", "probe"}


def test_fit_over_measured_is_one_for_exact_costs_and_finds_a_mode_they_miss():
    """Steps that follow the fitted costs exactly give 1; a mode whose steps all cost 10% more than their
    features say gives 1/1.1, and the fit from every mode's steps is what `fit_costs` returns."""
    from sim.calibrate import COSTS, FEATURES, fit_costs, fit_over_measured

    rng = np.random.default_rng(0)
    true = dict(zip(COSTS, (1e-3, 4e-5, 3e-7, 2e-5, 2e-4, 0.0, 2e-6, 6e-4, 3e-7)))

    def steps(n: int, extra: float) -> list[tuple]:
        out = []
        for _ in range(n):
            rows, ctx = int(rng.integers(1, 65)), float(rng.integers(100, 5000))
            pre = float(rng.integers(0, 200)) * (rng.random() < 0.3)
            x = (1.0, rows, ctx, pre, float(pre > 0), float(rng.integers(0, 3)), float(rng.integers(0, 50)),
                 float(rng.random() < 0.05), ctx * (1 + rng.random()))
            out.append(x + (extra * sum(true[c] * v for c, v in zip(COSTS, x)),))
        return out

    recorded = {"sync": steps(400, 1.0), "probe": steps(400, 1.0), "april_3": steps(40, 1.1)}
    fit = fit_costs([r for rs in recorded.values() for r in rs])
    sums = {m: dict(zip(FEATURES + ("cpu_s",), map(float, np.sum(rs, axis=0)))) for m, rs in recorded.items()}
    ratio = fit_over_measured({"step_costs": {"fit": fit, "sums": sums}})
    assert ratio["sync"] == pytest.approx(1.0, abs=0.01) and ratio["probe"] == pytest.approx(1.0, abs=0.01)
    assert ratio["april_3"] == pytest.approx(1 / 1.1, abs=0.02)
    exact = {"step_costs": {"fit": true, "sums": {m: s for m, s in sums.items() if m != "april_3"}}}
    assert fit_over_measured(exact) == pytest.approx({"sync": 1.0, "probe": 1.0})
    assert fit_over_measured({}) == {}


def test_fit_by_gap_finds_steps_that_follow_other_work_costlier():
    """Steps that follow over a millisecond of other work cost 20% more than their batch: their bin's fit
    over measured is 1/1.2, the rest's 1; bins of fewer than 20 steps are left out."""
    from sim.calibrate import COSTS, fit_by_gap

    fit = dict(zip(COSTS, (1e-3, 4e-5, 3e-7, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)))
    rows, gaps = [], []
    for i in range(300):
        gap = (0.1e-3, 2e-3, 50e-3)[i % 3] if i < 290 else 0.01e-3  # 10 steps in the first bin: left out
        x = (1.0, float(1 + i % 64), float(100 * (1 + i % 50)), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        cost = sum(fit[c] * v for c, v in zip(COSTS, x)) * (1.2 if gap > 1e-3 else 1.0)
        rows.append(x + (cost,))
        gaps.append(gap)
    bins = fit_by_gap(fit, {"april": rows}, {"april": gaps})["april"]
    assert [b["gap_ms"] for b in bins] == [[0.05, 0.2], [1.0, 5.0], [5.0, None]]
    assert [round(b["fit_over_measured"], 3) for b in bins] == [1.0, round(1 / 1.2, 3), round(1 / 1.2, 3)]
    assert sum(b["steps"] for b in bins) == 290


@shared_job(runs=2)
def measure_cpu_runs(tmp_path_factory, model_dir):
    """`--measure-cpu`, then `--calibrate` with its costs and a bench JSON that has none of its own."""
    tmp = tmp_path_factory.mktemp("measure-cpu")
    costs = tmp / "cpu.json"
    small = [f"model.path={model_dir}", f"model.cache_dir={tmp}", "task.num_train=2000",
             "sampling.max_response_len=24"]
    measure = simulate("--measure-cpu", str(costs), "--record-steps", "4", "--probe-seconds", "0.3", *small)
    if measure.returncode:
        return measure, costs, None, None
    bench = json.loads((ROOT / "tests/data/bench_schedule_s7_r8.json").read_text())  # no step costs
    old = tmp / "bench.json"
    old.write_text(json.dumps(bench))
    out = tmp / "cal.json"
    return measure, costs, simulate("--calibrate", "--cpu-costs", str(costs), "--measured", str(old), "--json",
                                    str(out), *small), out


@pytest.mark.slow
def test_measure_cpu_takes_its_costs_from_a_bench_run_and_calibrate_reads_them(measure_cpu_runs):
    """`--measure-cpu` runs jobs.bench.schedule for the step costs, times the grid, records the lengths;
    `--calibrate` with those costs and a bench JSON that has none of its own uses them."""
    proc, costs, calibrate, out = measure_cpu_runs
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(costs.read_text())
    assert measured["fit"]["steps"] > 0 and measured["grid_fit"]["c"] >= 0 and len(measured["by_row"]) == 320
    assert set(measured["in_situ"]) == {"sync", "april_1.5", "april_3"}
    assert all(0 < m["utilization"] for m in measured["in_situ"].values())
    assert measured["schedules"]["sync"]["steps"] == 4 and "step_costs" not in measured["schedules"]
    assert calibrate.returncode == 0, calibrate.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["setup"]["costs_from"] == "the --measure-cpu recording" and result["setup"]["fit"] == measured["fit"]
    assert all(r["in_situ_utilization"] == measured["in_situ"][r["mode"]]["utilization"] for r in result["comparison"])
