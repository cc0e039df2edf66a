"""The in-process schedule benchmark end to end on a small config: every mode, JSON keys, nothing lost."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from april_ray.config import ConfigError, load_config
from jobs.bench.schedule import per_engine
from tests.conftest import USER_ENV

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_per_engine_share_of_the_ray_run():
    cfg = load_config(None, ["rollout.rollout_batch_size=16", "rollout.over_sampling_batch_size=24",
                             "engine.num_engines=2"])
    assert per_engine(cfg, None) == (8, 12) and per_engine(cfg, 3) == (8, 24) and per_engine(cfg, 1) == (8, 8)
    assert per_engine(cfg, "auto") == (8, "auto")
    with pytest.raises(ConfigError, match="rollout.rollout_batch_size=15"):
        per_engine(load_config(None, ["rollout.rollout_batch_size=15", "rollout.over_sampling_batch_size=16"]), None)


def test_bench_schedule_runs_sync_april_and_the_over_provisioned_baseline_in_process(tmp_path, random_model_dir):
    out = tmp_path / "sched.json"
    cmd = [sys.executable, "-m", "jobs.bench.schedule", "--json", str(out), "--steps", "3", "--warmup-steps", "1",
           "--factors", "1,2,auto", "--oversample", "--probe-every", "2", "--probe-seconds", "0.5", f"model.path={random_model_dir}",
           f"model.cache_dir={tmp_path}", "task.num_train=300", "task.num_eval=16", "rollout.rollout_batch_size=8",
           "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4", "sampling.max_response_len=24",
           "engine.max_model_len=64", "engine.max_num_seqs=16", "engine.park_slots=16"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert len(r["saturated_runs"]) == 3 and r["config"]["rollout_batch_size"] == 4  # 8 groups over 2 engines
    modes = ("sync", "april_1", "oversample_1", "april_2", "oversample_2")
    for mode, n_prime in zip(modes, (4, 4, 4, 8, 8)):
        res = r[mode]
        assert res["steps"] == 3 and res["over_sampling_batch_size"] == n_prime
        assert res["effective_tok_s"] > 0 and 0 < res["utilization"] and 0 < res["running_rows_mean"] <= 16
        assert res["cpu_utilization"] == pytest.approx(res["trained_tokens"] / res["cpu_s"] / r["saturated_cpu_tok_s"], abs=1e-3)
        assert res["unmasked_utilization"] == pytest.approx(res["utilization"] * (1 - res["masked_token_ratio"]))
        assert res["lost_samples"] == res["duplicated_samples"] == 0
        assert len(res["sample_lengths"]) == 4 * 4 * 4  # every returned sample of 4 steps x 4 groups x 4
        assert all(0 < n <= 24 for n in res["sample_lengths"].values())
        assert res["over_sampling_factor"] == {"mean": n_prime / 4, "last": n_prime / 4}
    auto = r["april_auto"]  # N'/N as it chose it, within [1, 4]
    assert auto["over_sampling_batch_size"] == "auto" and "oversample_auto" not in r
    assert 1 <= auto["over_sampling_factor"]["mean"] <= 4 and 1 <= auto["over_sampling_factor"]["last"] <= 4
    assert 0 <= auto["masked_token_ratio"] <= 1 and auto["lost_samples"] == auto["duplicated_samples"] == 0
    assert r["sync"]["speedup"] == 1 and r["sync"]["off_policy_token_ratio"] == 0
    assert r["april_2"]["speedup"] == pytest.approx(r["april_2"]["effective_tok_s"] / r["sync"]["effective_tok_s"])
    # every engine step recorded for the simulator's calibration: the modes' and the probes'
    costs = r["step_costs"]
    assert set(costs["sums"]) == {*modes, "april_auto", "probe"}
    assert costs["fit"]["steps"] == sum(round(s["one"]) for s in costs["sums"].values())
    assert all(costs["fit"][k] >= 0 for k in ("a", "b", "c", "prefill_per_token", "per_attended"))
    for mode in modes:
        sums, between = costs["sums"][mode], costs["between_steps"]["by_mode"][mode]
        assert sums["rows"] >= r[mode]["engine_decoded_tokens"] and sums["attended"] >= sums["context"] > 0
        assert between["steps"] == round(sums["one"]) and between["between_s"] > 0
    # the fit against each mode's steps by the other work that preceded them
    assert set(costs["fit_by_gap"]) == {*modes, "april_auto", "probe"}
    for mode, bins in costs["fit_by_gap"].items():
        assert sum(b["steps"] for b in bins) <= round(costs["sums"][mode]["one"])
        assert all(b["fit_over_measured"] > 0 and 0 < b["rows_mean"] <= 16 for b in bins)
