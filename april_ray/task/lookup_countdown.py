"""The embedded agent task: countdown from numbers the model must look up with a tool.

A prompt `ab,qd-3:` names keys and a step. For each key in turn the model calls the tool (` ?`: `?` ends
its turn), the environment answers with the next key, its value and the step to count down by (`ab=0012-3:`,
environment tokens: context, not trained), and the model counts down from it (` 0009 0006 0003 0000`);
once every key of the prompt was looked up, EOS. A call past the last key ends the episode (unrewarded):

    ab,qd-3: ?ab=0012-3: 0009 0006 0003 0000 ?qd=0007-3: 0004 0001<eos>

Each countdown follows its value and step as in the countdown task's prompts (`0012-3:`), so what the model
must learn beyond that task is the protocol: when to call, and when to stop.

A key's value is a hash of the key, so only the tool knows it. Values are long-tailed and a prompt has one
to three keys, so episodes have long-tailed lengths and numbers of turns. The reward is 1 when the whole
response is exactly right. Every tool call is appended, with its sample, turn and idempotency key, to the
file named by `$APRIL_RAY_TOOL_LOG` when set, so a test can prove that no journaled call ran again.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import string
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from april_ray.task.countdown import WIDTH, countdown_response

if TYPE_CHECKING:
    from april_ray.config import TaskConfig
    from april_ray.task.data import Example

KEY_CHARS = string.ascii_lowercase
MAX_VALUE = 48
TOOL_LOG = "APRIL_RAY_TOOL_LOG"
FORMAT = 5
"""The transcript's layout: part of the cache keys of the generated data and of the warmed-up model."""


def value_of(key: str) -> int:
    """The key's value: lognormal (median 8) through a hash, in [1, MAX_VALUE]."""
    u = (int.from_bytes(hashlib.sha1(f"lookup:{key}".encode()).digest()[:8], "big") + 0.5) / 2 ** 64
    z = math.sqrt(2) * _erfinv(2 * u - 1)
    return int(min(MAX_VALUE, max(1, round(8 * math.exp(0.8 * z)))))


def _erfinv(y: float) -> float:
    """Inverse error function (Newton's method on math.erf; |y| < 1)."""
    x = 0.0
    for _ in range(60):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


def segments(prompt: str) -> list[tuple[str, bool]]:
    """The right response as (text, is the model's): tool calls and countdowns by the model, values by the
    environment (EOS not included)."""
    keys, step = prompt.rstrip(":").rsplit("-", 1)
    out = []
    for key in keys.split(","):
        value = value_of(key)
        out += [(" ?", True), (answer(key, value, int(step)), False), (countdown_response(value, int(step)), True)]
    return _merged(out)


def answer(key: str, value: int, step: int) -> str:
    """The environment's answer to a lookup of `key`: the key, its value and the step, as `ab=0012-3:`."""
    return f"{key}={value:0{WIDTH}d}-{step}:"


def _merged(parts: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    merged: list[tuple[str, bool]] = []
    for text, model in parts:
        if merged and merged[-1][1] == model:
            merged[-1] = (merged[-1][0] + text, model)
        elif text:
            merged.append((text, model))
    return merged


def generate(cfg: TaskConfig, num: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num):
        n_keys = int(rng.choice([1, 2, 3], p=[0.5, 0.3, 0.2]))
        keys = ["".join(rng.choice(list(KEY_CHARS), 2)) for _ in range(n_keys)]
        step = int(rng.integers(1, min(cfg.max_step, *map(value_of, keys)) + 1))  # every countdown has a term
        prompt = f"{','.join(keys)}-{step}:"
        rows.append({"prompt": prompt, "answer": "".join(text for text, _ in segments(prompt))})
    return rows


def lookup(sample_id: str, turn: int, key: str, idempotency_key: str = "") -> int:
    """The tool: the key's value. Logs the call, with its sample, turn and idempotency key, when asked to."""
    log = os.environ.get(TOOL_LOG)
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"sample": sample_id, "turn": turn, "key": key, "call": idempotency_key}) + "\n")
    return value_of(key)


async def episode(ep) -> None:
    """Model turns until one ends without a tool call (EOS, or the budget); call i looks up the prompt's
    i-th key, and a call past the last one ends the episode. The task's reward (exact match) scores the
    whole response."""
    keys, step = ep.prompt.rstrip(":").rsplit("-", 1)
    keys = keys.split(",")
    while True:
        text = await ep.generate(stop=("?",))
        if not text.endswith("?") or ep.turn > len(keys):
            return None
        key = keys[ep.turn - 1]
        value = await ep.call_tool("lookup", lookup, ep.sample.sample_id, ep.turn, key)
        ep.append_env(answer(key, value, int(step)))


def reward(prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
    """1.0 iff `response` is the whole right transcript (recomputed from the prompt)."""
    try:
        right = "".join(text for text, _ in segments(prompt))
    except ValueError:
        return 0.0
    return float(response == right)


class LookupCountdownTask:
    """`task.name=lookup_countdown` (`registry.Task`): generated data, whose lengths come from the tool's
    values (not task.length); the warm-up trains the model's turns of the whole transcript."""
    name = "lookup_countdown"

    def check(self, cfg: TaskConfig) -> None:
        pass

    def data_dir(self, cfg: TaskConfig, cache_dir: str) -> Path:
        key = json.dumps({"n": [cfg.num_train, cfg.num_eval], "seed": cfg.seed, "max_step": cfg.max_step,
                          "format": FORMAT})
        return Path(cache_dir) / "data" / f"lookup-countdown-{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    def generate(self, cfg: TaskConfig, num: int, seed: int) -> list[dict]:
        return generate(cfg, num, seed)

    def reward(self, prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
        return reward(prompt, response, answer, metadata)

    def model_key(self, cfg: TaskConfig) -> dict:
        return {"name": self.name, "format": FORMAT}

    def warmup_segments(self, example: Example) -> list[tuple[str, bool]]:
        return segments(example.prompt)
