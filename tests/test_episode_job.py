"""Episodes end to end on a local Ray: a tool whose answer is a function of the trajectory before the call,
under staleness.policy=restart with max_versions=0 (interrupted samples restart from their prompts under the
same sample ids), with the driver SIGKILLed mid-run and resumed (jobs/chaos_driver.py). Every result a
trajectory received is the tool's answer for that trajectory, every run of the tool carried its idempotency
key, and no call whose result was journaled ran again."""
import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from april_ray.config import load_config
from driver.records import TRAINING_SAMPLE
from jobs.chaos_driver import read_jsonl, run_driver_kills
from tests.conftest import USER_ENV
from tests.prefetch import shared_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

TRAJECTORY_TOOL = '''
import json, os, time

SEEN = os.path.join(os.path.dirname(__file__), "seen.jsonl")
STOPS = tuple("abcdefghij")


def digest(ids):
    return sum((i + 1) * t for i, t in enumerate(ids)) % 9973


def tool(sample_id, turn, ids, idempotency_key):
    """The trajectory's digest, slowly (calls are in flight most of a rollout); every run logged with its key."""
    with open(os.environ["APRIL_RAY_TOOL_LOG"], "a") as f:
        f.write(json.dumps({"sample": sample_id, "turn": turn, "call": idempotency_key}) + "\\n")
    time.sleep(0.05)
    return digest(ids)


async def episode(ep):
    """A turn ends at any of ten letters (often, for a random model); each is answered with the digest of
    everything before the call, and what was received is logged next to what is right."""
    while True:
        text = await ep.generate(stop=STOPS)
        if not text.endswith(STOPS):
            return None
        before = list(ep.sample.input_ids)
        got = await ep.call_tool("digest", tool, ep.sample.sample_id, ep.turn, before)
        with open(SEEN, "a") as f:
            f.write(json.dumps({"sample": ep.sample.sample_id, "got": got, "right": digest(before)}) + "\\n")
        ep.append_env(str(got))
'''


@shared_job(runs=2)
def trajectory_kill_run(tmp_path_factory, model_dir):
    """The agent task with a tool that checks its trajectory, four steps and one driver kill
    (`run_driver_kills`, in a background thread: its jobs run from ROOT, the plug-in on their PYTHONPATH)."""
    tmp_path = tmp_path_factory.mktemp("trajectory-kills")
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "trajectory_env.py").write_text(TRAJECTORY_TOOL)
    overrides = [f"model.path={model_dir}", f"model.cache_dir={tmp_path}", f"train.output_dir={tmp_path}/out",
                 "task.num_train=300", "task.num_eval=16", "rollout.rollout_batch_size=4",
                 "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4", "sampling.max_response_len=48",
                 "engine.max_model_len=192", "algorithm.overlong_buffer=8", "learner.lr=1e-3", "train.num_steps=4",
                 "train.eval_every=100", "train.save_every=1", "logging.wandb_mode=disabled", "logging.dashboard=false",
                 "learner.backend=torch", "engine.num_engines=1",
                 "rollout.episode_fn=trajectory_env:episode", "staleness.policy=restart", "staleness.max_versions=0"]
    # the torch learner and one engine: fewer processes to start in each run (what is checked does not
    # depend on them)
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), overrides)
    args = argparse.Namespace(config="configs/tiny_cpu.yaml", overrides=overrides, driver_kills=1, seed=4)
    return tmp_path, run_driver_kills(cfg, args, {**USER_ENV, "PYTHONPATH": str(plug)})


def test_tool_results_belong_to_their_trajectory_across_restarts_and_a_killed_driver(trajectory_kill_run):
    tmp_path, result = trajectory_kill_run
    plug = tmp_path / "plug"
    print(json.dumps(result, indent=1))
    assert result["runs"][1]["finished"] and result["runs"][1]["resumed_from"] is not None
    assert result["prompts_consumed_twice"] == 0 and result["prompts_skipped"] == 0
    assert result["samples_trained_twice"] == 0 and result["metrics_steps_ok"]

    out = tmp_path / "out" / "driver_kills"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("store/restarted_samples", 0) for m in metrics) > 0  # trajectories restarted, ids reused
    seen = [json.loads(line) for line in (plug / "seen.jsonl").read_text().splitlines()]
    wrong = [s for s in seen if s["got"] != s["right"]]
    assert len(seen) > 100 and not wrong, wrong[:5]

    runs = read_jsonl(out / "tool_calls.jsonl")
    assert runs and all(r["call"].startswith(f"{r['sample']}/{r['turn']}/") for r in runs)  # every run had its key
    # a key run more than once: only one the journal had not recorded when the kill came, run again after it
    per_key = Counter(r["call"] for r in runs if TRAINING_SAMPLE.fullmatch(r["sample"]))
    assert result["tool_calls_run_twice"] == 0 and result["tool_calls"] == sum(per_key.values()) > 100
    assert sum(n - 1 for n in per_key.values()) == result["tool_calls_rerun_unjournaled"]
