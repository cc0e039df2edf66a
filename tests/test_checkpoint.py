"""Checkpoints without Ray: the rollout state as JSON (exact, validated, no pickle), incomplete checkpoints,
the step logs cut back on resume, and the watchdog that ends a killed driver's local processes."""
import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest

from april_ray.config import StalenessConfig
from april_ray.rollout.store import PartialRolloutStore
from april_ray.tracking import truncate_step_logs, wandb_run_id
from driver.checkpoint import (CheckpointError, find_checkpoint, incomplete_reason, read_state, rollout_state,
                               write_checkpoint)
from driver.output_dir import current_run, start_run
from tests.fakes import make_rollout_parts
from tests.test_rollout import cfg, check_invariants, run_steps

ROOT = Path(__file__).resolve().parents[1]


def save_policy(path):
    (Path(path) / "policy").mkdir()
    (Path(path) / "policy" / "model.safetensors").write_bytes(b"weights" * 100)


def checkpoint_of(out, step, source, store, monitor, version=None):
    state = rollout_state(step, step + 1 if version is None else version, source.state_dict(), store.state_dict(),
                          monitor.state_dict())
    return write_checkpoint(out, state, save_policy, current_run(out))


def test_rollout_state_round_trips_through_json_and_the_run_goes_on_exactly_once(tmp_path):
    c = cfg(max_versions=100)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=3)
    first = asyncio.run(run_steps(monitor, source, store, engines, c, 3))
    assert store.partial, "the test needs partial groups in the checkpoint"
    path = checkpoint_of(tmp_path, 2, source, store, monitor)
    assert not list(path.rglob("*.pkl")) and incomplete_reason(path) is None
    state = read_state(find_checkpoint(tmp_path))

    monitor2, _, source2, store2, engines2 = make_rollout_parts(c, seed=3)  # a new process
    source2.load_state_dict(state["source"])
    store2.load_state_dict(state["store"])
    monitor2.load_state_dict(state["monitor"])
    for gid, g in store.partial.items():  # every sample exactly as saved: ids, logprobs, versions, state
        assert [asdict(s) for s in store2.partial[gid].samples] == [asdict(s) for s in g.samples]
        assert any(s.logprobs for s in g.samples)
    assert [g.group_id for g in store2.complete] == [g.group_id for g in store.complete]

    async def more():
        seen, out = set(), []
        for step in range(3, 7):
            for e in engines2:
                e.update_weights(None, step)
            r = await monitor2.step(step, step)
            check_invariants(r, monitor2, source2, store2, c, seen)
            out.append(r)
        return out

    later = asyncio.run(more())
    before = [g for r in first for g in r.returned_group_ids]
    after = [g for r in later for g in r.returned_group_ids]
    assert len(set(before + after)) == len(before + after)  # no group trained twice
    assert set(store.partial) <= set(after) | set(store2.partial)  # the stored groups resumed or still wait
    taken = {f"e0p{i}" for i in range(source2.position)}  # one epoch here: every id the cursor handed out
    assert taken == set(before) | set(after) | set(store2.partial) | {g.group_id for g in store2.complete}


def partial_state():
    c = cfg(max_versions=100)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=1)
    asyncio.run(run_steps(monitor, source, store, engines, c, 2))
    return json.loads(json.dumps(store.state_dict()))


@pytest.mark.parametrize("edit,message", [
    (lambda s: s["partial"][0]["samples"][1]["logprobs"].__setitem__(0, "x"),
     r"store\.partial\[0\]\.samples\[1\]\.logprobs\[0\]: expected int or float, got 'x'"),
    (lambda s: s["partial"][0]["samples"][0].pop("versions"), r"store\.partial\[0\]\.samples\[0\]\.versions: missing"),
    (lambda s: s["partial"][0]["samples"][0].__setitem__("state", "flying"), r"store\.partial\[0\]\.samples\[0\]: 'flying'"),
    (lambda s: s["partial"][0]["samples"][0]["versions"].append(0), r"samples\[0\]\.versions: \d+ values for \d+ response"),
    (lambda s: s["partial"][0].__setitem__("prompt_index", "7"), r"store\.partial\[0\]\.prompt_index: expected int"),
    (lambda s: s.__setitem__("complete", {}), r"store\.complete: expected list"),
    (lambda s: s["partial"].append(s["partial"][0]), r"store: a group is stored twice"),
])
def test_store_state_errors_name_the_field_and_change_nothing(edit, message):
    state = partial_state()
    store = PartialRolloutStore(StalenessConfig(max_versions=4))
    edit(state)
    with pytest.raises(ValueError, match=message):
        store.load_state_dict(state)
    assert not store.partial and not store.complete


def test_source_state_errors_name_the_field():
    c = cfg()
    _, _, source, _, _ = make_rollout_parts(c, seed=1)
    state = source.state_dict()
    with pytest.raises(ValueError, match=r"source\.position: expected a non-negative integer"):
        source.load_state_dict({**state, "position": -1})
    with pytest.raises(ValueError, match=r"source: the checkpoint was taken on a dataset of 7 rows"):
        source.load_state_dict({**state, "num_examples": 7})


def test_read_state_errors_name_file_and_field(tmp_path):
    c = cfg(max_versions=100)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=3)
    asyncio.run(run_steps(monitor, source, store, engines, c, 2))
    path = checkpoint_of(tmp_path, 1, source, store, monitor)
    file = path / "rollout_state.json"
    good = json.loads(file.read_text())
    for edit, field in ((lambda s: s.__setitem__("schema_version", 99), "schema_version"),
                        (lambda s: s["monitor"].__setitem__("returned_groups", "many"), "monitor.returned_groups"),
                        (lambda s: s["store"]["partial"][0]["samples"][0].__setitem__("reward", "1"),
                         r"store\.partial\[0\]\.samples\[0\]\.reward")):
        state = json.loads(json.dumps(good))
        edit(state)
        file.write_text(json.dumps(state))
        with pytest.raises(CheckpointError, match=f"{file}: {field}"):
            read_state(path)
    file.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{file}: unreadable"):
        read_state(path)


def test_incomplete_checkpoints_fall_back_to_the_last_complete_one_and_say_so(tmp_path):
    c = cfg(max_versions=100)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=3)
    asyncio.run(run_steps(monitor, source, store, engines, c, 1))
    first = checkpoint_of(tmp_path, 9, source, store, monitor)
    second = checkpoint_of(tmp_path, 19, source, store, monitor)
    assert (tmp_path / "latest").read_text() == second.name and find_checkpoint(tmp_path, log=None) == second

    weights = second / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short
    said = []
    assert find_checkpoint(tmp_path, said.append) == first
    assert "ckpt-000019 is incomplete (policy/model.safetensors has 100 bytes" in said[0]
    assert "latest names ckpt-000019, but ckpt-000009 is the newest complete one" in said[1]

    (second / "manifest.json").unlink()  # a crash before the manifest, the last file of a save
    said.clear()
    assert find_checkpoint(tmp_path, said.append) == first and "no manifest.json" in said[0]

    (tmp_path / ".tmp-ckpt-000029").mkdir()  # a save the kill interrupted
    (tmp_path / "latest").write_text("ckpt-000039")  # a pointer at a directory that is gone
    said.clear()
    assert find_checkpoint(tmp_path, said.append) == first
    assert "ckpt-000039 is incomplete (missing)" in said[0] and ".tmp-ckpt-000029 is incomplete (not finished" in said[1]

    checkpoint_of(tmp_path, 49, source, store, monitor)  # the next save clears the unfinished one
    assert not list(tmp_path.glob(".tmp-*"))
    for path in tmp_path.glob("ckpt-*"):
        (path / "manifest.json").unlink(missing_ok=True)
    said.clear()
    assert find_checkpoint(tmp_path, said.append) is None and "no complete checkpoint" in said[-1]


def test_a_resume_takes_only_its_own_runs_checkpoints_never_an_earlier_runs(tmp_path):
    """A fresh job in a directory an earlier run left checkpoints in starts a run of its own; resumed, it
    goes on from its own newest checkpoint, or from step 0 when it has none yet, never from the earlier
    run's (newer-numbered) ones."""
    c = cfg(max_versions=100)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=3)
    asyncio.run(run_steps(monitor, source, store, engines, c, 1))
    old_run = start_run(tmp_path, resume=False)
    old = checkpoint_of(tmp_path, 199, source, store, monitor)
    assert start_run(tmp_path, resume=True) == old_run and find_checkpoint(tmp_path, print, old_run) == old

    new_run = start_run(tmp_path, resume=False)  # a fresh job in the same directory
    assert new_run != old_run and start_run(tmp_path, resume=True) == new_run
    said = []
    assert find_checkpoint(tmp_path, said.append, new_run) is None  # killed before its first save
    assert f"ckpt-000199 belongs to an earlier run ({old_run}" in said[0]
    mine = checkpoint_of(tmp_path, 19, source, store, monitor)
    said.clear()
    assert find_checkpoint(tmp_path, said.append, new_run) == mine
    assert "ckpt-000199 belongs to an earlier run" in said[0]
    (tmp_path / "run").unlink()  # checkpoints copied into a new directory: the newest one's run goes on
    assert start_run(tmp_path, resume=True) == new_run and (tmp_path / "run").read_text() == new_run
    assert (tmp_path / "latest").is_file()
    start_run(tmp_path, resume=False)  # a fresh job drops the pointer at the earlier run's checkpoint
    assert not (tmp_path / "latest").exists()
    legacy = json.loads((old / "manifest.json").read_text())
    legacy.pop("run")  # written before run ids: any run's
    (old / "manifest.json").write_text(json.dumps(legacy))
    assert find_checkpoint(tmp_path, print, new_run) == old  # (the newest complete one of no run)


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_checkpoint_is_refused_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    old = tmp_path / "ckpt-000010"
    old.mkdir()
    (old / "state.pkl").write_bytes(pickle.dumps({"step": 10, "x": Payload(marker)}))
    (tmp_path / "latest").write_text(old.name)
    with pytest.raises(CheckpointError, match=r"ckpt-000010/state\.pkl: .*refused, never unpickled"):
        find_checkpoint(tmp_path, log=None)
    assert not marker.exists()


def test_step_logs_are_cut_back_to_the_checkpoint(tmp_path):
    rows = [{"step": s, "train/version": s + 1} for s in range(6)] + [{"step": 6, "eval/accuracy_t1": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "tr')
    groups = [{"step": s, "returned": [f"e0p{s}"]} for s in range(6)] + [{"note": "no step field"}]
    (tmp_path / "groups.jsonl").write_text("".join(json.dumps(r) + "\n" for r in groups))
    said = []
    truncate_step_logs(tmp_path, 2, said.append)
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 1, 2]
    kept = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert kept == groups[:3] + [{"note": "no step field"}]
    assert len(said) == 2 and "dropped 5 rows past step 2 (the last one torn" in said[1]
    truncate_step_logs(tmp_path, 2, said.append)  # nothing more to drop: files untouched, nothing said
    assert len(said) == 2


def test_the_wandb_run_id_is_kept_for_a_resume(tmp_path):
    first = wandb_run_id(tmp_path, resume=False)
    assert wandb_run_id(tmp_path, resume=True) == first
    assert wandb_run_id(tmp_path, resume=False) != first


DRIVER = """
import subprocess, sys, time
from driver.cluster import tie_to_driver
# a child that outlives its parent on its own (its own session, no parent-death signal), as Ray's agents did
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
tie_to_driver()
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_watchdog_ends_a_sigkilled_drivers_processes():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(driver.stdout.readline()))  # printed after tie_to_driver: the watchdog has seen it
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    gone, alive = psutil.wait_procs([child], timeout=15)
    for p in alive:
        p.kill()
    assert gone and not alive


def test_a_redone_steps_checkpoint_replaces_the_old_one_without_a_moment_with_neither(tmp_path, monkeypatch):
    """Saving a step's checkpoint again (a resumed run redoing it) moves the old one aside before the new
    one takes its place: a kill in between leaves the old one, which a resume finds."""
    import driver.checkpoint as ck

    c = cfg(max_versions=100)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=3)
    asyncio.run(run_steps(monitor, source, store, engines, c, 1))
    first = checkpoint_of(tmp_path, 9, source, store, monitor)
    renames = []
    real_rename = Path.rename

    def killed_after_moving_aside(self, target):
        renames.append(Path(target).name)
        if Path(target).name == first.name:  # the new one's rename: the kill comes first
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_of(tmp_path, 9, source, store, monitor)
    monkeypatch.undo()
    assert renames == [f".old-{first.name}", first.name] and not first.exists()
    found = find_checkpoint(tmp_path, lambda _: None)
    assert found == tmp_path / f".old-{first.name}" and read_state(found)["step"] == 9
    assert checkpoint_of(tmp_path, 9, source, store, monitor) == first and not found.exists()
