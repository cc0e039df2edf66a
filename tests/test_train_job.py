"""End to end on a local Ray: the training job's driver, a few steps of the tiny model, and a resume."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_train_steps_change_weights_advance_versions_and_resume(resumed_run, random_model_dir):
    """Three steps, then a resume to six in the same output directory (conftest.py's `resumed_run`: the
    two-rank job's)."""
    first, second = resumed_run.first, resumed_run.second
    assert first.returncode == 0, first.stderr[-4000:]
    summary = resumed_run.summary
    assert summary["steps"] == 3 and summary["final_version"] == 3
    assert {"accuracy_before", "accuracy_after", "steps", "wall_s"} <= set(summary)
    assert resumed_run.latest == "ckpt-000002"
    trained = load_file(resumed_run.policy)
    initial = load_file(Path(random_model_dir) / "model.safetensors")
    assert any(not (trained[k] == initial[k]).all() for k in initial if k in trained)
    rows = [json.loads(line) for line in resumed_run.metrics.splitlines()]
    assert [r["train/version"] for r in rows if "train/version" in r] == [1, 2, 3]
    step_rows = [r for r in rows if "train/version" in r]
    for key in ("rollout/abort_latency_s", "rollout/off_policy_token_ratio", "engine/occupancy_mean",
                "store/groups", "train/grad_norm", "loss/policy", "off_policy/is_weight_mean"):
        assert all(key in r for r in step_rows), key
    assert all(any(k.startswith("rollout/staleness_hist/") for k in r) for r in step_rows)
    # the engines sampled step k's rollout with the weights of version k (published after step k-1)
    assert [r["engine/version_min"] for r in step_rows] == [0, 1, 2]
    assert resumed_run.wandb_runs

    assert second.returncode == 0, second.stderr[-4000:]
    out = resumed_run.out
    summary2 = json.loads((out.parent / "summary.json").read_text())
    assert "resumed from" in second.stdout and "ckpt-000002" in second.stdout
    assert summary2["steps"] == 3 and summary2["final_version"] == 6
    state_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/version"] for r in state_rows if "train/version" in r] == [1, 2, 3, 4, 5, 6]
    # after the resume the engines started from the checkpoint's weights and version, not from 0
    assert [r["engine/version_min"] for r in state_rows if "train/version" in r][3:] == [3, 4, 5]
    # the last step evaluated the final weights: that is the accuracy after, not a second evaluation
    assert [r["step"] for r in state_rows if "eval/accuracy_t1" in r] == [1, 3, 5]
    assert len(summary2["history"]) == 3 and summary2["accuracy_after"] == summary2["history"][-1][1]


def test_bad_config_fails_at_start_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jobs.train", "--config", "configs/tiny_cpu.yaml",
                           "rollout.over_sampling_batch_size=1"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "rollout.over_sampling_batch_size" in proc.stderr


def test_two_data_parallel_learner_ranks_with_deepspeed_gloo(two_rank_run):
    """The run tests/test_listeners.py watches too, before its resume (conftest.py)."""
    _, run, resumed = two_rank_run
    assert run.returncode == 0, run.stderr[-4000:]
    summary = resumed.summary  # the summary and metrics it left, before the resume went on in its directory
    assert summary["final_version"] == 3
    rows = [json.loads(line) for line in resumed.metrics.splitlines()]
    # each rank trained on its own share of the groups (8 samples): num_samples is the ranks' sum
    assert all(r["train/num_samples"] == 16 for r in rows if "train/num_samples" in r)
