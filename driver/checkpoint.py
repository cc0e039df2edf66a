"""Driver-side pieces of the training job: held-out evaluation on the engines, and checkpoints.

A checkpoint is one directory, written completely before `latest` points at it: the policy in Hugging
Face format (safetensors), the optimiser state, and in `state.pkl` the step, the policy version, the
prompt cursor, the partial-rollout store and the monitor's counters, all taken at the same moment
between two steps, so a restart neither skips the prompts waiting in the store nor repeats any
(DESIGN-NOTES, item 8).
"""
from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import ray
from transformers import AutoTokenizer

from april_ray.data import dataset_paths, read_examples


class Evaluator:
    def __init__(self, cfg, engines, model_path: str):
        tok = AutoTokenizer.from_pretrained(model_path)
        _, eval_path = dataset_paths(cfg.task, cfg.model.cache_dir)
        examples = read_examples(eval_path, cfg.task.prompt_key, cfg.task.answer_key)
        self.items = [(ex.prompt, tok.encode(ex.prompt), ex.answer) for ex in examples]
        self.engines = engines.actors
        self.greedy = cfg.train.eval_greedy
        self.calls = 0

    def accuracy(self, temperature: float) -> float:
        n = len(self.engines)
        self.calls += 1
        shards = [self.items[i::n] for i in range(n)]
        rewards = ray.get([e.evaluate.remote(s, temperature, f"eval{self.calls}")
                           for e, s in zip(self.engines, shards)])
        return sum(map(sum, rewards)) / len(self.items)

    def run(self) -> dict[str, float]:
        out = {"eval/accuracy_t1": self.accuracy(1.0)}
        if self.greedy:
            out["eval/accuracy_greedy"] = self.accuracy(0.0)
        ray.get([e.stats.remote(True) for e in self.engines])  # keep evaluation out of rollout occupancy
        return out


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
