"""Metrics out of a job: wandb (offline unless configured), progress on the console, and a JSONL file.

Progress is a tqdm bar in a terminal and one plain line per step anywhere else (a Ray job's log, a pipe,
a file), so a job log holds readable lines, not a stream of carriage returns.

Metric keys (documented in docs/architecture.md): `rollout/*` from the monitor (throughput, abort
latency, off-policy ratio, staleness, groups by door), `train/*`, `loss/*` and `off_policy/*` from the
learner, `eval/accuracy_t1` and `eval/accuracy_greedy` on the held-out set, `store/*` from the store.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from april_ray.config import Config


class LineProgress:
    """tqdm's interface as plain lines on stdout: one per `update`, and one for a refreshed postfix."""

    def __init__(self, total: int, initial: int = 0, desc: str = ""):
        self.n, self.total, self.desc = initial, total, desc
        self.postfix: dict[str, str] = {}
        self.t0 = time.perf_counter()

    def set_postfix(self, postfix: dict[str, str], refresh: bool = True) -> None:
        self.postfix = dict(postfix)
        if refresh:
            self._line("done" if self.n >= self.total else f"step {self.n}/{self.total}")

    def update(self, n: int = 1) -> None:
        self.n += n
        self._line(f"step {self.n}/{self.total}")

    def _line(self, head: str) -> None:
        fields = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        self.write(f"{self.desc} {head} [{time.perf_counter() - self.t0:.0f}s] {fields}".rstrip())

    @staticmethod
    def write(text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


def progress(total: int, initial: int = 0, desc: str = "april-ray"):
    """A tqdm bar where it draws (its stream, stderr, is a terminal), else `LineProgress`."""
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
    return LineProgress(total, initial, desc)


class Tracker:
    def __init__(self, cfg: Config, out_dir: Path, total_steps: int, initial_step: int = 0, resume: bool = False):
        self.run = None
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=cfg.logging.project, mode=cfg.logging.wandb_mode, dir=str(out_dir),
                                  config=asdict(cfg), resume="allow" if resume else None)
        self.file = open(out_dir / "metrics.jsonl", "a")
        self.bar = progress(total_steps, initial_step)
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
