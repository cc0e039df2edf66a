"""Evaluation on the job's engines: the items are sharded over the engine actors, and each one scores its
shard with `EngineWorker.evaluate` (the one evaluation path, `april_ray/task/evaluate.py`). A shard whose
engine dies (or was restarted without the current weights) is scored again on the engines that serve the
current weights once they are back (driver/engines.py).

Two kinds of set: the held-out split (task.eval_path) gives eval/accuracy_t1 and eval/accuracy_greedy,
one response per prompt; each of eval.datasets gives eval/<name>/pass@k and the rest (`set_metrics`)
from eval.n_samples_per_prompt responses per prompt at eval.temperature and eval.top_p."""
from __future__ import annotations

from april_ray.task.chat import PromptEncoder
from april_ray.task.data import fit_context, read_examples
from april_ray.task.evaluate import EvalItem, eval_items, set_metrics
from april_ray.task.tokenizer import load_tokenizer
from driver.engines import settle

ATTEMPTS = 5


class Evaluator:
    def __init__(self, cfg, engines, model_path: str, eval_path: str):
        tok = load_tokenizer(model_path)
        self.encode = PromptEncoder(tok, cfg.task, f"the tokenizer of {model_path}")
        self.max_prompt_tokens = cfg.engine.max_model_len - cfg.sampling.max_response_len
        self.overlong = cfg.task.overlong_prompts
        self.metadata_keys = cfg.task.metadata_keys
        self.items = self._items(eval_path, cfg.task.prompt_key, cfg.task.answer_key, "task.eval_path")
        self.sets = {name: self._items(d.path, d.prompt_key, d.answer_key, f"eval.datasets.{name}.path")
                     for name, d in cfg.eval.datasets.items()}
        self.eval = cfg.eval
        self.engines = engines
        self.greedy = cfg.train.eval_greedy
        self.calls = 0

    def _items(self, path: str, prompt_key: str, answer_key: str, key: str) -> list[EvalItem]:
        try:
            examples = read_examples(path, prompt_key, answer_key, self.metadata_keys)
        except FileNotFoundError as e:
            raise ValueError(f"{key}: {e}") from None
        examples = fit_context(examples, self.encode, self.max_prompt_tokens, self.overlong, "task.overlong_prompts")
        return eval_items(examples, self.encode)

    def accuracy(self, temperature: float) -> float:
        """Mean reward on the held-out split, one response per prompt."""
        return sum(r for r, _ in self.score(self.items, temperature)) / len(self.items)

    def score(self, items: list[EvalItem], temperature: float, top_p: float | None = None) -> list[tuple[float, int]]:
        """(reward, response length) per item, in the items' order."""
        self.calls += 1
        n = len(self.engines.actors)
        shards = {i: items[i::n] for i in range(n)}
        results: dict[int, list] = {}
        for attempt in range(ATTEMPTS):
            # an elastic fleet's missing engines never answer: their shards go to the others at once
            up = self.engines.present() if attempt == 0 else self.engines.serving()
            if not up:
                break
            todo = [i for i in shards if i not in results]
            # the shard in the tag: a retry puts several shards on one engine, and request ids must differ
            refs = [self.engines.actors[up[k % len(up)]].evaluate.remote(shards[i], temperature,
                                                                          f"eval{self.calls}.{attempt}.{i}", top_p)
                    for k, i in enumerate(todo)]
            results |= {i: r for i, r in zip(todo, settle(refs)) if not isinstance(r, Exception)}
            if len(results) == n:
                out = [None] * len(items)
                for i, shard in results.items():
                    out[i::n] = shard
                return out
        raise RuntimeError(f"evaluation: shards {sorted(set(shards) - set(results))} failed on {attempt + 1} tries "
                           "(their engines died, and not enough came back with the current weights)")

    def run(self, version: int) -> dict[str, float]:
        """Every evaluation, of the weights of policy `version` (`eval/version`): the driver publishes none
        while one runs, also in the overlapped mode, where the rollout shares the engines meanwhile."""
        out = {"eval/version": version, "eval/accuracy_t1": self.accuracy(1.0)}
        if self.greedy:
            out["eval/accuracy_greedy"] = self.accuracy(0.0)
        n = self.eval.n_samples_per_prompt
        for name, items in self.sets.items():
            repeated = [item for item in items for _ in range(n)]  # a prompt's n responses side by side
            out |= set_metrics(name, self.score(repeated, self.eval.temperature, self.eval.top_p), n,
                               self.eval.pass_reward)
        self.engines.stats(drain=True)  # keep evaluation out of rollout occupancy
        return out


class EvalHistory:
    """The summary's `history`: (training wall seconds, held-out accuracy) of each evaluated step, in step
    order. A step redone after a restore (driver/restore.py) evaluates again, and that evaluation replaces
    the abandoned one: one point per step, as `jobs.bench.train` reads them."""

    def __init__(self):
        self.by_step: dict[int, tuple[float, float]] = {}

    def add(self, step: int, train_s: float, accuracy: float) -> None:
        """After `step` steps (0: before training)."""
        self.by_step[step] = (train_s, accuracy)

    def points(self) -> list[tuple[float, float]]:
        return [self.by_step[s] for s in sorted(self.by_step)]
