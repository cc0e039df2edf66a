"""The overlapped mode (train.overlap=true) as a user runs it: the training job on a local Ray, read back
from its own records."""
import json

import pytest

from driver.records import check_records

pytestmark = pytest.mark.slow


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
