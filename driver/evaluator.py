"""Held-out evaluation on the job's engines: the items are sharded over the engine actors, and each one
scores its shard with `EngineWorker.evaluate` (the one evaluation path, `april_ray/task/evaluate.py`).
A shard whose engine dies (or was restarted without the current weights) is scored again on the engines
that serve the current weights once they are back (driver/engines.py)."""
from __future__ import annotations

from transformers import AutoTokenizer

from april_ray.task.data import fit_context, read_examples
from april_ray.task.evaluate import eval_items
from driver.engines import settle

ATTEMPTS = 5


class Evaluator:
    def __init__(self, cfg, engines, model_path: str, eval_path: str):
        tok = AutoTokenizer.from_pretrained(model_path)
        examples = fit_context(read_examples(eval_path, cfg.task.prompt_key, cfg.task.answer_key), tok.encode,
                               cfg.engine.max_model_len - cfg.sampling.max_response_len, cfg.task.overlong_prompts,
                               "task.overlong_prompts")
        self.items = eval_items(examples, tok.encode)
        self.engines = engines
        self.greedy = cfg.train.eval_greedy
        self.calls = 0

    def accuracy(self, temperature: float) -> float:
        self.calls += 1
        n = len(self.engines.actors)
        shards = {i: self.items[i::n] for i in range(n)}
        rewards: dict[int, list[float]] = {}
        for attempt in range(ATTEMPTS):
            up = list(range(n)) if attempt == 0 else self.engines.serving()
            if not up:
                break
            todo = [i for i in shards if i not in rewards]
            # the shard in the tag: a retry puts several shards on one engine, and request ids must differ
            refs = [self.engines.actors[up[k % len(up)]].evaluate.remote(shards[i], temperature,
                                                                          f"eval{self.calls}.{attempt}.{i}")
                    for k, i in enumerate(todo)]
            rewards |= {i: r for i, r in zip(todo, settle(refs)) if not isinstance(r, Exception)}
            if len(rewards) == n:
                return sum(map(sum, rewards.values())) / len(self.items)
        raise RuntimeError(f"evaluation: shards {sorted(set(shards) - set(rewards))} failed on {attempt + 1} tries "
                           "(their engines died, and not enough came back with the current weights)")

    def run(self) -> dict[str, float]:
        out = {"eval/accuracy_t1": self.accuracy(1.0)}
        if self.greedy:
            out["eval/accuracy_greedy"] = self.accuracy(0.0)
        self.engines.stats(drain=True)  # keep evaluation out of rollout occupancy
        return out
