"""Chaos, driver kills, end to end on a local Ray: the training driver SIGKILLed once mid-run and resumed;
exactly-once checked from the final checkpoint and the job's records, and no process of the killed run
left behind."""
import argparse
import json
from pathlib import Path

import pytest

from april_ray.config import load_config
from driver.checkpoint import read_state
from driver.records import read_rows
from jobs.chaos_driver import run_driver_kills
from tests.conftest import USER_ENV
from tests.prefetch import shared_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@shared_job(runs=2)
def driver_kill_run(tmp_path_factory, model_dir):
    """One driver kill in six steps (`run_driver_kills`, in a background thread: its jobs run from ROOT)."""
    tmp_path = tmp_path_factory.mktemp("driver-kills")
    overrides = [f"model.path={model_dir}", f"model.cache_dir={tmp_path}", f"train.output_dir={tmp_path}/out",
                 "task.num_train=300", "task.num_eval=16", "rollout.rollout_batch_size=4",
                 "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4", "sampling.max_response_len=200",
                 "engine.max_model_len=256", "algorithm.overlong_buffer=8", "learner.lr=1e-3", "train.num_steps=6",
                 "train.eval_every=100", "train.save_every=1", "logging.wandb_mode=disabled", "logging.dashboard=false",
                 "learner.backend=torch", "engine.num_engines=1"]
    # the torch learner and one engine: fewer processes to start in each run (what is checked does not
    # depend on them)
    # A checkpoint every step: the kill, a random part of a step after a step's row, may land while that
    # step's checkpoint is still being written, and the resume must still find the one before it. Long
    # responses: groups finish far apart, so each checkpoint's store holds partial groups (at 24 tokens
    # nearly every sample ran to the cap and whether any group was left partial was down to timing).
    cfg = load_config(str(ROOT / "configs/tiny_cpu.yaml"), overrides)
    args = argparse.Namespace(config="configs/tiny_cpu.yaml", overrides=overrides, driver_kills=1, seed=4)
    return tmp_path, run_driver_kills(cfg, args, USER_ENV)


def test_a_killed_driver_resumes_with_every_prompt_consumed_once(driver_kill_run):
    tmp_path, result = driver_kill_run
    print(json.dumps(result, indent=1))
    assert result["driver_kills"] == 1 and result["runs"][0]["killed_after_step"] in range(1, 4)
    assert result["runs"][1]["finished"] and result["runs"][1]["resumed_from"] is not None
    assert result["prompts_consumed_twice"] == 0 and result["prompts_skipped"] == 0 and result["unknown_groups"] == 0
    assert result["samples_trained_twice"] == 0 and result["steps_completed"] == 6
    assert result["metrics_steps_ok"] and result["group_rows_per_step_ok"]
    assert result["stray_processes"] == 0, result["stray_process_names"]
    # the checkpoint the resume started from held partial groups: each one was trained later, or still waits
    out = tmp_path / "out" / "driver_kills"
    resumed = read_state(out / result["runs"][1]["resumed_from"])
    partial = {g["group_id"] for g in resumed["store"]["partial"]}
    later = {g for r in read_rows(out) if r.get("step", -1) > resumed["step"] for g in r.get("returned", [])}
    final = read_state(out / result["final_checkpoint"])
    assert partial and partial <= later | {g["group_id"] for g in final["store"]["partial"]}
    assert result["ok"]
    assert not list(out.rglob("*.pkl")) and (out / result["final_checkpoint"] / "rollout_state.json").is_file()


def test_tool_calls_across_kills_tell_a_journaled_call_run_again_from_one_cut_by_the_kill():
    from jobs.chaos_driver import ToolRecords, tool_calls_across_kills

    a, b, c = ("e0p1s0", 1), ("e0p1s1", 1), ("e0p2s0", 2)
    # kill 1: a and b had run, only a's result was journaled; the resumed run runs b again (cut by the kill)
    # and a again (journaled: an error), then c; kill 2 finds c journaled, and the last run runs c again.
    kill1 = ToolRecords((a, b), frozenset({a}))
    kill2 = ToolRecords((a, b, b, a, c), frozenset({a, b, c}))
    final = ToolRecords((a, b, b, a, c, c), frozenset({a, b, c}))
    assert tool_calls_across_kills(final, [kill1, kill2]) == {
        "tool_calls": 6, "tool_calls_run_twice": 2, "tool_calls_rerun_unjournaled": 1}
    clean = ToolRecords((a, b, b, c), frozenset({a, b, c}))
    assert tool_calls_across_kills(clean, [kill1])["tool_calls_run_twice"] == 0
