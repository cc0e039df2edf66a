"""Held-out evaluation on the job's engines: the items are sharded over the engine actors, and each one
scores its shard with `EngineWorker.evaluate` (the one evaluation path, `april_ray/task/evaluate.py`)."""
from __future__ import annotations

import ray
from transformers import AutoTokenizer

from april_ray.task.data import read_examples
from april_ray.task.evaluate import eval_items


class Evaluator:
    def __init__(self, cfg, engines, model_path: str, eval_path: str):
        tok = AutoTokenizer.from_pretrained(model_path)
        self.items = eval_items(read_examples(eval_path, cfg.task.prompt_key, cfg.task.answer_key), tok.encode)
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
