"""What a job computes once at its start and passes down: the policy directory, the dataset files, the
placement plan, and the held-out evaluation items."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from april_ray.config import Config
from april_ray.model import ensure_model
from april_ray.placement import Layout, plan
from april_ray.task.data import dataset_paths
from april_ray.plugins import check_plugins


@dataclass(frozen=True)
class JobInputs:
    model_path: str
    train_path: str
    eval_path: str
    layout: Layout


def prepare(cfg: Config) -> JobInputs:
    """Build (or reuse) the embedded model and task data, and plan the placement group. A plug-in that does
    not import or has the wrong signature stops the job here, naming its key, before any actor starts."""
    check_plugins(cfg)
    model_path = ensure_model(cfg)
    train_path, eval_path = dataset_paths(cfg.task, cfg.model.cache_dir)
    return JobInputs(str(Path(model_path)), str(train_path), str(eval_path), plan(cfg))
