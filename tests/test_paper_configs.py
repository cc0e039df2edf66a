"""The APRIL paper's four settings as configs: each resolves with --print-config, and the training job on
a machine without their model (and GPUs) stops at once, naming model.path, before it starts Ray."""
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from april_ray.config import load_config
from april_ray.plugins import load_object

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {  # config -> (algorithm, model, dataset file, prompt key, answer key)
    "configs/qwen3_4b_dapo.yaml": ("dapo", "Qwen3-4B", "dapo-math-17k", "prompt", "reward_model"),
    "configs/qwen3_4b_grpo.yaml": ("grpo", "Qwen3-4B", "deepscaler", "problem", "answer"),
    "configs/qwen3_4b_gspo.yaml": ("gspo", "Qwen3-4B", "deepmath-103k", "question", "final_answer"),
    "configs/r1_distill_1p5b_agent_grpo.yaml": ("grpo", "DeepSeek-R1-Distill-Qwen-1.5B", "deepscaler", "problem",
                                                "answer"),
}


def run_train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jobs.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("path", SETTINGS)
def test_paper_setting_resolves(path):
    algorithm, model, data, prompt_key, answer_key = SETTINGS[path]
    proc = run_train("--config", path, "--print-config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"name: {algorithm}" in proc.stdout and f"/models/{model}" in proc.stdout
    cfg = load_config(str(ROOT / path))
    assert cfg.algorithm.name == algorithm and Path(cfg.model.path).name == model
    assert data in cfg.task.train_path and (cfg.task.prompt_key, cfg.task.answer_key) == (prompt_key, answer_key)
    assert cfg.task.name == "math" and cfg.task.apply_chat_template == "true" and cfg.task.reward_after_think
    assert cfg.engine.backend == "sglang" and cfg.placement.engine_gpus == 1
    assert cfg.rollout.over_sampling_batch_size == 2 * cfg.rollout.rollout_batch_size  # the paper's N'/N
    assert cfg.eval.datasets["aime24"].path.endswith("aime-2024.parquet") and cfg.eval.n_samples_per_prompt == 16
    if "agent" in path:  # its environment needs no network: the example calculator
        assert inspect.iscoroutinefunction(load_object(cfg.rollout.episode_fn, "rollout.episode_fn"))


@pytest.mark.parametrize("path", SETTINGS)
def test_paper_setting_stops_at_once_without_its_model(path, tmp_path):
    proc = run_train("--config", path, f"train.output_dir={tmp_path / 'out'}")
    assert proc.returncode != 0
    assert f"model.path: /models/{SETTINGS[path][1]} " in proc.stderr  # missing (or, to the memory plan, unknown)
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
