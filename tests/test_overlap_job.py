"""The overlapped mode (train.overlap=true) as a user runs it: the training job on a local Ray, read back
from its own records."""
import json

import pytest

from driver.records import check_records
from tests.prefetch import shared_job

pytestmark = pytest.mark.slow


@shared_job
def overlap_ahead_run(tmp_path_factory, model_dir):
    """overlap_run's job (conftest.py) two steps ahead (train.overlap_ahead=2): five steps, a checkpoint after
    the third, run once."""
    from tests.conftest import USER_ENV
    from tests.local_job import SMALL, run_job, train_command

    tmp = tmp_path_factory.mktemp("overlap-ahead-job")
    cmd = train_command("configs/tiny_cpu.yaml", model_dir, tmp, *SMALL, "train.overlap=true", "train.overlap_ahead=2",
                        "train.num_steps=5", "train.save_every=3", "train.eval_every=5", "logging.dashboard=false",
                        "sampling.max_response_len=200", "engine.max_model_len=256", "learner.backend=torch")
    return tmp, run_job(cmd, tmp / "out", {**USER_ENV, "RAY_ADDRESS": ""})


def test_an_overlapped_job_keeps_groups_running_between_steps_and_accounts_for_every_one(overlap_run):
    """Five steps, a checkpoint after the third (conftest.py's `overlap_run`): a kept step leaves groups
    running on the engines, the step before the checkpoint and the last drain; every group taken is trained
    once or stored; evaluations name the version they evaluated; the job reports the engines' and the
    learner's idle shares."""
    tmp_path, proc = overlap_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "end" not in r]
    # steps 0, 1 and 3 keep theirs running only when the monitor had the step after them asked for before their
    # N-th group completed (on a loaded machine that call can come late for any one of them)
    running = [bool(r["running"]) for r in steps]
    assert any(running) and not running[2] and not running[4]
    assert all(set(r["running"]).isdisjoint(r["returned"]) for r in steps)
    records = check_records(out, n_samples=4)
    assert records["complete_record"] and records["steps_completed"] == 5
    assert records["lost_samples"] == 0 and records["duplicated_samples"] == 0 and records["unknown_groups"] == 0
    assert records["groups_returned"] == 5 * 4
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in metrics if "eval/version" in r]
    assert [r["eval/version"] for r in evals] == [2, 4, 5]  # after steps 1 and 3, and at the end
    trained = [r for r in metrics if "train/version" in r]
    assert all(0 <= r["job/engine_idle_fraction"] <= 1 and 0 <= r["job/learner_idle_fraction"] <= 1 for r in trained)
    assert any(r["rollout/off_policy_token_ratio"] > 0 for r in trained)  # tokens sampled before an update
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_version"] == 5 and 0 <= summary["engine_idle_fraction"] <= 1
    assert (out / "ckpt-000002").is_dir() and (out / "ckpt-000004").is_dir()


def test_a_job_two_steps_ahead_accounts_for_every_group_and_drains_at_the_checkpoint(overlap_ahead_run):
    """train.overlap_ahead=2: the step before the checkpoint and the last drain, the checkpoint is taken, every
    group taken is trained once or stored, and no token older than staleness.max_versions is trained."""
    tmp_path, proc = overlap_ahead_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    steps = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "end" not in r]
    assert not steps[2]["running"] and not steps[4]["running"]
    assert all(set(r["running"]).isdisjoint(r["returned"]) for r in steps)
    records = check_records(out, n_samples=4)
    assert records["complete_record"] and records["steps_completed"] == 5
    assert records["lost_samples"] == 0 and records["duplicated_samples"] == 0 and records["unknown_groups"] == 0
    assert records["groups_returned"] == 5 * 4
    assert records["max_trained_staleness"] <= steps[0]["max_versions"] == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_version"] == 5 and (out / "ckpt-000002").is_dir()
