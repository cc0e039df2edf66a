"""The rollout benchmark end to end on a small config: every mode, the sweep, the JSON keys and plots."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import USER_ENV
from tests.prefetch import shared_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@shared_job(runs=3)
def bench_rollout_run(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("bench-rollout")
    out = tmp / "bench.json"
    cmd = [sys.executable, "-m", "jobs.bench.rollout", "--json", str(out), "--steps", "2", "--warmup-steps", "1",
           "--probe-every", "1", "--probe-seconds", "0.5", "--sweep", "--sweep-factors", "1,3", "--sweep-steps", "1",
           "--out-dir", str(tmp / "plots"), f"model.path={model_dir}", f"model.cache_dir={tmp}",
           "task.num_train=300", "task.num_eval=16", "rollout.rollout_batch_size=4",
           "rollout.over_sampling_batch_size=4", "rollout.n_samples_per_prompt=4", "sampling.max_response_len=100",
           "engine.max_model_len=128", "engine.max_num_seqs=16", "engine.park_slots=16"]
    # 100-token responses: groups finish far enough apart that APRIL's top-ups are left partial, parked,
    # and resumed from their parked caches within two steps (at 24 tokens nearly every sample ran to the
    # cap, and whether one was came down to timing)
    proc = subprocess.run(cmd, cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                          timeout=600)
    return proc, out


def test_bench_rollout_runs_every_mode_and_the_sweep(bench_rollout_run):
    proc, out = bench_rollout_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    for mode in ("sync", "april", "april_recompute"):
        assert r[mode]["effective_tok_s"] > 0 and r[mode]["steps"] == 2 and 0 < r[mode]["utilization"]
        assert r[mode]["lost_samples"] == r[mode]["duplicated_samples"] == 0
        assert 0 < r[mode]["running_rows_mean"] <= 16 and set(r[mode]["boundary_ms"]) == {"start", "abort", "store"}
        assert 0 < r[mode]["engine_busy_fraction"] <= 1 and 0 < r[mode]["engine_on_core"] <= 1.01
    assert r["april"]["engine_reused_kv_tokens"] > 0 == r["april_recompute"]["engine_reused_kv_tokens"]
    assert r["speedup"] == pytest.approx(r["april"]["effective_tok_s"] / r["sync"]["effective_tok_s"])
    assert r["lost_samples"] == r["duplicated_samples"] == 0 and 0 < r["saturated_engine_on_core"] <= 1.01
    assert len(r["saturated_runs"]) == 3 + 2  # before, after round 1, after; then one per sweep point
    assert list(r["sweep"]) == ["1", "3"]
    assert all({"utilization", "speedup", "off_policy_token_ratio", "max_staleness", "store_groups_mean",
                "running_rows_mean", "boundary_ms", "engine_on_core"}
               <= set(p) for p in r["sweep"].values())
    assert all(Path(p).is_file() for p in r["plots"]) and len(r["plots"]) == 4


def test_a_bad_sweep_factors_list_names_the_flag(tmp_path):
    for bad, message in [("1,x", "--sweep-factors 1,x: expected comma-separated float"),
                         ("0.5,2", "--sweep-factors: 0.5: expected N'/N of at least 1")]:
        proc = subprocess.run([sys.executable, "-m", "jobs.bench.rollout", "--json", str(tmp_path / "b.json"),
                               "--out-dir", str(tmp_path), "--sweep", "--sweep-factors", bad], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
