"""Rewards, chosen once per engine worker from the task config (`build_reward_fn`).

Built in: each task's own (`registry.Task.reward`: `math` compares answers with HF's math-verify, the
countdown tasks check the embedded task exactly). A user's function comes by dotted path
(`task.reward_fn=module:function`) and a served reward model by URL (`task.reward_url`).
Every reward has one signature, `(prompt, response, answer, metadata) -> float` (an async function too;
one without `metadata` is called without it), and runs under `RewardRunner`: a call that raises, hangs or
returns anything but a real number (`reward_value`: not a bool, not a string such as "0.5") scores 0 and
is counted.

With `task.reward_per_group`, `task.reward_fn` is a group function instead, `(prompts, responses, answers,
metadatas) -> list[float]`, called once per complete group (pairwise or relative judges, a reward model
that scores a group together; april_ray/rollout/engine_worker.py says when). Same rule, per group: if it
raises, hangs, or returns anything but one finite number per response, every sample of the group scores 0
and each one is counted.
"""
from __future__ import annotations

import asyncio
import json
import math
import numbers
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Awaitable, Callable

from april_ray.plugins import accepts, in_thread, is_async, load_object
from april_ray.task.math_task import math_reward  # noqa: F401  (task.reward_fn=april_ray.task.rewards:math_reward)
from april_ray.task.registry import get_task

if TYPE_CHECKING:
    from april_ray.config import TaskConfig

RewardFn = Callable[[str, str, str, dict], "float | Awaitable[float]"]
"""(prompt, response, answer, metadata) -> reward; metadata is the dataset row's other fields."""
GroupRewardFn = Callable[[list[str], list[str], list[str], list[dict]], "list[float] | Awaitable[list[float]]"]
"""(prompts, responses, answers, metadatas) -> a reward per response, in order (`task.reward_per_group`)."""

THINK_END = "</think>"


def after_think(fn: RewardFn) -> RewardFn:
    """`fn` on the text after the last `</think>`; no `</think>`: no answer was given, 0."""
    def scored(prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
        _, sep, tail = response.rpartition(THINK_END)
        return fn(prompt, tail, answer, metadata) if sep else 0.0
    return scored


def reward_key(task: TaskConfig) -> str:
    """The config key that chose the reward, for its errors."""
    return "task.reward_fn" if task.reward_fn else "task.reward_url" if task.reward_url else f"task.name={task.name}"


def build_reward_fn(task: TaskConfig) -> RewardFn | GroupRewardFn:
    """The reward the config asks for: task.reward_fn (a group function with task.reward_per_group),
    task.reward_url, or the task's own."""
    if task.reward_fn:
        return load_object(task.reward_fn, "task.reward_fn")
    if task.reward_url:
        return UrlReward(task.reward_url, task.reward_url_timeout_s, task.reward_url_retries)
    fn = get_task(task.name).reward
    return after_think(fn) if task.reward_after_think else fn


class RewardServerError(RuntimeError):
    pass


class UrlReward:
    """POSTs {prompt, response, answer, metadata} as JSON to a served reward model; the reply is a number
    or {"reward": number}. A timeout, a refused connection or a 5xx is retried `retries` times (backing
    off 0.5 s, 1 s, ...); a 4xx is the request's own fault and is not. Runs in RewardRunner's threads."""

    def __init__(self, url: str, timeout_s: float, retries: int):
        self.url, self.timeout_s, self.retries = url, timeout_s, retries

    def __call__(self, prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
        body = json.dumps({"prompt": prompt, "response": response, "answer": answer,
                           "metadata": metadata or {}}).encode()
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))
            try:
                return self._reply(self._post(body))
            except urllib.error.HTTPError as e:
                why = f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')!r}"
                if e.code < 500:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                why = repr(getattr(e, "reason", e))
        raise RewardServerError(f"task.reward_url {self.url}: {why} (after {attempt + 1} of {self.retries + 1} tries)")

    def _post(self, body: bytes) -> bytes:
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return r.read()

    def _reply(self, raw: bytes) -> float:
        try:
            value = json.loads(raw)
        except ValueError:
            raise RewardServerError(f"task.reward_url {self.url}: reply is not JSON: {raw[:200]!r}") from None
        if isinstance(value, dict):
            value = value.get("reward")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardServerError(f"task.reward_url {self.url}: expected a number or {{\"reward\": number}}, "
                                    f"got {raw[:200]!r}")
        return float(value)


class RewardRunner:
    """Scores off the event loop, with a per-call timeout: a reward function that raises, hangs past
    `timeout_s`, or returns something that is not a finite number scores 0, and the call is counted in
    `errors` (drained with the engine's statistics) and logged (the first few).

    Each call of a plain function runs in a daemon thread of its own, so the engine's event loop never
    waits for it and the timeout measures that call alone (no queueing behind a slow one). An async
    function runs on the loop and is cancelled at the timeout, so it must await, never block. A thread
    cannot be stopped: a call that hangs for good keeps its thread (a daemon, never joined at exit);
    `hung` counts them.
    """

    def __init__(self, fn: RewardFn, timeout_s: float, log=print, max_logged: int = 5, key: str = "reward"):
        """`key`: where the reward comes from (`task.reward_fn`, ...), to name it in the errors returned."""
        self.fn = fn
        self.key = key
        self.num_args = 4 if accepts(fn, *range(4)) else 3
        """A function of (prompt, response, answer) alone is called without the metadata."""
        self.timeout_s = timeout_s
        self.log = log
        self.max_logged = max_logged
        self.errors = 0
        """Failed calls since the last `drain_errors`."""
        self.total_errors = 0
        self.hung = 0

    async def __call__(self, prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
        """One response's reward, from a per-sample function."""
        return (await self.score(prompt, response, answer, metadata))[0]

    async def score(self, prompt: str, response: str, answer: str, metadata: dict | None = None
                    ) -> tuple[float, str | None]:
        """(reward, why the call failed or None): a failed call scores 0."""
        args = (prompt, response, answer, metadata or {})[:self.num_args]
        [reward], why = await self._score(args, prompt, 1, lambda value: [reward_value(value)])
        return reward, why

    async def group(self, prompts: list[str], responses: list[str], answers: list[str],
                    metadatas: list[dict]) -> list[float]:
        """A group's rewards, one per response in the same order, from a group function in one call; a call
        that fails scores every response 0, each one counted."""
        return (await self.score_group(prompts, responses, answers, metadatas))[0]

    async def score_group(self, prompts: list[str], responses: list[str], answers: list[str],
                          metadatas: list[dict]) -> tuple[list[float], str | None]:
        args = (prompts, responses, answers, metadatas)[:self.num_args]
        return await self._score(args, prompts[0], len(prompts), lambda value: _numbers(value, len(prompts)))

    async def _score(self, args, prompt: str, n: int, read) -> tuple[list[float], str | None]:
        """`read` turns the function's value into `n` rewards, or raises; with why it failed (None)."""
        try:
            return read(await asyncio.wait_for(self._start(args), self.timeout_s)), None
        except asyncio.TimeoutError:
            self.hung += 1
            why = f"no result within task.reward_timeout_s={self.timeout_s:g}s"
        except Exception as e:  # the function's own error, or a result that is not a number
            why = repr(e)
        return [self._error(prompt, why, n)] * n, f"{self.key}: {why}"

    def _start(self, args) -> Awaitable:
        """An async function runs on the event loop (cancelled at the timeout); a plain one in a thread."""
        return self.fn(*args) if is_async(self.fn) else in_thread(self.fn, *args)

    def failed(self, prompt: str, why: str) -> float:
        """Score a call that failed outside the runner (an episode that raised): 0, counted and logged."""
        return self._error(prompt, why)

    def _error(self, prompt: str, why: str, n: int = 1) -> float:
        """0, with `n` errors counted (a group's, one per sample) and the first few logged."""
        self.errors += n
        self.total_errors += n
        if self.total_errors - n < self.max_logged:
            group = f" (a group of {n})" if n > 1 else ""
            self.log(f"reward error ({why}) for prompt {prompt[:80]!r}{group}: scored 0"
                     + (" (further errors are only counted)" if self.total_errors >= self.max_logged else ""))
        return 0.0

    def drain_errors(self) -> int:
        n, self.errors = self.errors, 0
        return n


def reward_value(value) -> float:
    """A reward as a float: a real number (int, float, a numpy scalar), finite; a bool, a string ("0.5"),
    None or anything else is a ValueError. Every path a reward comes by (a function, a group function, an
    episode's return, a served model's reply) reads it so."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"returned {value!r:.60} ({type(value).__name__}), not a finite real number")
    return float(value)


def _numbers(values, n: int) -> list[float]:
    """A group function's value: `n` finite numbers (a list, a tuple, an array)."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != n:
        raise ValueError(f"returned {values!r:.80} for a group of {n}: expected a list of {n} numbers")
    return [reward_value(v) for v in values]
