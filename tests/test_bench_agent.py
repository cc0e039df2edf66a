"""jobs.bench.agent without running a job: each mode's command, the agent counters summed over training rows
only, and the gains' report."""
import json
from argparse import Namespace
from pathlib import Path

import pytest

from jobs.bench.agent import agent_totals, report, run_command


def test_the_agent_mode_replaces_the_episode_function_and_each_seed_seeds_both_sides():
    args = Namespace(config="configs/tiny_agent_cpu.yaml", overrides=["train.num_steps=4"], agent_fn="m:agent")
    episode, agent = (run_command(args, mode, 2, Path("/o")) for mode in ("episode", "agent"))
    assert "rollout.agent_fn=m:agent" in agent and not any(a.startswith("rollout.agent_fn") for a in episode)
    for cmd in (episode, agent):
        assert {"train.seed=2", "engine.seed=2", "train.num_steps=4"} <= set(cmd)
        assert cmd.index("train.num_steps=4") > cmd.index("train.num_steps=40")  # the caller's override wins
    assert agent[-1] == "/o/agent_seed2.json" and "train.output_dir=/o/agent/seed2" in agent


def test_agent_totals_sum_the_training_rows_only(tmp_path):
    rows = [{"step": 0, "train/version": 1, "rollout/agent_requests": 10.0, "rollout/agent_resumed": 2.0},
            {"step": 1, "eval/accuracy_t1": 0.3, "rollout/agent_requests": 99.0},  # not a training row
            {"step": 1, "train/version": 2, "rollout/agent_requests": 5.0, "rollout/agent_mismatch": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert agent_totals(tmp_path / "metrics.jsonl") == {"rollout/agent_requests": 15.0, "rollout/agent_resumed": 2.0,
                                                        "rollout/agent_mismatch": 1.0, "rollout/agent_errors": 0}


def test_the_report_gives_each_modes_gains_and_the_ratio_of_their_means():
    runs = [{"mode": m, "seed": s, "gain": g, "time_s": {"rollout_s": t}}
            for m, s, g, t in [("episode", 0, 0.08, 100), ("agent", 0, 0.04, 300),
                               ("episode", 1, 0.10, 110), ("agent", 1, 0.08, 250)]]
    r = report(runs, "cmd")
    assert r["modes"]["episode"]["gain_mean"] == pytest.approx(0.09) and r["modes"]["agent"]["gains"] == [0.04, 0.08]
    assert r["gain_ratio"] == pytest.approx(0.06 / 0.09) and r["rollout_s_ratio"] == pytest.approx(275 / 105)
    assert "gain_ratio" not in report(runs[:1], "cmd")  # one mode alone: nothing to compare
