"""Held-out accuracy: one response per prompt, scored by the task's reward in `EngineWorker.evaluate`.

This is the one evaluation path: the training job shards the items over its engine actors, and the
warm-up job (`jobs/build_model.py`) and the tests run one in-process worker.
"""
from __future__ import annotations

from april_ray.task.data import Example

EvalItem = tuple[str, list[int], str]
"""(prompt text, prompt ids, answer)."""


def eval_items(examples: list[Example], encode) -> list[EvalItem]:
    return [(ex.prompt, encode(ex.prompt), ex.answer) for ex in examples]


async def accuracy(worker, items: list[EvalItem], temperature: float) -> float:
    """Mean reward of one response per item at `temperature` (0: greedy) on an in-process EngineWorker."""
    rewards = await worker.evaluate(items, temperature, f"eval-t{temperature}")
    return sum(rewards) / max(1, len(items))
