"""Checkpoints hold tensors and JSON only, and runs never erase each other: a pickle in place of a state file
is refused by name and never run, the manifest's sha256 and the `latest` pointer are checked, a fresh run
sets an earlier one aside, and a resume with nothing usable stops instead of starting over."""
import asyncio
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from april_ray.config import AlgorithmConfig, LearnerConfig, TrainConfig
from april_ray.learn.learner import Learner
from april_ray.learn.safe_state import StateFileError, load_state, save_state
from driver.checkpoint import CheckpointError, _sha256, check_contents, find_checkpoint, rollout_state, write_checkpoint
from driver.output_dir import current_run, open_run
from tests.conftest import USER_ENV
from tests.fakes import make_rollout_parts
from tests.prefetch import shared_job
from tests.test_learner import batch_from_policy
from tests.test_rollout import cfg, run_steps


class Payload:
    """A pickle that creates `marker` when it is loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def save_policy(path):
    (Path(path) / "policy").mkdir()
    save_state({"w": torch.ones(3)}, Path(path) / "policy" / "model.safetensors")
    (Path(path) / "optimizer.safetensors").write_bytes((Path(path) / "policy" / "model.safetensors").read_bytes())


def checkpoint(out: Path, step: int) -> Path:
    store = {"partial": [], "complete": [], "num_restarted_samples": 0}
    state = rollout_state(step, step + 1, {}, store, {"returned_groups": 0, "dropped_groups": 0, "over_sampling": {}})
    return write_checkpoint(out, state, save_policy, current_run(out))


def put_pickles(ckpt: Path, marker: Path, suffixes=(".pt", ".bin", ".safetensors")) -> list[Path]:
    """Replace every pickle-capable file of `ckpt` with a pickle that creates `marker`; the manifest is
    rewritten to match (sizes and sha256), as an attacker who can write the directory would."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    replaced = []
    for name in manifest["files"]:
        f = ckpt / name
        if f.suffix in suffixes:
            f.write_bytes(pickle.dumps({"state": Payload(marker)}))
            replaced.append(f)
    for name, entry in manifest["files"].items():
        f = ckpt / name
        if isinstance(entry, dict):
            entry.update(size=f.stat().st_size, sha256=_sha256(f))
        else:  # the manifest of an april-ray before sha256: sizes only
            manifest["files"][name] = f.stat().st_size
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return replaced


def test_state_files_round_trip_without_pickle(tmp_path):
    from collections import OrderedDict

    state = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)}},
                           "param_groups": [{"params": [0], "betas": (0.9, 0.99), "foreach": None}]},
             "shapes": [OrderedDict(w=torch.Size([2, 3]))], "names": {"a", "b"}, "steps": 7}
    flat = torch.arange(6.0)
    state["views"] = [flat[:3], flat[3:]]  # one buffer's views: safetensors needs each on its own
    save_state(state, tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.safetensors")
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], torch.arange(4.0))
    assert back["shapes"] == state["shapes"] and back["names"] == {"a", "b"} and back["steps"] == 7
    assert torch.equal(torch.cat(back["views"]), flat)
    with pytest.raises(TypeError, match=r"state\['bad'\]: a .*Payload cannot be saved"):
        save_state({"bad": Payload("x")}, tmp_path / "t.safetensors")


def test_a_pickle_in_a_state_file_is_refused_by_name_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    f = tmp_path / "optimizer.safetensors"
    f.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(StateFileError, match=rf"{f}: not a safetensors state file"):
        load_state(f)
    assert not marker.exists()


def deepspeed_learner(model_dir, port):
    return Learner(str(model_dir), LearnerConfig(backend="deepspeed", zero_stage=1, lr=1e-3), AlgorithmConfig(),
                   temperature=1.0, max_response_len=32, master_port=port)


def optimizer_tensors(learner) -> list[torch.Tensor]:
    sd = learner.optim.model.optimizer.state_dict()
    found = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            found.append(o.detach().clone())
        elif isinstance(o, dict):
            [walk(v) for v in o.values()]
        elif isinstance(o, (list, tuple)):
            [walk(v) for v in o]
    walk(sd)
    return found


def _deepspeed_round_trip(rank, world, port, model_dir, tmp, out):
    """One DeepSpeed rank (in a rank process: one default process group per process): save, move on, load back,
    then pickles in place of its state files."""
    tmp = Path(tmp)
    learner = deepspeed_learner(model_dir, port)
    batch = batch_from_policy(model_dir)
    learner.train_step(batch, version=0)
    saved = optimizer_tensors(learner)
    learner.save(tmp, str(model_dir))
    files = sorted((tmp / "optimizer").rglob("*.pt"))
    out["files"], out["py_files"] = len(files), len(list(tmp.rglob("*.py")))
    for f in files:
        load_state(f)  # each a safetensors state file
    learner.train_step(batch, version=1)  # the state moves on ...
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(saved, optimizer_tensors(learner)))
    learner.load(tmp)  # ... and comes back as saved
    out["restored"] = all(torch.equal(a, b) for a, b in zip(saved, optimizer_tensors(learner)))
    marker = tmp / "pwned"
    for f in files:
        f.write_bytes(pickle.dumps({"module": Payload(marker)}))
    try:
        learner.load(tmp)
        out["refused"] = ""
    except StateFileError as e:
        out["refused"] = str(e)
    out["marker"] = marker.exists()


def test_deepspeed_state_is_saved_as_safetensors_and_a_pickle_put_in_its_place_never_runs(random_model_dir, tmp_path):
    """DeepSpeed's own checkpoint engine unpickles its `.pt` files; ours writes and reads safetensors. The
    state comes back exactly; pickles in place of its files are refused by name and do not run."""
    from tests.ranks import run_ranks

    out = run_ranks(_deepspeed_round_trip, 1, str(random_model_dir), str(tmp_path))
    assert out["files"] and not out["py_files"] and out["moved"] and out["restored"]
    assert re.search(r"optimizer/state/.*\.pt: not a safetensors state file", out["refused"]), out["refused"]
    assert not out["marker"]


def test_check_contents_names_a_pickle_even_with_a_matching_manifest(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = checkpoint(tmp_path, 9)
    put_pickles(ckpt, marker, suffixes=(".safetensors",))
    assert find_checkpoint(tmp_path, log=None) == ckpt  # sizes and sha256 match: only the contents tell
    with pytest.raises(CheckpointError, match=r"ckpt-000009/optimizer\.safetensors: not a safetensors file"):
        check_contents(ckpt)
    assert not marker.exists()


def test_a_changed_file_of_the_same_size_fails_its_sha256(tmp_path):
    first, second = checkpoint(tmp_path, 9), checkpoint(tmp_path, 19)
    weights = second / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    said = []
    assert find_checkpoint(tmp_path, said.append) == first
    assert "policy/model.safetensors: sha256 differs from the manifest's" in said[0]


@pytest.mark.parametrize("pointer", ["../elsewhere/ckpt-000999", "/tmp/ckpt-000999", "ckpt-000009/../../x"])
def test_latest_outside_the_output_directory_is_refused(tmp_path, pointer):
    out = tmp_path / "out"
    out.mkdir()
    checkpoint(tmp_path / "elsewhere", 999)
    checkpoint(out, 9)
    (out / "latest").write_text(pointer)
    with pytest.raises(CheckpointError, match=r"out/latest: names .* not a ckpt-<step> directory"):
        find_checkpoint(out, log=None)


def test_a_manifest_whose_files_is_not_an_object_is_incomplete_not_a_crash(tmp_path):
    first, second = checkpoint(tmp_path, 9), checkpoint(tmp_path, 19)
    (second / "manifest.json").write_text(json.dumps({"schema": "april-ray/rollout-state", "files": []}))
    said = []
    assert find_checkpoint(tmp_path, said.append) == first
    assert "manifest.json: files must be an object" in said[0]


def test_a_fresh_run_sets_the_earlier_one_aside_intact(tmp_path):
    fresh = TrainConfig(resume=False)
    assert open_run(tmp_path, fresh) is None
    run = (tmp_path / "run").read_text()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "notes.txt").write_text("the user's")
    ckpt = checkpoint(tmp_path, 9)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    said = []
    assert open_run(tmp_path, fresh, said.append) is None
    aside = tmp_path / "runs" / run
    assert f"its 4 files moved to {aside}" in said[0]
    for rel, data in before.items():
        moved = tmp_path / rel if rel.name == "notes.txt" else aside / rel
        assert moved.read_bytes() == data, rel
    assert (tmp_path / "run").read_text() != run and not (tmp_path / "metrics.jsonl").exists()
    assert open_run(aside, TrainConfig(resume=True), said.append) == aside / ckpt.name  # resumable where it went


def test_a_resume_that_finds_only_rejected_checkpoints_stops_unless_told_to_start_over(tmp_path):
    open_run(tmp_path, TrainConfig(resume=False))
    run = (tmp_path / "run").read_text()
    ckpt = checkpoint(tmp_path, 49)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(50)))
    (ckpt / "rollout_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*ckpt-000049: rollout_state\.json has .*"
                                              r"train\.start_over=true"):
        open_run(tmp_path, TrainConfig(resume=True), log=lambda _: None)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 50 and ckpt.is_dir()
    assert open_run(tmp_path, TrainConfig(resume=True, start_over=True), log=lambda _: None) is None
    assert (tmp_path / "runs" / run / "ckpt-000049").is_dir() and (tmp_path / "run").read_text() != run


ROOT = Path(__file__).resolve().parents[1]


def run_job(tmp_path, model_dir, env, *overrides):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "jobs.train", "--config", "configs/tiny_cpu.yaml", f"model.path={model_dir}",
           f"model.cache_dir={tmp_path}", f"train.output_dir={tmp_path}/out", "task.num_train=300", "task.num_eval=16",
           "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4",
           "sampling.max_response_len=24", "engine.max_model_len=64", "train.num_steps=2", "train.eval_every=1000",
           "train.save_every=2", "train.eval_greedy=false", "logging.wandb_mode=disabled", "logging.dashboard=false",
           "engine.num_engines=1", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def files_of(path: Path) -> dict:
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@shared_job(runs=2)
def fresh_twice_then_tampered(tmp_path_factory, model_dir) -> dict:
    """As a user runs it: the same command twice; then pickles in place of the second run's tensor files, its
    manifest rewritten to match, and a resume. What each step left, for the test to judge."""
    tmp_path = tmp_path_factory.mktemp("fresh-twice")
    out, env = tmp_path / "out", {**USER_ENV, "RAY_ADDRESS": ""}
    seen = {"first": run_job(tmp_path, model_dir, env)}
    if seen["first"].returncode:
        return seen
    seen["run"] = (out / "run").read_text()
    seen["kept"] = files_of(out / "ckpt-000001") | {Path("metrics.jsonl"): (out / "metrics.jsonl").read_bytes()}
    seen["second"] = run_job(tmp_path, model_dir, env)
    if seen["second"].returncode:
        return seen
    aside = out / "runs" / seen["run"]
    seen["aside"] = files_of(aside / "ckpt-000001") | {Path("metrics.jsonl"): (aside / "metrics.jsonl").read_bytes()}
    seen["run_now"], seen["ckpt_kept"] = (out / "run").read_text(), (out / "ckpt-000001").is_dir()
    marker = tmp_path / "pwned"
    seen["replaced"] = put_pickles(out / "ckpt-000001", marker)
    seen["resumed"] = run_job(tmp_path, model_dir, env, "train.resume=true", "train.num_steps=4")
    seen["pickle_ran"] = marker.exists()
    return seen


@pytest.mark.slow
def test_two_fresh_jobs_keep_both_runs_and_a_tampered_checkpoint_is_refused_on_resume(fresh_twice_then_tampered):
    """The same command twice leaves the first run's metrics and checkpoint as they were; pickles in place of
    the second run's tensor files, its manifest rewritten to match, stop the resume, naming the file, and
    never run."""
    seen = fresh_twice_then_tampered
    assert seen["first"].returncode == 0, seen["first"].stderr[-3000:]
    assert len(seen["kept"][Path("metrics.jsonl")].decode().splitlines()) >= 2
    assert seen["second"].returncode == 0, seen["second"].stderr[-3000:]
    assert seen["aside"] == seen["kept"]
    assert seen["run_now"] != seen["run"] and seen["ckpt_kept"]

    assert any(f.suffix == ".pt" for f in seen["replaced"])
    resumed = seen["resumed"]
    assert resumed.returncode != 0, resumed.stdout[-2000:]
    assert not seen["pickle_ran"], "a pickle in the checkpoint ran"
    assert "ckpt-000001/optimizer/state/" in resumed.stderr and "refused" in resumed.stderr, resumed.stderr[-3000:]


def test_a_run_id_that_is_a_path_does_not_move_files_out_of_the_output_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run").write_text("../../elsewhere")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    open_run(out, TrainConfig(resume=False), log=lambda _: None)
    assert (out / "runs" / "unnamed" / "metrics.jsonl").is_file() and not (tmp_path.parent / "elsewhere").exists()


def files_and_rows(out: Path) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_resume_refuses_another_runs_checkpoints_by_name_and_changes_nothing(tmp_path):
    """A `run` file naming another run than the checkpoints': the resume would start at step 0 and write
    over them. It stops naming each; train.start_over moves them aside first."""
    open_run(tmp_path, TrainConfig(resume=False))
    earlier = (tmp_path / "run").read_text()
    checkpoint(tmp_path, 0), checkpoint(tmp_path, 1)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (tmp_path / "run").write_text("another")
    before = files_and_rows(tmp_path)
    with pytest.raises(CheckpointError, match=rf"another run's checkpoints are in {tmp_path}; ckpt-000000, "
                                              rf"ckpt-000001: belongs to run {earlier}, not to run another that "
                                              rf"{tmp_path}/run names\. Nothing was changed"):
        open_run(tmp_path, TrainConfig(resume=True), log=lambda _: None)
    assert files_and_rows(tmp_path) == before
    assert open_run(tmp_path, TrainConfig(resume=True, start_over=True), log=lambda _: None) is None
    assert files_and_rows(tmp_path / "runs" / "another") == before


def test_another_runs_checkpoint_stops_a_resume_even_beside_a_usable_one_of_its_own(tmp_path):
    """Its own checkpoint at step 0 is usable, but saving step 5 would write over the other run's."""
    open_run(tmp_path, TrainConfig(resume=False))
    checkpoint(tmp_path, 0)
    other = checkpoint(tmp_path, 5)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(manifest | {"run": "someone-else"}))
    with pytest.raises(CheckpointError, match=r"ckpt-000005: belongs to run someone-else"):
        open_run(tmp_path, TrainConfig(resume=True), log=lambda _: None)


def test_a_checkpoint_past_the_runs_steps_is_refused(tmp_path):
    open_run(tmp_path, TrainConfig(resume=False))
    checkpoint(tmp_path, 10**9)
    with pytest.raises(CheckpointError, match=r"ckpt-1000000000/rollout_state\.json: step 1000000000 is past "
                                              r"train\.num_steps=60"):
        open_run(tmp_path, TrainConfig(resume=True), log=lambda _: None)
    assert (tmp_path / "ckpt-1000000000").is_dir() and not (tmp_path / "runs").exists()


def crafted(out: Path, step: int, version: int, name: str | None = None, token_version: int = 0) -> Path:
    """A complete checkpoint (sizes and sha256 right) whose state claims `step` and `version`, one stored
    sample's tokens of `token_version`, in the directory `name`."""
    c = cfg(max_versions=100)
    monitor, _, source, store, engines = make_rollout_parts(c, seed=1)
    asyncio.run(run_steps(monitor, source, store, engines, c, 2))
    state = store.state_dict()
    sample = state["partial"][0]["samples"][0]
    sample["versions"] = [token_version] * len(sample["versions"])
    path = write_checkpoint(out, rollout_state(step, version, source.state_dict(), state, {"returned_groups": 0,
                            "dropped_groups": 0, "over_sampling": {}}), save_policy, current_run(out))
    if name is not None:
        path = path.rename(out / name)
    return path


@pytest.mark.parametrize("step,version,name,token_version,message", [
    (5, 10**9, None, 0, r"version: 1000000000, more than one per step trained \(step 5\)"),
    (5, 6, None, 7, r"store: a token of policy version 7, newer than the checkpoint's version 6"),
])
def test_a_checkpoints_version_past_its_steps_is_refused(tmp_path, step, version, name, token_version, message):
    open_run(tmp_path, TrainConfig(resume=False))
    crafted(tmp_path, step, version, name, token_version)
    with pytest.raises(CheckpointError, match=rf"ckpt-000005/rollout_state\.json: {message}"):
        open_run(tmp_path, TrainConfig(resume=True), log=lambda _: None)


def test_a_checkpoint_whose_step_is_not_its_names_is_rejected(tmp_path):
    open_run(tmp_path, TrainConfig(resume=False))
    crafted(tmp_path, 3, 4, name="ckpt-000099")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*ckpt-000099: manifest\.json: step 3, not the "
                                              r"step of its name \(99\)"):
        open_run(tmp_path, TrainConfig(resume=True), log=lambda _: None)
    manifest = json.loads((tmp_path / "ckpt-000099" / "manifest.json").read_text())
    (tmp_path / "ckpt-000099" / "manifest.json").write_text(json.dumps(manifest | {"step": 99}))
    with pytest.raises(CheckpointError, match=r"ckpt-000099/rollout_state\.json: step: 3, not the step of its "
                                              r"checkpoint \(ckpt-000099\)"):
        open_run(tmp_path, TrainConfig(resume=True), log=lambda _: None)


def test_a_newest_checkpoint_that_links_outside_the_output_directory_is_rejected(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    open_run(out, TrainConfig(resume=False))
    mine = checkpoint(out, 9)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "run").write_text((out / "run").read_text())  # the same run id in its manifest
    outside = checkpoint(tmp_path / "elsewhere", 19)
    (out / "ckpt-000019").symlink_to(outside)
    said = []
    assert find_checkpoint(out, said.append, (out / "run").read_text()) == mine
    assert f"ckpt-000019 is incomplete (a link to {outside}, outside {out})" in said[0]


def test_a_link_or_fifo_inside_a_checkpoint_is_rejected(tmp_path):
    import os

    first, second = checkpoint(tmp_path, 9), checkpoint(tmp_path, 19)
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (second / "policy" / "tokenizer.json").symlink_to(secret)  # not in the manifest: a loader would still read it
    said = []
    assert find_checkpoint(tmp_path, said.append) == first
    assert f"policy/tokenizer.json is a link to {secret}, outside the checkpoint" in said[0]
    (second / "policy" / "tokenizer.json").unlink()
    os.mkfifo(second / "policy" / "tokenizer.json")
    said.clear()
    assert find_checkpoint(tmp_path, said.append) == first and "tokenizer.json is not a plain file" in said[0]


def test_a_latest_pointer_that_links_outside_the_output_directory_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    checkpoint(out, 9)
    (tmp_path / "pointer").write_text("ckpt-000009")
    (out / "latest").unlink()
    (out / "latest").symlink_to(tmp_path / "pointer")
    with pytest.raises(CheckpointError, match=rf"out/latest: a link to {tmp_path / 'pointer'}, outside {out}"):
        find_checkpoint(out, log=None)
