import json

import numpy as np
import pytest

from april_ray.config import LengthConfig, TaskConfig
from april_ray.task.data import dataset_paths, read_examples
from april_ray.task.rewards import get_reward_fn, math_reward
from april_ray.task.countdown import TOKENS_PER_TERM, countdown_reward, generate, sample_num_terms
from april_ray.task.tokenizer import build_tokenizer


def test_tokenizer_round_trips_and_reloads(tmp_path):
    tok = build_tokenizer()
    text = "0153-3: 0150 0147\nWhat is $\\frac{1}{2}$?"
    assert tok.decode(tok.encode(text)) == text
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode(text) == tok.encode(text) and again.eos_token_id == tok.eos_token_id


def test_default_lengths_are_long_tailed():
    cfg = TaskConfig()
    rows = generate(cfg, 20000, seed=0)
    lengths = np.array([len(build_tokenizer().encode(r["answer"])) + 1 for r in rows[:3000]])
    assert np.percentile(lengths, 99) >= 8 * np.median(lengths)
    assert cfg.length.max_terms * TOKENS_PER_TERM + 1 >= 500


@pytest.mark.parametrize("family", ["lognormal", "pareto", "exponential", "uniform"])
def test_length_families_respect_bounds(family):
    cfg = LengthConfig(family=family, min_terms=2, max_terms=50)
    terms = sample_num_terms(cfg, np.random.default_rng(0), 5000)
    assert terms.min() >= 2 and terms.max() <= 50


def test_countdown_examples_are_correct_and_rewarded():
    for row in generate(TaskConfig(), 200, seed=3):
        start, step = map(int, row["prompt"].rstrip(":").split("-"))
        values = [int(v) for v in row["answer"].split()]
        assert values[0] == start - step and 0 <= values[-1] < step
        assert all(a - b == step for a, b in zip(values, values[1:]))
        assert countdown_reward(row["prompt"], row["answer"]) == 1.0
        assert countdown_reward(row["prompt"], row["answer"][:-1]) == 0.0
    assert countdown_reward("garbage", " 0001") == 0.0


def test_generated_dataset_goes_through_the_jsonl_reader(tmp_path):
    cfg = TaskConfig(num_train=50, num_eval=10)
    train, evaluation = dataset_paths(cfg, str(tmp_path))
    examples = read_examples(train)
    assert len(examples) == 50 and [e.index for e in examples] == list(range(50))
    assert len(read_examples(evaluation)) == 10
    assert dataset_paths(cfg, str(tmp_path)) == (train, evaluation)  # cached


def test_reader_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        read_examples(path)
    path.write_text(json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: missing field 'answer'"):
        read_examples(path)
    with pytest.raises(FileNotFoundError):
        read_examples(tmp_path / "none.jsonl")


def test_parquet_with_dapo_layout(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": "What is 1+1?"}], "reward_model": {"ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    [ex] = read_examples(tmp_path / "d.parquet", answer_key="reward_model")
    assert ex.prompt == "What is 1+1?" and ex.answer == "2"


@pytest.mark.parametrize("response,answer,expected", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so we get $x = 3$", "3", 1.0),
    ("\\boxed{4}", "5", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("The final answer is \\boxed{(1, 2)}", "(1,2)", 1.0),
    ("I don't know", "7", 0.0),
])
def test_math_reward_with_math_verify(response, answer, expected):
    assert math_reward("", response, answer) == expected
    assert get_reward_fn("math")("", response, answer) == expected
