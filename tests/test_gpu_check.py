"""`python -m jobs.gpu_check --smoke`: every part of the GPU check runs on CPU with tiny shapes, so the command a
lent GPU runs (docs/gpu.md) cannot rot between loans. One run, shared by the tests below."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import USER_ENV
from tests.prefetch import shared_job

ROOT = Path(__file__).resolve().parents[1]


@shared_job
def gpu_check_run(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    # a budget no part reaches on a loaded CPU: each part runs to its end
    proc = subprocess.run([sys.executable, "-m", "jobs.gpu_check", "--smoke", "--budget-s", "900", "--json", str(out)],
                          cwd=ROOT, env=USER_ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    failed = {k: result[k]["error"] for k in result if "error" in result[k]}
    assert not failed, f"{failed}\n{proc.stderr[-4000:]}"
    return result, proc.stdout


def test_every_part_is_there_and_none_failed(gpu_check_run):
    result, stdout = gpu_check_run
    assert list(result) == ["device", "engine", "schedules", "learner", "handoff"]
    assert all(result[k] for k in result)
    device = result["device"]
    assert device["type"] == "cpu" and device["smoke"] is True
    assert set(device["parts"]) == {"engine", "schedules", "learner", "handoff"}
    for part in ("device:", "engine Qwen3-0.6B", "engine Qwen3-1.7B", "schedules", "learner Qwen3-1.7B", "handoff:"):
        assert part in stdout  # the table


def test_engine_curve_mix_and_fit_beside_the_roofline(gpu_check_run):
    engine = gpu_check_run[0]["engine"]
    assert set(engine) == {"Qwen3-0.6B", "Qwen3-1.7B"}
    for res in engine.values():
        points = res["by_concurrency"]
        assert {p["rows"] for p in points} == {1, 4, 8}
        assert all(p["tok_s"] > 0 and p["roofline_tok_s"] > 0 and p["decode_step_s"] > 0 for p in points)
        [mix] = res["length_mix"]
        assert mix["tok_s"] > 0 and mix["simulated_tok_s_roofline"] > 0 and mix["simulated_tok_s_fitted"] > 0
        assert 0 < mix["running_rows_mean"] <= mix["concurrency"] == 8
        prof = res["decode_profile"]  # on CPU: the host's side only
        assert prof["rows"] == 8 and prof["step_s"] > 0 and 0 < prof["host_op_s_per_step"]
        assert prof["device_s_per_step"] is None and prof["top_host_ops"][0]["calls_per_step"] > 0
        fit, roof = res["step_cost"]["fit"], res["step_cost"]["roofline"]
        assert {"a", "b", "c", "prefill_per_token", "rel_error_median"} <= set(fit) and fit["steps"] > 0
        assert roof["fixed_per_step"] > roof["t0"] > 0
        assert roof["memory_per_context_token"] > 0 and roof["compute_per_row"] > 0


def test_schedules_measured_and_simulated(gpu_check_run):
    sched = gpu_check_run[0]["schedules"]
    assert set(sched["modes"]) == {"sync", "april_1.5", "oversample_1.5", "april_2", "oversample_2"}
    for name, m in sched["modes"].items():
        assert m["steps"] >= 1 and m["trained_tokens"] > 0, name
        assert m["lost_samples"] == 0 and m["duplicated_samples"] == 0, name
        assert m["utilization"] > 0 and m["gain_over_sync"] > 0
        assert 0 < m["engine_busy_fraction"] <= 1, name
        assert m["simulated_utilization_fitted"] > 0 and m["simulated_utilization_roofline"] > 0
    assert sched["modes"]["sync"]["gain_over_sync"] == 1.0
    assert sched["step_cost_fit"]["steps"] > 0 and sched["ceiling_tok_s"]["mean"] > 0


def test_learner_step_against_the_plan(gpu_check_run):
    learner = gpu_check_run[0]["learner"]
    # the smoke's 4B stand-in fits whole: all its 3 layers
    steps = {k: v for k, v in learner.items() if isinstance(v, dict)}
    assert set(steps) == {"Qwen3-1.7B", "Qwen3-4B_3_layers"}
    for r in steps.values():
        assert r["step_s"] > 0 and r["tokens"] == 256 and r["micro_batches"] == 1
        assert r["first_step_s"] is None  # a GPU times a full step before the measured one
        assert r["peak_gb"] > 0 and r["plan_gb"] > 0
        assert r["plan_over_peak"] == pytest.approx(r["plan_gb"] / r["peak_gb"])
        assert r["plan"]["tokens_per_micro_batch"] == 256


def test_handoff_updates_the_server(gpu_check_run):
    h = gpu_check_run[0]["handoff"]
    assert h["updates"] == 2 and len(h["seconds"]) == 2 and h["s_per_update"] > 0 and h["stopped_early"] is False
    assert h["served_version_after"] == [2] and h["skipped"] == ["lm_head.weight"]
    assert h["bytes"] > 0 and h["tensors"] > 0
