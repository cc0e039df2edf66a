"""Plug-in contracts end to end: the training job with a reward function and a dataset defined outside the
repository, by path (`PYTHONPATH=DIR python -m jobs.train ... task.reward_fn=mymod:score`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from april_ray.config import TaskConfig
from april_ray.task import countdown

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

MYMOD = '''
import json, os

def score(prompt, response, answer, metadata):
    """1.0 for an even-length response, 0.25 for an odd one (never the countdown's 0 of a random model);
    every call appended to calls.jsonl."""
    value = 1.0 if len(response) % 2 == 0 else 0.25
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"prompt": prompt, "response": response, "metadata": metadata, "reward": value}) + "\\n")
    return value
'''


def run_with_plugin(tmp_path, model_dir, user_env, module: str, source: str, *overrides: str):
    """`jobs.train` for 3 steps with `module` (its `source`) and a dataset in a directory outside the repository,
    on its PYTHONPATH; returns (that directory, the job's output directory)."""
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / f"{module}.py").write_text(source)
    rows = countdown.generate(TaskConfig(), 316, seed=11)
    for name, part in (("train", rows[:300]), ("eval", rows[300:])):
        (plug / f"{name}.jsonl").write_text("".join(json.dumps(r | {"split": name, "row": i}) + "\n"
                                                    for i, r in enumerate(part)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jobs.train", "--config", "configs/tiny_cpu.yaml", f"model.path={model_dir}",
           f"model.cache_dir={tmp_path}", f"train.output_dir={out}", f"task.train_path={plug / 'train.jsonl'}",
           f"task.eval_path={plug / 'eval.jsonl'}", *overrides, "train.num_steps=3",
           "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4",
           "sampling.max_response_len=24", "engine.max_model_len=64", "train.eval_every=10", "train.save_every=10",
           "train.eval_greedy=false", "learner.backend=torch", "--summary", f"{tmp_path}/summary.json"]
    env = {**user_env, "PYTHONPATH": str(plug), "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return plug, out


def test_reward_fn_and_dataset_from_outside_the_repository(tmp_path, random_model_dir, user_env):
    plug, out = run_with_plugin(tmp_path, random_model_dir, user_env, "mymod", MYMOD, "task.reward_fn=mymod:score")

    calls = [json.loads(line) for line in (plug / "calls.jsonl").read_text().splitlines()]
    train_calls = [c for c in calls if c["metadata"]["split"] == "train"]
    eval_calls = [c for c in calls if c["metadata"]["split"] == "eval"]
    assert all(set(c["metadata"]) == {"split", "row"} for c in calls)  # the row's other fields, nothing else
    assert len(eval_calls) == 2 * 16  # held-out before and after, one response per prompt, at temperature 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["accuracy_before"] == sum(c["reward"] for c in eval_calls[:16]) / 16

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/version" in m]
    groups = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    trained = [sum(len(ids) for ids in g["samples"].values()) for g in groups if "samples" in g]
    assert len(steps) == 3 and trained == [16, 16, 16]
    assert len(train_calls) >= sum(trained)  # every finished sample was scored by the function
    for m, n in zip(steps, trained):
        # the learner trained on the function's values: n rewards, each 1.0 or 0.25, averaging to this mean
        assert m["train/reward_mean"] == pytest.approx(m["rollout/reward_mean"])
        num_even = (n * m["train/reward_mean"] - 0.25 * n) / 0.75
        assert abs(num_even - round(num_even)) < 1e-6 and 0 <= round(num_even) <= n, m["train/reward_mean"]
    assert sum(m["train/reward_mean"] * n for m, n in zip(steps, trained)) > 0  # the countdown would score 0
    assert {c["reward"] for c in train_calls} <= {1.0, 0.25}


GROUPMOD = '''
import json, os

def judge(prompts, responses, answers, metadatas):
    """The group's responses ranked by length (ties in order) as 0, 1/(n-1), ..., 1, so every group's rewards
    average 0.5 (a group of one scores 1.0); every call appended to calls.jsonl."""
    n = len(responses)
    values = [0.0] * n
    for rank, i in enumerate(sorted(range(n), key=lambda i: len(responses[i]))):
        values[i] = rank / (n - 1) if n > 1 else 1.0
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"rows": [[m["split"], m["row"]] for m in metadatas], "values": values}) + "\\n")
    return values
'''


def test_group_reward_fn_from_outside_the_repository(tmp_path, random_model_dir, user_env):
    """task.reward_per_group: the group function is called once per group, with the whole group, and its
    values are the rewards the learner trains on; held-out evaluation calls it with groups of one."""
    # two sequences at a time per engine: a group's samples run in turns, so when the fourth group finishes the
    # other four are still queued or generating, and the abort splits them (with the whole batch in one decode
    # step, a random model's 24-token samples can all finish together and nothing is ever resumed)
    plug, out = run_with_plugin(tmp_path, random_model_dir, user_env, "groupmod", GROUPMOD,
                                "task.reward_fn=groupmod:judge", "task.reward_per_group=true", "engine.max_num_seqs=2")

    calls = [json.loads(line) for line in (plug / "calls.jsonl").read_text().splitlines()]
    train_calls = [c for c in calls if c["rows"][0][0] == "train"]
    eval_calls = [c for c in calls if c["rows"][0][0] == "eval"]
    assert len(eval_calls) == 2 * 16 and all(len(c["rows"]) == 1 for c in eval_calls)
    assert json.loads((tmp_path / "summary.json").read_text())["accuracy_before"] == 1.0
    # each call scores one whole group (four samples of one prompt), and no group is scored twice
    assert all(len(c["rows"]) == 4 and len({tuple(r) for r in c["rows"]}) == 1 for c in train_calls)
    assert len({tuple(c["rows"][0]) for c in train_calls}) == len(train_calls) >= 3 * 4

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/version" in m]
    assert len(steps) == 3 and sum(m["rollout/groups_resumed"] for m in steps) > 0  # groups split by aborts
    for m in steps:  # the learner trained on the function's values: every group's average 0.5
        assert m["train/reward_mean"] == pytest.approx(0.5) and m["rollout/reward_mean"] == pytest.approx(0.5)
        assert m.get("rollout/reward_errors", 0) == 0
