"""Build (or reuse) the embedded tiny model and report its held-out accuracy.

    python -m jobs.build_model [--config configs/tiny_cpu.yaml] [key=value ...]
"""
from __future__ import annotations

import json

import torch

from jobs.common import parse
from april_ray.data import dataset_paths, read_examples
from april_ray.engine.cpu_engine import LLMEngine
from april_ray.evaluate import accuracy
from april_ray.model import ensure_model, load_policy
from april_ray.rewards import get_reward_fn
from april_ray.task import max_response_tokens


def main() -> None:
    cfg, _ = parse(__doc__)
    path = ensure_model(cfg)
    model, tok = load_policy(path)
    torch.set_num_threads(cfg.warmup.num_threads)
    _, eval_path = dataset_paths(cfg.task, cfg.model.cache_dir)
    examples = read_examples(eval_path, cfg.task.prompt_key, cfg.task.answer_key)
    engine = LLMEngine(model, cfg.engine.max_num_seqs, cfg.engine.max_model_len, seed=cfg.engine.seed)
    reward = get_reward_fn(cfg.task.name)
    budget = max_response_tokens(cfg.task.length)
    result = {"model": str(path), "params": sum(p.numel() for p in model.parameters()),
              "accuracy_t1": accuracy(engine, tok, examples, reward, 1.0, budget),
              "accuracy_greedy": accuracy(engine, tok, examples, reward, 0.0, budget)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
