"""Verifiable rewards, chosen once by task name.

`math` uses HF's math-verify to parse and compare answers (LaTeX, boxed, fractions, sets, ...), the
checker DAPO-style recipes use. `countdown` checks the embedded task exactly.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from typing import Callable

from april_ray.task.countdown import countdown_reward

RewardFn = Callable[[str, str, str], float]
"""(prompt, response, answer) -> reward."""


def math_reward(prompt: str, response: str, answer: str) -> float:
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


def countdown_task_reward(prompt: str, response: str, answer: str) -> float:
    return countdown_reward(prompt, response)


def get_reward_fn(task_name: str) -> RewardFn:
    if task_name == "countdown":
        return countdown_task_reward
    if task_name == "math":
        return math_reward
    raise ValueError(f"task.name: no reward for {task_name!r}")


class RewardRunner:
    """Scores off the event loop, with a per-call timeout: a reward function that raises, hangs past
    `timeout_s`, or returns something that is not a finite number scores 0, and the call is counted in
    `errors` (drained with the engine's statistics) and logged (the first few).

    Each call runs in a daemon thread of its own, so the engine's event loop never waits for it and the
    timeout measures that call alone (no queueing behind a slow one). A thread cannot be stopped: a call
    that hangs for good keeps its thread (a daemon, never joined at exit); `hung` counts them.
    """

    def __init__(self, fn: RewardFn, timeout_s: float, log=print, max_logged: int = 5):
        self.fn = fn
        self.timeout_s = timeout_s
        self.log = log
        self.max_logged = max_logged
        self.errors = 0
        """Failed calls since the last `drain_errors`."""
        self.total_errors = 0
        self.hung = 0

    async def __call__(self, prompt: str, response: str, answer: str) -> float:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        threading.Thread(target=self._run, args=(loop, fut, (prompt, response, answer)), daemon=True,
                         name="reward").start()
        try:
            value = await asyncio.wait_for(fut, self.timeout_s)
            reward = float(value)
            if not math.isfinite(reward):
                raise ValueError(f"returned {value!r}")
            return reward
        except asyncio.TimeoutError:
            self.hung += 1
            return self._error(prompt, f"no result within task.reward_timeout_s={self.timeout_s:g}s")
        except Exception as e:  # the function's own error, or a result that is not a number
            return self._error(prompt, repr(e))

    def _run(self, loop, fut, args) -> None:
        try:
            out = (True, self.fn(*args))
        except Exception as e:
            out = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(_settle, fut, out)

    def _error(self, prompt: str, why: str) -> float:
        self.errors += 1
        self.total_errors += 1
        if self.total_errors <= self.max_logged:
            self.log(f"reward error ({why}) for prompt {prompt[:80]!r}: scored 0"
                     + (" (further errors are only counted)" if self.total_errors == self.max_logged else ""))
        return 0.0

    def drain_errors(self) -> int:
        n, self.errors = self.errors, 0
        return n


def _settle(fut: asyncio.Future, out) -> None:
    if fut.done():  # timed out and cancelled
        return
    ok, value = out
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
