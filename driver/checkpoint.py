"""Checkpoints of a training job.

A checkpoint is one directory, written completely before `latest` points at it: the policy in Hugging
Face format (safetensors), the optimiser state, and in `state.pkl` the step, the policy version, the
prompt cursor, the partial-rollout store and the monitor's counters, all taken at the same moment
between two steps, so a restart neither skips the prompts waiting in the store nor repeats any
(the cursor alone has already moved past the prompts of the partial groups).
"""
from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import ray


def save_checkpoint(out_dir: Path, step: int, version: int, learners, rollout) -> Path:
    path = out_dir / f"ckpt-{step:06d}"
    tmp = out_dir / f".tmp-ckpt-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    learners.save(str(tmp))
    state = {"step": step, "version": version,
             "source": ray.get(rollout.source.state_dict.remote()),
             "store": ray.get(rollout.store.state_dict.remote()),
             "monitor": ray.get(rollout.monitor.counters.remote())}
    with open(tmp / "state.pkl", "wb") as f:
        pickle.dump(state, f)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    (out_dir / "latest.tmp").write_text(path.name)
    (out_dir / "latest.tmp").replace(out_dir / "latest")
    return path


def latest_checkpoint(out_dir: Path) -> Path | None:
    pointer = out_dir / "latest"
    if not pointer.is_file():
        return None
    path = out_dir / pointer.read_text().strip()
    if not (path / "state.pkl").is_file():
        raise FileNotFoundError(f"{pointer} points at {path}, which is not a complete checkpoint")
    return path


def restore_checkpoint(path: Path, learners, rollout, engines) -> tuple[int, int]:
    """Load everything saved at `path`; returns (next step, policy version)."""
    with open(path / "state.pkl", "rb") as f:
        state = pickle.load(f)
    learners.load(str(path))
    ray.get([rollout.source.load_state_dict.remote(state["source"]),
             rollout.store.load_state_dict.remote(state["store"]),
             rollout.monitor.restore_counters.remote(state["monitor"])])
    learners.publish(engines, state["version"])
    return state["step"] + 1, state["version"]
