"""The math task: a dataset of problems (DAPO-Math-17k, DeepScaleR, ...) whose answers are checked with HF's
math-verify, the checker DAPO-style recipes use (LaTeX, boxed, fractions, sets, ...). Nothing is
generated: the dataset is `task.train_path`.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from april_ray.config import TaskConfig
    from april_ray.task.data import Example

NEEDS_DATA = "task.train_path: the math task needs a dataset file"


def math_reward(prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only the main thread may set; elsewhere (the
    # RewardRunner's threads) the runner's timeout applies instead.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    # Ground truths are bare ("1/2", "\\sqrt{8}"); math-verify reads LaTeX inside delimiters.
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=limit)
    pred = parse(response, parsing_timeout=limit)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=limit))


class MathTask:
    """`task.name=math` (`registry.Task`): read from task.train_path, scored by `math_reward`."""
    name = "math"

    def check(self, cfg: TaskConfig) -> None:
        if not cfg.train_path:
            raise ValueError(NEEDS_DATA)

    def data_dir(self, cfg: TaskConfig, cache_dir: str) -> Path:
        raise ValueError(NEEDS_DATA)

    def generate(self, cfg: TaskConfig, num: int, seed: int) -> list[dict]:
        raise ValueError(NEEDS_DATA)

    def reward(self, prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
        return math_reward(prompt, response, answer, metadata)

    def model_key(self, cfg: TaskConfig) -> dict:
        # 5 was lookup_countdown's FORMAT when math models entered the key: it stays, so they are still found.
        return {"name": self.name, "format": 5}

    def warmup_segments(self, example: Example) -> list[tuple[str, bool]]:
        return [(example.answer, True)]
