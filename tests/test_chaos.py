"""The chaos job: its accounting check on hand-made records, and a short run with engine kills on a local Ray."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from driver.records import check_records, taken_group_ids
from tests.chaos_asserts import assert_chaos_ok
from tests.conftest import USER_ENV
from tests.prefetch import shared_job

ROOT = Path(__file__).resolve().parents[1]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "groups.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def step_row(step, returned, dropped=None, staleness=None, policy="mask", crashes=0, lost=0):
    return {"step": step, "version": step, "returned": returned,
            "samples": {g: [f"{g}s{i}" for i in range(2)] for g in returned}, "dropped": dropped or {},
            "staleness": staleness or {"0": 10}, "max_versions": 2, "policy": policy,
            "engine_crashes": crashes,
            "crash_tokens_lost": lost}


def end_row(step, epoch, position, partial=(), complete=()):
    return {"step": step, "end": True, "source": {"epoch": epoch, "position": position, "num_examples": 4},
            "store": {"partial": list(partial), "complete": list(complete)}}


def test_taken_group_ids_follow_the_cursor_across_epochs():
    assert taken_group_ids({"epoch": 1, "position": 2, "num_examples": 3}) == ["e0p0", "e0p1", "e0p2", "e1p0", "e1p1"]


def test_check_records_accounts_for_every_group(tmp_path):
    rows = [step_row(0, ["e0p0"], {"e0p1": "zero_reward_variance"}, crashes=1, lost=30),
            step_row(1, ["e0p2"], staleness={"0": 5, "2": 3, "3": 1}),
            end_row(1, 1, 1, partial=["e0p3"], complete=["e1p0"])]
    r = check_records(write_rows(tmp_path, rows), n_samples=2)
    assert r["lost_samples"] == 0 and r["duplicated_samples"] == 0 and r["unknown_groups"] == 0
    assert r["steps_completed"] == 2 and r["groups_taken"] == 5
    assert r["dropped_reasons"] == {"zero_reward_variance": 1}
    assert r["max_trained_staleness"] == 2  # age 3 is masked (max_versions 2)
    assert r["engine_crashes_seen"] == 1 and r["crash_tokens_lost"] == 30


def test_check_records_finds_lost_and_duplicated_samples(tmp_path):
    rows = [step_row(0, ["e0p0", "e0p1"]), step_row(1, ["e0p1"], policy="keep", staleness={"5": 1}),
            end_row(1, 0, 4, partial=["e0p0"])]  # e0p1 trained twice, e0p0 trained and stored, e0p2/e0p3 lost
    rows[0]["samples"]["e0p0"] = ["e0p0s0"]  # and one sample of e0p0 missing from its group
    r = check_records(write_rows(tmp_path, rows), n_samples=2)
    assert r["lost_samples"] == 2 * 2 + 1
    assert r["duplicated_samples"] == 2 + 2
    assert r["max_trained_staleness"] == 5  # keep: nothing masked


def test_the_records_account_for_the_groups_the_over_provisioned_baseline_discards(tmp_path):
    """The real monitor with `rollout.schedule=oversample` on fake engines, logged by the job's `GroupLog`:
    every group taken is returned or discarded, none lost, none counted twice."""
    import asyncio

    from driver.records import GroupLog
    from tests.fakes import make_rollout_parts
    from tests.test_rollout import cfg

    c = cfg(schedule="oversample", over_sampling_batch_size=8)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=5)
    log = GroupLog(tmp_path, c.staleness)

    async def run():
        for step in range(4):
            for e in engines:
                e.update_weights(None, step)
            log.step(step, step, await monitor.step(step, step))

    asyncio.run(run())
    log.end(3, source.state_dict(), store.state_dict())
    r = check_records(tmp_path, n_samples=4)
    assert r["groups_taken"] == 32 and r["groups_returned"] == 16 and r["groups_discarded"] == 16
    assert r["lost_samples"] == r["duplicated_samples"] == r["unknown_groups"] == 0


def test_the_killer_counts_only_the_rows_the_job_finished_writing(tmp_path):
    """The job appends a step's row while the killer reads: a torn last line is not a step yet (it once
    raised in the killer's thread, and the run's second kill never came)."""
    from jobs.chaos import EngineKiller

    killer = EngineKiller(kills=2, num_steps=8, out_dir=tmp_path, seed=15)
    assert killer.steps_done()[0] == 0
    rows = [step_row(0, ["e0p0"]), step_row(1, ["e0p1"])]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "groups.jsonl").write_text(text + json.dumps(step_row(2, ["e0p2"]))[:40])
    assert killer.steps_done()[0] == 2
    (tmp_path / "groups.jsonl").write_text(text + json.dumps(end_row(1, 0, 2)) + "\n")
    assert killer.steps_done()[0] == 2


def chaos_run(tmp_path_factory, model_dir, config: str):
    tmp = tmp_path_factory.mktemp("chaos")
    out = tmp / "chaos.json"
    # seed 15: the kills come after steps 1 and 2 of 8, so a restarted engine has five steps to be seen back
    # (`engine_restarts` counts the restarts the driver saw before the run ended)
    cmd = [sys.executable, "-m", "jobs.chaos", "--config", config, "--kills", "2", "--seed", "15",
           "--json", str(out), f"model.path={model_dir}", f"model.cache_dir={tmp}",
           f"train.output_dir={tmp}/out", "task.num_train=300", "task.num_eval=16", "train.num_steps=8",
           "train.eval_every=4", "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8",
           "rollout.n_samples_per_prompt=4", "sampling.max_response_len=64", "engine.max_model_len=128",
           "staleness.max_versions=1", "algorithm.overlong_buffer=8",
           "logging.dashboard=false", "learner.backend=torch"]  # engine kills: the torch learner starts sooner
    proc = subprocess.run(cmd, cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                          timeout=900)
    return proc, out


@shared_job
def chaos_object_store(tmp_path_factory, model_dir):
    return chaos_run(tmp_path_factory, model_dir, "configs/tiny_cpu.yaml")


@shared_job
def chaos_http(tmp_path_factory, model_dir):
    return chaos_run(tmp_path_factory, model_dir, "configs/tiny_cpu_http.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("run", [pytest.param("chaos_object_store", id="configs/tiny_cpu.yaml"),
                                 pytest.param("chaos_http", id="configs/tiny_cpu_http.yaml")])
def test_chaos_engine_kills_lose_and_repeat_nothing(request, run):
    """Weights through the object store, and over HTTP broadcast into the engines' servers (a publish that
    meets a restarting engine leaves it out; the rebuilt group takes it back)."""
    proc, out = request.getfixturevalue(run)
    r = assert_chaos_ok(proc, out, kills=2, steps=8, bound=1)
    assert r["engine_restarts"] >= 1
