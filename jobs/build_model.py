"""Build (or reuse) the embedded tiny model and report its held-out accuracy.

    python -m jobs.build_model [--config configs/tiny_cpu.yaml] [key=value ...]
"""
from __future__ import annotations

import asyncio
import json

from jobs.common import parse
from april_ray.rollout.engine_worker import build_worker
from april_ray.task.data import dataset_paths, read_examples
from april_ray.task.embedded_model import ensure_model
from april_ray.task.evaluate import accuracy, eval_items


async def held_out_accuracy(cfg, path) -> dict[str, float]:
    worker = build_worker(cfg.engine, cfg.sampling, cfg.staleness, cfg.task, str(path), episodes=cfg.rollout)
    _, eval_path = dataset_paths(cfg.task, cfg.model.cache_dir)
    items = eval_items(read_examples(eval_path, cfg.task.prompt_key, cfg.task.answer_key), worker.encode)
    return {"accuracy_t1": await accuracy(worker, items, 1.0), "accuracy_greedy": await accuracy(worker, items, 0.0)}


def main() -> None:
    cfg, _ = parse(__doc__)
    path = ensure_model(cfg)
    result = {"model": str(path), **asyncio.run(held_out_accuracy(cfg, path))}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
