"""The task registry's contract: every task answers the whole `Task` protocol, a name is chosen once (at
config time, naming `task.name`), and what a task adds to the data's and the embedded model's cache keys is
pinned, so models and data built before stay found."""
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from april_ray.config import ConfigError, TaskConfig, load_config
from april_ray.task.data import Example, dataset_paths, read_examples
from april_ray.task.registry import TASKS, Task, get_task
from april_ray.task.rewards import build_reward_fn

ROOT = Path(__file__).resolve().parents[1]
METHODS = sorted(name for name, value in vars(Task).items() if inspect.isfunction(value) and not name.startswith("_"))
GENERATED = ["countdown", "lookup_countdown"]


def test_the_protocol_is_what_the_tasks_are_held_to():
    assert METHODS == ["check", "data_dir", "generate", "model_key", "reward", "warmup_segments"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_has_each_method_with_the_protocols_parameters(name):
    task = TASKS[name]
    assert task.name == name and get_task(name) is task
    for method in METHODS:
        ours = inspect.signature(getattr(task, method)).parameters
        theirs = list(inspect.signature(getattr(Task, method)).parameters)[1:]  # without self
        assert list(ours) == theirs, (name, method)


def test_an_unknown_task_is_refused_at_config_time_naming_the_key():
    with pytest.raises(ConfigError, match=r"^task\.name: must be one of countdown, math, lookup_countdown, got 'chess'$"):
        load_config(None, ["task.name=chess"])
    with pytest.raises(ValueError, match=r"^task\.name: must be one of .*, got 'chess'$"):
        get_task("chess")


def test_math_needs_a_dataset_file_at_config_time(tmp_path):
    with pytest.raises(ConfigError, match=r"^task\.train_path: the math task needs a dataset file$"):
        load_config(None, ["task.name=math"])
    assert load_config(None, ["task.name=math", f"task.train_path={tmp_path}/d.jsonl"]).task.name == "math"
    with pytest.raises(ValueError, match=r"^task\.train_path: the math task needs a dataset file$"):
        get_task("math").data_dir(TaskConfig(name="math"), str(tmp_path))


@pytest.mark.parametrize("name", GENERATED)
def test_generated_data_is_rewarded_and_its_warmup_segments_spell_the_answer(name, tmp_path):
    cfg = TaskConfig(name=name, num_train=40, num_eval=8)
    task = get_task(name)
    train, evaluation = dataset_paths(cfg, str(tmp_path))
    assert train.parent == task.data_dir(cfg, str(tmp_path))
    examples = read_examples(train)
    assert [(e.prompt, e.answer) for e in examples] == [(r["prompt"], r["answer"]) for r in task.generate(cfg, 40, cfg.seed)]
    assert len(read_examples(evaluation)) == 8
    for ex in examples:
        segments = task.warmup_segments(ex)
        assert "".join(text for text, _ in segments) == ex.answer and any(trained for _, trained in segments)
        assert task.reward(ex.prompt, ex.answer, ex.answer, {}) == 1.0
        assert task.reward(ex.prompt, ex.answer[:-1], ex.answer, {}) == 0.0


def test_only_the_agent_tasks_environment_text_is_left_out_of_the_warmup():
    [(text, trained)] = get_task("countdown").warmup_segments(Example(0, "0009-3:", " 0006 0003 0000"))
    assert (text, trained) == (" 0006 0003 0000", True)
    segments = get_task("lookup_countdown").warmup_segments(Example(0, "ab-3:", ""))
    assert [trained for _, trained in segments] == [True, False, True]


def test_the_math_task_scores_with_math_verify():
    assert get_task("math").reward("", "The answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert get_task("math").reward("", "\\boxed{4}", "5") == 0.0


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_configured_reward_is_the_tasks_own(name):
    assert build_reward_fn(TaskConfig(name=name)) == get_task(name).reward


def test_the_tasks_own_reward_after_think():
    scored = build_reward_fn(TaskConfig(reward_after_think=True))
    assert scored("0009-3:", "so</think> 0006 0003 0000", "") == 1.0
    assert scored("0009-3:", " 0006 0003 0000", "") == 0.0


def test_cache_keys_are_those_the_cache_holds(tmp_path):
    """Data and models built before the registry are found: each task's entries are pinned."""
    assert get_task("countdown").model_key(TaskConfig()) == {}
    assert get_task("lookup_countdown").model_key(TaskConfig()) == {"name": "lookup_countdown", "format": 5}
    assert get_task("math").model_key(TaskConfig()) == {"name": "math", "format": 5}
    assert get_task("countdown").data_dir(TaskConfig(), "c").name == "countdown-f458cdcb84"
    cfg = TaskConfig(name="lookup_countdown", max_step=2, num_train=100)
    assert get_task("lookup_countdown").data_dir(cfg, "c").name == "lookup-countdown-978fc15067"


def test_the_engines_load_no_task():
    """The engine package loads policies (april_ray/model.py), never a task: the embedded model's warm-up
    lives in april_ray/task/embedded_model.py, and config.py imports the registry only to validate."""
    code = ("import importlib, pkgutil, sys\nimport april_ray.engine as engine\n"
            "for m in pkgutil.iter_modules(engine.__path__):\n    importlib.import_module(f'april_ray.engine.{m.name}')\n"
            "import april_ray.model\nprint(sorted(name for name in sys.modules if name.startswith('april_ray.task')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[]"
