"""Verifiable rewards, chosen once by task name.

`math` uses HF's math-verify to parse and compare answers (LaTeX, boxed, fractions, sets, ...), the
checker DAPO-style recipes use. `countdown` checks the embedded task exactly.
"""
from __future__ import annotations

from typing import Callable

from april_ray.task.countdown import countdown_reward

RewardFn = Callable[[str, str, str], float]
"""(prompt, response, answer) -> reward."""


def math_reward(prompt: str, response: str, answer: str) -> float:
    from math_verify import parse, verify

    # Ground truths are bare ("1/2", "\\sqrt{8}"); math-verify reads LaTeX inside delimiters.
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    pred = parse(response)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred))


def get_reward_fn(task_name: str) -> RewardFn:
    if task_name == "countdown":
        return lambda prompt, response, answer: countdown_reward(prompt, response)
    if task_name == "math":
        return math_reward
    raise ValueError(f"task.name: no reward for {task_name!r}")
