"""Evaluation: responses scored by the task's reward in `EngineWorker.evaluate`, and what is reported.

This is the one evaluation path: the training job shards the items over its engine actors
(driver/evaluator.py), and the warm-up job (`jobs/build_model.py`) and the tests run one in-process worker.
A worker returns (reward, response length) per item; `set_metrics` turns a set's results, several per
prompt, into pass@1, pass@k (the unbiased estimator of Chen et al. 2021, "Evaluating Large Language
Models Trained on Code"), the mean reward and the mean response length.
"""
from __future__ import annotations

import math

from april_ray.task.data import Example

EvalItem = tuple[str, list[int], str, dict]
"""(prompt text, prompt ids, answer, metadata)."""


def eval_items(examples: list[Example], encode) -> list[EvalItem]:
    """`encode`: a PromptEncoder (or a text encoder, for string prompts)."""
    return [(ex.prompt, encode(ex.as_given), ex.answer, ex.metadata) for ex in examples]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k responses drawn without replacement from n, c of them correct,
    is correct: 1 - C(n-c, k) / C(n, k), as a product (no large binomials)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... and n."""
    return sorted({1, n} | {2 ** j for j in range(1, n.bit_length()) if 2 ** j < n})


def set_metrics(name: str, results: list[tuple[float, int]], n: int, pass_reward: float) -> dict[str, float]:
    """eval/<name>/... from (reward, response length) of n consecutive responses per prompt."""
    assert results and len(results) % n == 0, (len(results), n)
    correct = [sum(r >= pass_reward for r, _ in results[i:i + n]) for i in range(0, len(results), n)]
    out = {f"eval/{name}/pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks(n)}
    out[f"eval/{name}/reward_mean"] = sum(r for r, _ in results) / len(results)
    out[f"eval/{name}/response_len"] = sum(length for _, length in results) / len(results)
    return out


async def accuracy(worker, items: list[EvalItem], temperature: float) -> float:
    """Mean reward of one response per item at `temperature` (0: greedy) on an in-process EngineWorker."""
    results = await worker.evaluate(items, temperature, f"eval-t{temperature}")
    return sum(r for r, _ in results) / max(1, len(items))
