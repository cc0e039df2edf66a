"""The training job over HTTP on a local Ray (configs/tiny_cpu_http.yaml): engine actors start our engine's
server and drive it with the SGLang client, and the learner broadcasts weights into the servers over gloo;
and an SGLang server asked for on a cluster without GPUs fails at once."""
import json
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tests.conftest import USER_ENV
from tests.local_job import SMALL, train_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def train(tmp_path, model_dir, *overrides, timeout=900):
    cmd = train_command("configs/tiny_cpu_http.yaml", model_dir, tmp_path, *SMALL, "logging.dashboard=false",
                        *overrides)
    proc = subprocess.run(cmd, cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                          timeout=timeout)
    return proc


def test_training_over_http_with_weights_broadcast_into_the_servers(http_run, random_model_dir):
    """The learner broadcasts the weights into both servers after each step, and each step's rollout runs
    on the previous step's weights, under their version (tests/test_zero3_gather.py gathers with two ranks).
    The run tests/test_listeners.py watches too (conftest.py)."""
    tmp_path, proc = http_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_version"] == 3
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/version" in r]
    assert [r["train/version"] for r in steps] == [1, 2, 3]
    assert [r["engine/version_min"] for r in steps] == [0, 1, 2]
    # every step trains; a step whose batch is all surplus groups carried from the one before generates nothing
    assert all(r["rollout/trained_tokens"] > 0 for r in steps) and sum(r["rollout/generated_tokens"] for r in steps) > 0
    out = tmp_path / "out"
    trained = load_file(out / (out / "latest").read_text().strip() / "policy" / "model.safetensors")
    initial = load_file(Path(random_model_dir) / "model.safetensors")
    assert any(not (trained[k] == initial[k]).all() for k in initial if k in trained)


def test_sglang_server_on_a_cluster_without_gpus_fails_at_once(tmp_path, random_model_dir):
    proc = train(tmp_path, random_model_dir, "train.num_steps=1", "engine.backend=sglang", "placement.engine_gpus=1",
                 "engine.num_engines=2", timeout=300)
    assert proc.returncode != 0
    err = proc.stderr[-3000:]
    assert "asks for" in err and "'GPU': 2.0" in err and "has no GPU" in err and "'CPU'" in err, err
    assert "could not be placed within" not in err  # the resource check failed it, not the placement group's wait
