"""Curves without a server: `logging.tensorboard` writes metrics.jsonl's values as TensorBoard scalars that
TensorBoard's own reader loads, and `python -m jobs.plot` draws a run's curves to a PNG."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from april_ray.config import load_config
from april_ray.tracking import Tracker

ROOT = Path(__file__).resolve().parents[1]


def scalars(board_dir) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(board_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def by_key(metrics_jsonl) -> dict[str, dict[int, float]]:
    out = {}
    for row in map(json.loads, metrics_jsonl.read_text().splitlines()):
        for key, value in row.items():
            if key != "step":
                out.setdefault(key, {})[row["step"]] = value
    return out


def assert_same(board: dict, rows: dict) -> None:
    """The same keys, and by step the same values (TensorBoard keeps float32)."""
    assert sorted(board) == sorted(rows)
    for key in rows:
        assert board[key] == pytest.approx(rows[key], rel=1e-6), key


def test_tensorboard_scalars_are_metrics_jsonl_by_step(tmp_path):
    cfg = load_config(None, ["logging.wandb_mode=disabled", "logging.tensorboard=true"])
    tracker = Tracker(cfg, tmp_path, total_steps=2)
    tracker.log(0, {"train/reward_mean": 0.25, "rollout/effective_tok_s": 900, "time/rollout_s": 1.5, "note": "x"})
    tracker.log(1, {"train/reward_mean": 0.5, "eval/accuracy_t1": 0.125, "time/rollout_s": 1.25})
    tracker.close()
    assert_same(scalars(tmp_path / "tensorboard"), by_key(tmp_path / "metrics.jsonl"))
    assert "note" not in by_key(tmp_path / "metrics.jsonl")  # a string is no metric, in either


@pytest.mark.slow
def test_a_real_runs_event_files_hold_every_numeric_key(watched_job):
    expected = by_key(watched_job.out / "metrics.jsonl")
    assert {"train/reward_mean", "eval/accuracy_t1", "time/rollout_s"} <= set(expected)
    assert_same(scalars(watched_job.out / "tensorboard"), expected)


@pytest.mark.slow
def test_plot_draws_a_real_run(watched_job, tmp_path):
    png = tmp_path / "curves.png"
    done = subprocess.run([sys.executable, "-m", "jobs.plot", str(watched_job.out), str(watched_job.out),
                           "--png", str(png)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
