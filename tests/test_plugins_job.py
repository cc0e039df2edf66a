"""Plug-in contracts end to end: the training job with a reward function and a dataset defined outside the
repository, by path (`PYTHONPATH=DIR python -m jobs.train ... task.reward_fn=mymod:score`)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from april_ray.config import TaskConfig
from april_ray.task import countdown
from tests.conftest import USER_ENV
from tests.prefetch import shared_job

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


def run_with_plugin(tmp_path, model_dir, user_env, module: str, source: str, *overrides: str, steps: int = 3,
                    expect_rc: int = 0):
    """`jobs.train` for `steps` steps with `module` (its `source`) and a dataset in a directory outside the
    repository, on its PYTHONPATH; returns (that directory, the job's output directory, its stderr)."""
    plug = tmp_path / "plug"
    plug.mkdir(parents=True)
    (plug / f"{module}.py").write_text(source)
    rows = countdown.generate(TaskConfig(), 316, seed=11)
    for name, part in (("train", rows[:300]), ("eval", rows[300:])):
        (plug / f"{name}.jsonl").write_text("".join(json.dumps(r | {"split": name, "row": i}) + "\n"
                                                    for i, r in enumerate(part)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jobs.train", "--config", "configs/tiny_cpu.yaml", f"model.path={model_dir}",
           f"model.cache_dir={tmp_path}", f"train.output_dir={out}", f"task.train_path={plug / 'train.jsonl'}",
           f"task.eval_path={plug / 'eval.jsonl'}", *overrides, f"train.num_steps={steps}",
           "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4",
           "sampling.max_response_len=24", "engine.max_model_len=64", "train.eval_every=10", "train.save_every=10",
           "train.eval_greedy=false", "learner.backend=torch", "logging.dashboard=false",
           "logging.wandb_mode=disabled", "--summary", f"{tmp_path}/summary.json"]
    env = {**user_env, "PYTHONPATH": str(plug), "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == expect_rc, proc.stderr[-4000:]
    return plug, out, proc.stderr


JOB_ENV = {**USER_ENV, "RAY_ADDRESS": ""}
"""The user's environment (`user_env`), for the jobs started ahead."""


@shared_job
def reward_fn_run(tmp_path_factory, model_dir):
    tmp_path = tmp_path_factory.mktemp("reward-fn")
    return tmp_path, *run_with_plugin(tmp_path, model_dir, JOB_ENV, "mymod", MYMOD, "task.reward_fn=mymod:score",
                                      "engine.num_engines=1")


def test_reward_fn_and_dataset_from_outside_the_repository(reward_fn_run):
    tmp_path, plug, out, _ = reward_fn_run

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


@shared_job
def group_reward_fn_run(tmp_path_factory, model_dir):
    # two sequences at a time per engine: a group's samples run in turns, so when the fourth group finishes the
    # other four are still queued or generating, and the abort splits them (with the whole batch in one decode
    # step, a random model's 24-token samples can all finish together and nothing is ever resumed)
    tmp_path = tmp_path_factory.mktemp("group-reward-fn")
    return tmp_path, *run_with_plugin(tmp_path, model_dir, JOB_ENV, "groupmod", GROUPMOD,
                                      "task.reward_fn=groupmod:judge", "task.reward_per_group=true",
                                      "engine.max_num_seqs=2")


def test_group_reward_fn_from_outside_the_repository(group_reward_fn_run):
    """task.reward_per_group: the group function is called once per group, with the whole group, and its
    values are the rewards the learner trains on; held-out evaluation calls it with groups of one."""
    tmp_path, plug, out, _ = group_reward_fn_run

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


BADMOD = '''
import os

def plain_episode(ep):
    return None

def two_args(prompt, response):
    return 1.0

async def flaky(ep, fail_all=False):
    """Raises for every sample (fail_all) or for each group's last sample in one group of two."""
    await ep.generate()
    last = ep.sample.sample_id.endswith("s3") and int(ep.sample.group_id.rsplit("p", 1)[1]) % 2
    if fail_all or last:
        raise RuntimeError(f"environment broke on {ep.sample.sample_id}")
    return None
'''


@pytest.mark.parametrize("override,message", [
    ("rollout.episode_fn=nowhere_env:episode", "rollout.episode_fn: cannot import 'nowhere_env'"),
    ("rollout.episode_fn=badmod:plain_episode", "rollout.episode_fn: plain_episode(ep) in "),
    ("task.reward_fn=badmod:two_args", "task.reward_fn: two_args(prompt, response) in "),
])
def test_a_bad_plugin_stops_the_job_before_ray_starts_in_one_line(tmp_path, random_model_dir, user_env, override,
                                                                   message):
    _, out, stderr = run_with_plugin(tmp_path, random_model_dir, user_env, "badmod", BADMOD, override, expect_rc=2)
    assert stderr.count("\n") == 1 and message in stderr and "Traceback" not in stderr, stderr
    assert not (out / "metrics.jsonl").exists()


@shared_job(runs=2)
def raising_episode_runs(tmp_path_factory, model_dir):
    """Two jobs with BADMOD's `flaky` episode: one group in two raising, then every one."""
    tmp_path = tmp_path_factory.mktemp("raising-episode")
    some = run_with_plugin(tmp_path / "some", model_dir, JOB_ENV, "badmod", BADMOD,
                           "rollout.episode_fn=badmod:flaky", "engine.num_engines=1", steps=2)
    every = run_with_plugin(tmp_path / "all", model_dir, JOB_ENV, "badmod", BADMOD, "rollout.episode_fn=badmod:flaky",
                            "rollout.episode_kwargs={fail_all: true}", "engine.num_engines=1", steps=2, expect_rc=1)
    return some, every


def test_a_raising_episode_is_not_trained_and_a_step_where_all_raise_stops_the_job(raising_episode_runs):
    """One group in two has a sample whose episode raises: those groups are dropped (recorded with each error),
    the batch is full of the others; with every episode raising, the job stops in its first step, with the
    error."""
    (_, out, _), every = raising_episode_runs
    rows = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "end" not in r]
    failed = {sid for r in steps for sid in r["episode_errors"]}
    trained = {sid for r in steps for ids in r["samples"].values() for sid in ids}
    assert failed and not failed & trained and all(len(r["returned"]) == 4 for r in steps)
    assert all(e == f"RuntimeError: environment broke on {sid}"
               for r in steps for sid, e in r["episode_errors"].items())
    assert {g for r in steps for g, why in r["dropped"].items() if why == "episode_error"} == {s[:-2] for s in failed}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(m.get("rollout/episode_errors", 0) for m in metrics) == len(failed)

    _, out, stderr = every
    assert "step 0: every sample of the" in stderr and "RuntimeError: environment broke on e0p" in stderr
    assert not (out / "metrics.jsonl").exists() or "train/version" not in (out / "metrics.jsonl").read_text()
