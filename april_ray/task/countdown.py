"""The embedded synthetic task: countdown, with verifiable rewards and long-tailed response lengths.

A prompt `0153-7:` asks to count down from 153 in steps of 7 while the value stays non-negative:
` 0146 0139 ... 0006`. Values are zero-padded to 4 digits, so each term is 5 tokens and every step is a
local rule (subtract with borrow, stop below the step), which a tiny model learns in minutes. The number
of terms is drawn from a configured long-tailed distribution, so response lengths are long-tailed the way
reasoning traces are. The reward is 1 when the response is exactly the right countdown.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from april_ray.config import LengthConfig, TaskConfig
    from april_ray.task.data import Example

WIDTH = 4
TOKENS_PER_TERM = WIDTH + 1


def sample_num_terms(cfg: LengthConfig, rng: np.random.Generator, size: int) -> np.ndarray:
    if cfg.family == "lognormal":
        x = cfg.median * np.exp(cfg.sigma * rng.standard_normal(size))
    elif cfg.family == "pareto":
        x = cfg.median * (1.0 + rng.pareto(cfg.alpha, size))
    elif cfg.family == "exponential":
        x = rng.exponential(cfg.median / np.log(2), size)
    else:
        x = rng.uniform(cfg.min_terms, cfg.max_terms + 1, size)
    return np.clip(np.floor(x), cfg.min_terms, cfg.max_terms).astype(int)


def countdown_response(start: int, step: int) -> str:
    return " " + " ".join(f"{v:0{WIDTH}d}" for v in range(start - step, -1, -step))


def make_example(num_terms: int, step: int, offset: int) -> dict:
    start = num_terms * step + offset  # offset < step, so exactly num_terms values are >= 0
    return {"prompt": f"{start:0{WIDTH}d}-{step}:", "answer": countdown_response(start, step)}


def generate(cfg: TaskConfig, num: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    terms = sample_num_terms(cfg.length, rng, num)
    steps = rng.integers(1, cfg.max_step + 1, num)
    offsets = (rng.random(num) * steps).astype(int)
    return [make_example(int(t), int(s), int(o)) for t, s, o in zip(terms, steps, offsets)]


def max_response_tokens(cfg: LengthConfig) -> int:
    return cfg.max_terms * TOKENS_PER_TERM + 1  # + EOS


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Written to a temporary file of this call's own, then moved into place: jobs that start at once with
    one cache directory each write the whole file, and a reader never sees half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o644)  # mkstemp's file is its owner's alone; a dataset is read by every job
    try:
        with os.fdopen(fd, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def countdown_reward(prompt: str, response: str) -> float:
    """1.0 iff `response` is the exact countdown that `prompt` asks for (recomputed from the prompt)."""
    try:
        start, step = prompt.rstrip(":").split("-")
        expected = countdown_response(int(start), int(step))
    except ValueError:
        return 0.0
    return float(response == expected)


class CountdownTask:
    """`task.name=countdown` (`registry.Task`): the data is generated, the reward is the exact countdown."""
    name = "countdown"

    def check(self, cfg: TaskConfig) -> None:
        pass

    def data_dir(self, cfg: TaskConfig, cache_dir: str) -> Path:
        key = json.dumps({"length": asdict(cfg.length), "n": [cfg.num_train, cfg.num_eval], "seed": cfg.seed,
                          "max_step": cfg.max_step})
        return Path(cache_dir) / "data" / f"countdown-{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    def generate(self, cfg: TaskConfig, num: int, seed: int) -> list[dict]:
        return generate(cfg, num, seed)

    def reward(self, prompt: str, response: str, answer: str, metadata: dict | None = None) -> float:
        return countdown_reward(prompt, response)

    def model_key(self, cfg: TaskConfig) -> dict:
        return {}

    def warmup_segments(self, example: Example) -> list[tuple[str, bool]]:
        return [(example.answer, True)]
