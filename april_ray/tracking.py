"""Metrics out of a job: wandb (offline unless configured), progress on the console, a JSONL file, and
TensorBoard event files with `logging.tensorboard` (`tensorboard --logdir OUTPUT_DIR`; `python -m jobs.plot`
draws the JSONL file without a server).

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
import uuid
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


def truncate_step_logs(out_dir: Path, last_step: int, log=print) -> None:
    """Make the per-step record files (`*.jsonl` in `out_dir`) end at `last_step`, the checkpoint a run
    resumes from: rows of later steps (written by a killed run, and about to be redone) go, as does a
    torn last line (a row the kill cut short); every other row stays. Each file is rewritten atomically."""
    for path in sorted(out_dir.glob("*.jsonl")):
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
        lines = text.splitlines(keepends=True)
        torn = bool(lines) and not lines[-1].endswith("\n")
        kept = [line for line in (lines[:-1] if torn else lines) if not _past(line, last_step)]
        if len(kept) == len(lines):
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8", errors="surrogateescape")
        tmp.replace(path)
        log(f"{path}: dropped {len(lines) - len(kept)} rows past step {last_step}"
            f"{' (the last one torn by the kill)' if torn else ''}; those steps are redone from the checkpoint")


def _past(line: str, last_step: int) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return False
    return isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > last_step


def wandb_run_id(out_dir: Path, resume: bool) -> str:
    """The run's wandb id, kept in `out_dir/wandb_run_id`: a resumed job continues the same wandb run."""
    path = out_dir / "wandb_run_id"
    if resume and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id)
    return run_id


class Tracker:
    def __init__(self, cfg: Config, out_dir: Path, total_steps: int, initial_step: int = 0, resume: bool = False):
        """With `resume`, the wandb run of `out_dir` continues (`resume="allow"` with its kept id); the
        caller has already cut the step logs back to the checkpoint (`truncate_step_logs`)."""
        self.run = None
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=cfg.logging.project, mode=cfg.logging.wandb_mode, dir=str(out_dir),
                                  config=asdict(cfg), id=wandb_run_id(out_dir, resume), resume="allow")
        self.file = open(out_dir / "metrics.jsonl", "a" if resume else "w")  # a fresh run's rows only
        self.board = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run redoes the steps after its checkpoint: their earlier events are purged
            self.board = SummaryWriter(str(out_dir / "tensorboard"), purge_step=initial_step if resume else None)
        self.bar = progress(total_steps, initial_step)
        self.shown: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.run is not None:
            self.run.log(metrics, step=step)
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.board is not None:
            for key, value in metrics.items():
                self.board.add_scalar(key, value, step)
            self.board.flush()
        for key, short in (("train/reward_mean", "reward"), ("eval/accuracy_t1", "acc"),
                           ("rollout/effective_tok_s", "tok/s"), ("off_policy/token_ratio", "offpol")):
            if key in metrics:
                self.shown[short] = metrics[key]
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=not advance)
        if advance:
            self.bar.update(1)

    def cut_back(self, out_dir: Path, last_step: int) -> None:
        """Drop the step rows after `last_step` from the step logs (a job restored in place to a checkpoint
        redoes those steps) and go on appending after it."""
        self.file.close()
        truncate_step_logs(out_dir, last_step)
        self.file = open(out_dir / "metrics.jsonl", "a")
        self.bar.n = last_step + 1

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.board is not None:
            self.board.close()
        if self.run is not None:
            self.run.finish()
