"""Prompt datasets: JSONL or Parquet rows with a prompt field and an answer field.

This is the layout of DAPO-Math-17k and DeepScaleR, and the countdown generator writes the same layout,
so the embedded task and real data go through one path. Errors name the file and the line (or row).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from april_ray.config import TaskConfig
from april_ray.task import countdown


@dataclass(frozen=True)
class Example:
    index: int
    """Row number in the dataset file (0-based); the prompt source's cursor counts these."""
    prompt: str
    answer: str


def _check_row(row, where: str, prompt_key: str, answer_key: str, index: int) -> Example:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with fields {prompt_key!r} and {answer_key!r}")
    for key in (prompt_key, answer_key):
        if key not in row:
            raise ValueError(f"{where}: missing field {key!r}")
    prompt = row[prompt_key]
    if isinstance(prompt, list):  # chat layout (DAPO-Math-17k): take the user turn's content
        prompt = "\n".join(m["content"] for m in prompt if m.get("role", "user") == "user")
    answer = row[answer_key]
    if isinstance(answer, dict) and "ground_truth" in answer:  # reward_model layout
        answer = answer["ground_truth"]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: field {prompt_key!r} must be a non-empty string")
    return Example(index, prompt, str(answer))


def read_examples(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [_check_row(r, f"{path}: row {i}", prompt_key, answer_key, i) for i, r in enumerate(rows)]
    examples = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            examples.append(_check_row(row, where, prompt_key, answer_key, len(examples)))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def task_dir(cfg: TaskConfig, cache_dir: str) -> Path:
    key = json.dumps({"length": asdict(cfg.length), "n": [cfg.num_train, cfg.num_eval], "seed": cfg.seed, "max_step": cfg.max_step})
    return Path(cache_dir) / "data" / f"countdown-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def dataset_paths(cfg: TaskConfig, cache_dir: str) -> tuple[Path, Path]:
    """(train, eval) files: the configured ones, or the countdown task generated once into the cache."""
    if cfg.train_path:
        return Path(cfg.train_path), Path(cfg.eval_path or cfg.train_path)
    out = task_dir(cfg, cache_dir)
    train, evaluation = out / "train.jsonl", out / "eval.jsonl"
    if not (train.is_file() and evaluation.is_file()):
        countdown.write_jsonl(countdown.generate(cfg, cfg.num_train, cfg.seed), train)
        countdown.write_jsonl(countdown.generate(cfg, cfg.num_eval, cfg.seed + 1), evaluation)
    return train, evaluation
