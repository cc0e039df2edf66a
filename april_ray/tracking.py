"""Metrics out of a job: wandb (offline unless configured), a progress bar, and a JSONL file.

Metric keys (documented in docs/architecture.md): `rollout/*` from the monitor (throughput, abort
latency, off-policy ratio, staleness, groups by door), `train/*`, `loss/*` and `off_policy/*` from the
learner, `eval/accuracy_t1` and `eval/accuracy_greedy` on the held-out set, `store/*` from the store.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from april_ray.config import Config


class Tracker:
    def __init__(self, cfg: Config, out_dir: Path, total_steps: int, initial_step: int = 0, resume: bool = False):
        self.run = None
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=cfg.logging.project, mode=cfg.logging.wandb_mode, dir=str(out_dir),
                                  config=asdict(cfg), resume="allow" if resume else None)
        self.file = open(out_dir / "metrics.jsonl", "a")
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="april-ray", dynamic_ncols=True)
        self.shown: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.run is not None:
            self.run.log(metrics, step=step)
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        for key, short in (("train/reward_mean", "reward"), ("eval/accuracy_t1", "acc"),
                           ("rollout/effective_tok_s", "tok/s"), ("off_policy/token_ratio", "offpol")):
            if key in metrics:
                self.shown[short] = metrics[key]
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=not advance)
        if advance:
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.run is not None:
            self.run.finish()
