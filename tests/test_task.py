import json

import numpy as np
import pytest

from april_ray.config import LengthConfig, TaskConfig
from april_ray.task.data import dataset_paths, read_examples
from april_ray.task.math_task import math_reward
from april_ray.task.registry import get_task
from april_ray.task.countdown import TOKENS_PER_TERM, countdown_reward, generate, sample_num_terms, write_jsonl
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
    assert get_task("math").reward("", response, answer) == expected


# -- bad input: each answered with an error naming the file and line (or key), nothing lost ------------
def rows_file(tmp_path, content: bytes, name="d.jsonl"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_byte_order_mark_and_crlf_line_ends_are_valid(tmp_path):
    rows = [{"prompt": "a\r\nb", "answer": "1"}, {"prompt": "é", "answer": 2}]
    body = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n\r\n"
    examples = read_examples(rows_file(tmp_path, "\ufeff".encode() + body.encode("utf-8")))
    assert [(e.prompt, e.answer, e.index) for e in examples] == [("a\r\nb", "1", 0), ("é", "2", 1)]
    assert examples[1].where.endswith("d.jsonl:2")


@pytest.mark.parametrize("content,message", [
    (b'{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"}\n', r"d\.jsonl:2: empty row"),
    (b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n',
     r"d\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)"),
    (b'{"prompt": "a", "answer": "1"}\n[1, 2]\n', r"d\.jsonl:2: expected an object .* got list"),
    (b'{"prompt": 5, "answer": "1"}\n', r"d\.jsonl:1: field 'prompt' must be a non-empty string"),
    (b'{"prompt": "  ", "answer": "1"}\n', r"d\.jsonl:1: field 'prompt' must be a non-empty string"),
    (b'{"prompt": "a", "answer": null}\n', r"d\.jsonl:1: missing field 'answer'"),
    (b'{"prompt": "a", "answer": [1]}\n', r"d\.jsonl:1: field 'answer' must be a non-empty string or a number"),
    (b'{"prompt": "a", "answer": true}\n', r"d\.jsonl:1: field 'answer' must be"),
    (b'{"prompt": [{"role": "user"}], "answer": "1"}\n', r"d\.jsonl:1: field 'prompt'\[0\]: expected a message"),
    (b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "ans', r"d\.jsonl:2: invalid JSON"),
    (b"\n\n", r"d\.jsonl: no examples"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        read_examples(rows_file(tmp_path, content))


def test_prompts_longer_than_the_context_fail_or_are_skipped_with_a_count(tmp_path):
    from april_ray.task.data import fit_context

    rows = [{"prompt": "x" * n, "answer": "1"} for n in (5, 50, 8, 60)]
    examples = read_examples(rows_file(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode()))
    with pytest.raises(ValueError, match=r"d\.jsonl:2 \(50 tokens\), .*d\.jsonl:4 \(60 tokens\): prompt longer than the "
                                         r"10 tokens .* \(2 such rows\); raise engine\.max_model_len or set "
                                         r"task\.overlong_prompts=skip"):
        fit_context(examples, list, 10, "fail", "task.overlong_prompts")
    said = []
    kept = fit_context(examples, list, 10, "skip", "task.overlong_prompts", said.append)
    assert [e.index for e in kept] == [0, 2]  # rows keep their index in the file
    assert "skipped 2 of 4 prompts longer than 10 tokens" in said[0] and "d.jsonl:2" in said[0]
    assert fit_context(examples, list, 100, "fail", "task.overlong_prompts") == examples


def test_the_overlong_option_is_in_the_config():
    from april_ray.config import ConfigError, load_config

    assert load_config(None, ["task.overlong_prompts=skip"]).task.overlong_prompts == "skip"
    with pytest.raises(ConfigError, match="task.overlong_prompts"):
        load_config(None, ["task.overlong_prompts=maybe"])
    with pytest.raises(ConfigError, match="task.reward_timeout_s"):
        load_config(None, ["task.reward_timeout_s=0"])


def test_a_reward_that_raises_hangs_or_returns_no_number_scores_zero_and_is_counted():
    import asyncio
    import threading
    import time

    from april_ray.task.rewards import RewardRunner

    release = threading.Event()

    def reward(prompt, response, answer):
        if prompt == "raise":
            raise ZeroDivisionError("bad parse")
        if prompt == "hang":
            release.wait(30)
        if prompt == "nan":
            return float("nan")
        if prompt == "none":
            return None
        return 1.0

    said = []
    runner = RewardRunner(reward, timeout_s=1.0, log=said.append)

    async def go():
        ticks = 0

        async def ticker():  # the event loop keeps turning while a reward hangs
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        t0 = time.perf_counter()
        out = await asyncio.gather(*[runner(p, "r", "a") for p in ("ok", "raise", "hang", "nan", "none", "ok")])
        t.cancel()
        return out, time.perf_counter() - t0, ticks

    out, wall, ticks = asyncio.run(go())
    release.set()
    assert out == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert runner.drain_errors() == 4 and runner.errors == 0 and runner.total_errors == 4 and runner.hung == 1
    assert wall < 30 and ticks >= 5  # the loop turned while the hung reward held its thread
    assert any("ZeroDivisionError" in s for s in said) and any("task.reward_timeout_s=1s" in s for s in said)


def test_the_engine_worker_scores_a_failing_reward_zero_and_reports_it_in_stats():
    import asyncio

    from april_ray.rollout.engine_worker import EngineWorker
    from april_ray.types import EngineStats, Sample, SampleState, SamplingParams
    from tests.fakes import FakeEngine

    class Engine(FakeEngine):
        def stats(self, drain=True):
            return EngineStats(0, 0, 0.0, 0, 0, self.version, [])

    def reward(prompt, response, answer):
        if answer == "boom":
            raise RuntimeError("reward server down")
        return 1.0

    worker = EngineWorker(Engine(), lambda ids: "x" * len(ids), reward, SamplingParams(), reward_timeout_s=5)

    async def go():
        samples = [Sample(f"s{i}", "g", "p", answer, [5], 10) for i, answer in enumerate(("1", "boom", "1"))]
        return await worker.generate_group(samples, ("run", 0))

    metas, samples = asyncio.run(go())
    assert [s.state for s in samples] == [SampleState.FINISHED] * 3 and [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert worker.stats(drain=True).reward_errors == 1 and worker.stats(drain=True).reward_errors == 0


def test_a_missing_or_corrupt_model_directory_is_named(tmp_path, random_model_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    from april_ray.model import check_model_dir

    assert check_model_dir(random_model_dir) == random_model_dir
    half = tmp_path / "bf16"  # a GPU checkpoint's dtypes, which numpy has no type for: its header is read all the same
    shutil.copytree(random_model_dir, half)
    save_file({k: v.bfloat16() for k, v in load_file(half / "model.safetensors").items()}, half / "model.safetensors")
    assert check_model_dir(half) == half
    with pytest.raises(ValueError, match=f"model.path: {tmp_path}/none does not exist"):
        check_model_dir(tmp_path / "none")
    bad = tmp_path / "m"
    shutil.copytree(random_model_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"model.path: {weights} is not a readable safetensors file"):
        check_model_dir(bad)
    weights.unlink()
    with pytest.raises(ValueError, match=r"has no weights \(model.safetensors"):
        check_model_dir(bad)
    (bad / "config.json").write_text("{trunc")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        check_model_dir(bad)
    (bad / "config.json").unlink()
    with pytest.raises(ValueError, match=f"model.path: {bad} has no config.json"):
        check_model_dir(bad)


def test_math_verify_runs_under_the_reward_runner_off_the_main_thread():
    import asyncio

    from april_ray.task.rewards import RewardRunner

    runner = RewardRunner(math_reward, timeout_s=30)
    assert asyncio.run(runner("", "The answer is \\boxed{\\frac{1}{2}}", "0.5")) == 1.0 and runner.total_errors == 0


class _HeldEngine:
    """Holds every request's future for the test to resolve; refuses ids starting "bad" (an error of the
    call) and is interrupted by ids starting "stop" (`_Interrupt`, not an error of the call)."""

    def __init__(self):
        self.futures = []

    def generate(self, request):
        import asyncio

        if request.request_id.startswith("bad"):
            raise ValueError(f"request {request.request_id}: too long")
        if request.request_id.startswith("stop"):
            raise _Interrupt
        fut = asyncio.get_running_loop().create_future()
        self.futures.append(fut)
        return fut


class _Interrupt(BaseException):
    pass


def _held_worker():
    from april_ray.rollout.engine_worker import EngineWorker
    from april_ray.types import SamplingParams

    engine = _HeldEngine()
    return engine, EngineWorker(engine, lambda ids: "", lambda *a: 0.0, SamplingParams(max_new_tokens=8))


async def _settle():
    """Let every task started so far run to its next wait (a group call is a task per sample)."""
    import asyncio

    for _ in range(5):
        await asyncio.sleep(0)


def _samples(ids):
    from april_ray.types import Sample

    return [Sample(i, "g", "p", "", [5], 8) for i in ids]


def test_a_failed_output_fails_the_group_call_and_cancels_the_others():
    """One request the engine refuses fails the whole call (the monitor keeps the samples as sent, stores
    them and fails the step), and the group's other requests are cancelled on the engine, not left running."""
    import asyncio

    engine, worker = _held_worker()

    async def go(ids):
        samples = _samples(ids)
        with pytest.raises(ValueError, match="too long"):
            await worker.generate_group(samples, ("run", 0))
        await _settle()
        return samples

    samples = asyncio.run(go(["a", "b", "bad", "c"]))
    assert len(engine.futures) == 3 and all(f.cancelled() for f in engine.futures)  # a, b and c
    assert all(not s.response_ids for s in samples)

    async def fails_later():  # an output that arrives as an error, after the requests went out
        engine.futures.clear()
        call = asyncio.ensure_future(worker.generate_group(_samples("xyz"), ("run", 1)))
        await _settle()
        engine.futures[1].set_exception(RuntimeError("engine lost the request"))
        with pytest.raises(RuntimeError, match="lost the request"):
            await call
        return engine.futures

    futures = asyncio.run(fails_later())
    assert futures[0].cancelled() and futures[2].cancelled() and not futures[1].cancelled()


def test_a_cancelled_group_call_cancels_the_requests_still_out():
    """A call cancelled by its caller (the task awaiting `generate_group`): the requests still out are
    cancelled, and the samples stay as they were sent."""
    import asyncio

    from april_ray.types import FinishReason, GenerateOutput

    engine, worker = _held_worker()

    async def cancelled():
        samples = _samples("xyz")
        call = asyncio.ensure_future(worker.generate_group(samples, ("run", 2)))
        await _settle()
        engine.futures[0].set_result(GenerateOutput("x@", [7], [-1.0], [0], FinishReason.ABORT))
        await _settle()
        call.cancel()
        await _settle()
        return engine.futures, samples

    futures, samples = asyncio.run(cancelled())
    assert not futures[0].cancelled() and futures[1].cancelled() and futures[2].cancelled()
    assert all(not s.response_ids for s in samples)  # the samples stay as they were sent


def test_an_interrupt_while_sending_cancels_the_requests_sent_and_goes_on_up():
    import asyncio

    engine, worker = _held_worker()

    async def interrupt():
        with pytest.raises(_Interrupt):
            await worker.generate_group(_samples(("a", "b", "stop")), ("run", 3))
        return engine.futures

    futures = asyncio.run(interrupt())
    assert len(futures) == 2 and all(f.cancelled() for f in futures)


def test_a_cancelled_reward_cancels_the_group_call():
    import asyncio

    from april_ray.types import FinishReason, GenerateOutput

    engine, worker = _held_worker()
    rewards = []

    class PendingReward:
        async def score(self, *args):
            rewards.append(asyncio.get_running_loop().create_future())
            return await rewards[-1], None

    async def reward_cancelled():
        worker.reward = PendingReward()
        call = asyncio.ensure_future(worker.generate_group(_samples("r"), ("run", 4)))
        await _settle()
        engine.futures[0].set_result(GenerateOutput("r@", [7], [-1.0], [0], FinishReason.STOP))
        await _settle()
        assert len(rewards) == 1 and not call.done()  # the output is in, its reward is not
        rewards[0].cancel()
        await _settle()
        return call

    assert asyncio.run(reward_cancelled()).cancelled()


# -- dataset metadata: a row's other fields travel with its samples ------------------------------------
def test_a_rows_other_fields_become_the_samples_metadata(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from april_ray.rollout.prompt_source import PromptSource

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
             "reward_model": {"ground_truth": "2"}, "data_source": "dapo", "extra_info": {"index": 7, "tags": [1, 2]},
             "level": 3.5}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    [ex] = read_examples(tmp_path / "d.parquet", answer_key="reward_model")
    assert ex.metadata == {"data_source": "dapo", "extra_info": {"index": 7, "tags": [1, 2]}, "level": 3.5}
    assert json.loads(json.dumps(ex.metadata)) == ex.metadata  # plain JSON values (pyarrow gave Python ones)
    assert ex.prompt == "1+1?" and ex.as_given == rows[0]["prompt"]  # the system turn is kept for the template
    [group] = PromptSource([ex], lambda p: [len(p)], 3, 8).take(1)
    assert [s.metadata for s in group.samples] == [ex.metadata] * 3
    assert group.samples[0].prompt_ids == [2]  # the encoder got the messages, not the text

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q", "final_answer": 4, "difficulty": 2}) + "\n"
                    + json.dumps({"question": "r", "final_answer": 5}) + "\n")
    a, b = read_examples(path, "question", "final_answer")
    assert (a.metadata, b.metadata, a.as_given) == ({"difficulty": 2}, {}, "q")
    assert read_examples(path, "question", "final_answer", metadata_keys=[])[0].metadata == {}  # task.metadata_keys


def test_a_dataset_written_by_two_jobs_at_once_is_whole_and_leaves_nothing_else(tmp_path):
    """Jobs that start together with one cache directory write the same dataset file at once: every write
    succeeds, the file is whole, and no temporary file is left beside it."""
    from concurrent.futures import ThreadPoolExecutor

    rows = [{"i": i, "text": "x" * 200} for i in range(2000)]
    path = tmp_path / "data" / "train.jsonl"
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: write_jsonl(rows, path), range(24)))
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    assert [p.name for p in path.parent.iterdir()] == ["train.jsonl"]
