"""The tasks, one object each, chosen once by `task.name` (`get_task`).

A task holds what differs from one task to another: its config check, its generated data and where it is
cached, its reward, its entries in the embedded model's cache key, and the warm-up's target segments. The
rest (reading datasets, running rewards, the warm-up itself) is shared and asks the task. A new task is a
class in its own module and a line in `TASKS`. Config validation asks it for the name and the task's
check, importing it only then, so that config.py (which the engines import) loads no task; the task
package imports config.py for type checking only.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from april_ray.task.countdown import CountdownTask
from april_ray.task.lookup_countdown import LookupCountdownTask
from april_ray.task.math_task import MathTask

if TYPE_CHECKING:
    from april_ray.config import TaskConfig
    from april_ray.task.data import Example


class Task(Protocol):
    name: str
    """The value of `task.name` that chooses it."""

    def check(self, cfg: TaskConfig) -> None:
        """A ValueError naming the key, where the config cannot run this task (called by config validation)."""

    def data_dir(self, cfg: TaskConfig, cache_dir: str) -> Path:
        """Where its generated data (train.jsonl, eval.jsonl) is cached: the name hashes what shapes it."""

    def generate(self, cfg: TaskConfig, num: int, seed: int) -> list[dict]:
        """`num` rows {prompt, answer}, the same for the same seed."""

    def reward(self, prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
        """The task's own reward (`rewards.RewardFn`)."""

    def model_key(self, cfg: TaskConfig) -> dict:
        """Its entries in the embedded model's cache key, beside the data settings every task's key holds."""

    def warmup_segments(self, example: Example) -> list[tuple[str, bool]]:
        """The warm-up's target after the prompt, as (text, trained): the loss is on trained text only."""


TASKS: dict[str, Task] = {task.name: task for task in (CountdownTask(), MathTask(), LookupCountdownTask())}


def get_task(name: str) -> Task:
    """The task `task.name` names; another name is a ValueError naming the key and the choices."""
    if name not in TASKS:
        raise ValueError(f"task.name: must be one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]
