"""`task.reward_per_group`: a group function scores each group once, when its last sample finishes, whatever
steps, aborts and engines the group went through; a call of it that fails scores the whole group 0, each
sample counted. Without Ray: the runner, the engine worker (fake engine and the CPU engine on the tiny
model) and the monitor on the fakes."""
import asyncio
import importlib
import sys

import pytest

from april_ray.config import ConfigError, TaskConfig, load_config
from april_ray.rollout.engine_worker import EngineWorker, build_worker
from april_ray.rollout.local import resolve
from april_ray.task.rewards import RewardRunner
from april_ray.types import Sample, SampleState, SamplingParams
from tests.fakes import FakeEngine, make_rollout_parts
from tests.test_rollout import cfg, check_invariants

GROUP_REWARDS = '''
import asyncio

CALLS = []

def by_length(prompts, responses, answers, metadatas):
    """Each response's length over the longest, plus its metadata's bonus; every call recorded."""
    CALLS.append(list(responses))
    longest = max(map(len, responses)) or 1
    return [len(r) / longest + m.get("bonus", 0) for r, m in zip(responses, metadatas)]

async def ranks(prompts, responses, answers):
    await asyncio.sleep(0)
    return tuple(float(i) for i in range(len(responses)))

def boom(prompts, responses, answers, metadatas):
    raise RuntimeError("judge down")

def short(prompts, responses, answers, metadatas):
    return [1.0] * (len(responses) - 1)

def words(prompts, responses, answers, metadatas):
    return ["good"] * len(responses)

def one(prompts, responses, answers, metadatas):
    return 1.0

def nan(prompts, responses, answers, metadatas):
    return [float("nan")] * len(responses)

async def hang(prompts, responses, answers, metadatas):
    await asyncio.sleep(60)
'''


@pytest.fixture
def group_module(tmp_path, monkeypatch):
    (tmp_path / "group_rewards.py").write_text(GROUP_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("group_rewards")
    sys.modules.pop("group_rewards", None)


def quiet(fn, timeout_s=5.0) -> RewardRunner:
    return RewardRunner(fn, timeout_s, log=lambda *_: None)


def test_a_group_function_scores_the_responses_in_order_sync_or_async(group_module):
    r = quiet(group_module.by_length)
    got = asyncio.run(r.group(["p"] * 3, ["ab", "abcd", ""], ["a"] * 3, [{}, {"bonus": 1}, {}]))
    assert got == [0.5, 2.0, 0.0] and r.errors == 0
    assert asyncio.run(quiet(group_module.ranks).group(["p"] * 3, ["a"] * 3, [""] * 3, [{}] * 3)) == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("name", ["boom", "short", "words", "one", "nan", "hang"])
def test_a_group_function_that_fails_scores_every_sample_zero_each_counted(group_module, name):
    logged = []
    r = RewardRunner(getattr(group_module, name), 0.3, log=logged.append)
    assert asyncio.run(r.group(["p"] * 4, ["a"] * 4, [""] * 4, [{}] * 4)) == [0.0] * 4
    assert r.drain_errors() == 4 and r.drain_errors() == 0
    assert len(logged) == 1 and "(a group of 4)" in logged[0]


def test_reward_per_group_needs_a_reward_fn_and_names_the_field():
    with pytest.raises(ConfigError, match=r"task.reward_per_group: needs task.reward_fn"):
        load_config(None, ["task.reward_per_group=true"])
    with pytest.raises(ConfigError, match=r"task.reward_per_group: task.reward_url scores one sample at a time"):
        load_config(None, ["task.reward_per_group=true", "task.reward_url=http://127.0.0.1:1/"])
    assert load_config(None, ["task.reward_per_group=true", "task.reward_fn=a:b"]).task.reward_per_group


# -- the engine worker ---------------------------------------------------------------------------------
def fake_worker(fn, engine=None, timeout_s=5.0):
    return EngineWorker(engine or FakeEngine(tick=0.001), lambda ids: "x" * len(ids), fn, SamplingParams(),
                        reward_timeout_s=timeout_s, reward_per_group=True)


def group_of(lengths, gid="g"):
    """A group whose samples stop at these response lengths on the fake engine."""
    return [Sample(f"{gid}s{i}", gid, "p", "", [n], 100) for i, n in enumerate(lengths)]


async def abort_when(worker, step, done):
    while not done():
        await asyncio.sleep(0.001)
    worker.abort_all(step)


def test_a_group_split_by_an_abort_is_scored_once_when_its_last_sample_finishes_on_another_engine():
    calls = []

    def judge(prompts, responses, answers, metadatas):
        calls.append(sorted(responses))
        return [float(len(r)) for r in responses]

    first, second = fake_worker(judge), fake_worker(judge)

    async def go():
        call = asyncio.ensure_future(first.generate_group(group_of([3, 3, 60, 60]), ("run", 0)))
        await abort_when(first, ("run", 0), lambda: first.engine.num_calls == 4 and len(first.engine.running) == 2)
        metas, samples = await call
        assert [s.state for s in samples] == [SampleState.FINISHED] * 2 + [SampleState.PARTIAL] * 2
        assert [s.reward for s in samples] == [None] * 4 and [m.reward for m in metas] == [None] * 4
        assert calls == []  # the group is not complete: nothing scored yet
        # the monitor resends the unfinished samples, with the finished ones as context, in a later step
        return await second.generate_group(samples[2:], ("run", 1), samples[:2])

    metas, samples = asyncio.run(go())
    assert calls == [["xxx", "xxx", "x" * 60, "x" * 60]]  # once, with the whole group's final responses
    assert [s.sample_id for s in samples] == ["gs2", "gs3", "gs0", "gs1"]  # sent, then context
    assert [s.reward for s in samples] == [m.reward for m in metas] == [60.0, 60.0, 3.0, 3.0]
    assert [m.num_new_tokens for m in metas][2:] == [0, 0] and [s.response_ids for s in samples[2:]] == [[7] * 3] * 2


def test_a_group_finished_in_one_call_is_scored_in_it_and_a_closed_step_returns_no_context():
    calls = []

    def judge(prompts, responses, answers, metadatas):
        calls.append(len(responses))
        return [1.0, 0.0]

    worker = fake_worker(judge)
    metas, samples = asyncio.run(worker.generate_group(group_of([2, 4]), ("run", 0)))
    assert calls == [2] and [s.reward for s in samples] == [m.reward for m in metas] == [1.0, 0.0]
    worker.abort_all(("run", 1))
    context = [Sample("hs0", "h", "p", "", [2], 100, response_ids=[7, 7], logprobs=[0.0] * 2, versions=[0, 0],
                      state=SampleState.FINISHED)]
    metas, samples = asyncio.run(worker.generate_group(group_of([5], "h")[:1], ("run", 1), context))
    assert calls == [2] and len(samples) == 1 and samples[0].state == SampleState.QUEUED  # untouched, no context


def test_a_failing_group_function_scores_the_group_zero_and_counts_each_sample(group_module):
    worker = fake_worker(group_module.short)
    metas, samples = asyncio.run(worker.generate_group(group_of([2, 3, 4]), ("run", 0)))
    assert [s.reward for s in samples] == [m.reward for m in metas] == [0.0] * 3
    assert worker.reward.drain_errors() == 3


def test_the_cpu_engine_worker_loads_the_group_function_by_path(group_module, random_model_dir):
    """build_worker on the tiny model: the function by dotted path, the group split by an abort and
    resumed on a second worker, scored once with the decoded final responses."""
    from april_ray.config import EngineConfig, SamplingConfig, StalenessConfig

    task = TaskConfig(reward_fn="group_rewards:by_length", reward_per_group=True)
    engine = EngineConfig(max_num_seqs=8, max_model_len=128)
    sampling = SamplingConfig(temperature=0, max_response_len=64)
    first, second = (build_worker(engine, sampling, StalenessConfig(), task, str(random_model_dir)) for _ in "ab")
    group = [Sample(f"gs{i}", "g", "p", "", first.encode("12+3="), n, metadata={"bonus": i})
             for i, n in enumerate((1, 1, 64, 64))]
    group_module.CALLS.clear()

    async def go():
        call = asyncio.ensure_future(first.generate_group(group, ("run", 0)))
        await abort_when(first, ("run", 0), lambda: first.engine.stats(drain=False).num_generated_tokens >= 6)
        _, samples = await call
        assert [s.state for s in samples[:2]] == [SampleState.FINISHED] * 2 and group_module.CALLS == []
        unfinished = [s for s in samples if s.state != SampleState.FINISHED]
        assert unfinished, "the long samples should have been aborted"
        finished = [s for s in samples if s.state == SampleState.FINISHED]
        return await second.generate_group(unfinished, ("run", 1), finished)

    metas, samples = asyncio.run(go())
    texts = [second.decode(s.response_ids) for s in samples]
    assert group_module.CALLS == [texts]
    longest = max(map(len, texts)) or 1
    assert [s.reward for s in samples] == [len(t) / longest + s.metadata["bonus"] for s, t in zip(samples, texts)]
    assert all(s.state == SampleState.FINISHED for s in samples) and len(samples) == 4


def test_evaluation_scores_each_response_as_a_group_of_one():
    calls = []

    def judge(prompts, responses, answers, metadatas):
        calls.append(len(responses))
        return [0.5]

    worker = fake_worker(judge)
    got = asyncio.run(worker.evaluate([("p", [3], "a", {}), ("q", [4], "b", {})], 1.0, "eval"))
    assert got == [(0.5, 3), (0.5, 4)] and calls == [1, 1]


def test_episodes_end_first_and_those_returning_none_are_scored_by_the_group_function():
    from april_ray.rollout.episode import ToolJournal

    calls = []

    def judge(prompts, responses, answers, metadatas):
        calls.append(list(responses))
        return [10.0 + j for j in range(len(responses))]

    async def episode(ep):
        await ep.generate()
        if ep.metadata.get("own") == "raise":
            raise RuntimeError("tool broke")
        return ep.metadata.get("own")

    worker = fake_worker(judge)
    worker.use_episodes(episode, ToolJournal(), max_model_len=200, tool_timeout_s=5.0, encode=lambda s: [])
    group = [Sample(f"gs{i}", "g", "p", "", [n], 100, metadata={"own": own})
             for i, (n, own) in enumerate([(2, None), (3, 0.25), (4, None), (5, "raise")])]
    metas, samples = asyncio.run(worker.generate_group(group, ("run", 0)))
    assert calls == [["xx", "xxx", "xxxx", "xxxxx"]]  # the whole group's final responses
    assert [s.reward for s in samples] == [m.reward for m in metas] == [10.0, 0.25, 12.0, 0.0]
    assert worker.reward.drain_errors() == 0 and "RuntimeError: tool broke" in metas[3].error  # dropped, unscored

# -- the monitor ---------------------------------------------------------------------------------------
class Judge:
    """A group function whose values name its call: call c gives the j-th response c * 100 + j."""

    def __init__(self):
        self.sizes: list[int] = []

    def __call__(self, prompts, responses, answers, metadatas):
        c = len(self.sizes)
        self.sizes.append(len(responses))
        return [c * 100.0 + j for j in range(len(responses))]

    def call_of(self, rewards: list[float]) -> int:
        """The one call these rewards came from (all of them, one per position)."""
        calls = {int(r // 100) for r in rewards}
        assert len(calls) == 1 and sorted(r % 100 for r in rewards) == list(range(len(rewards))), rewards
        return calls.pop()


def group_rewards_of(result):
    return [[resolve(h).reward for h in g] for g in result.groups], [[m.reward for m in ms] for ms in result.metas]


def test_the_monitor_scores_each_group_once_across_aborts_steps_and_engines():
    c = cfg(max_versions=100)
    judge = Judge()
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=1, abort_delay=0.003, cap=5, reward_fn=judge,
                                                               reward_per_group=True)

    async def main():
        seen, results = set(), []
        for step in range(10):
            for e in engines:
                e.update_weights(None, step)
            results.append(await rollout.step(step, step))
            check_invariants(results[-1], rollout, source, store, c, seen)
            # a stored finished sample waits for its group's reward, in the store and in the monitor's cache
            for g in store.partial.values():
                for s in g.samples:
                    assert s.reward is None
                    if s.state == SampleState.FINISHED:
                        assert rollout.finished_metas[s.sample_id].reward is None
        return results

    results = asyncio.run(main())
    used = []
    for r in results:
        rewards, meta_rewards = group_rewards_of(r)
        assert rewards == meta_rewards  # the monitor's metas (and so the filter) saw the group's rewards
        used += [judge.call_of(g) for g in rewards]
    assert len(used) == len(set(used))  # no group rewarded twice, no call's values shared by two groups
    assert set(judge.sizes) == {c.rollout.n_samples_per_prompt}  # always the whole group
    complete_in_store = sum(1 for g in store.complete)
    assert len(judge.sizes) == len(used) + complete_in_store  # one call per complete group, no more
    # groups whose samples finished in different steps (by their tokens' versions) were scored together
    split = [g for r in results for g in r.groups
             if len({max(resolve(h).versions) for h in g}) > 1]
    assert split


def test_the_monitor_with_a_dying_engine_never_mixes_two_calls_in_a_group():
    """A call lost with its engine after scoring its group: its values reach no one; the group is scored
    again, whole, by the call that completes it on a live engine."""
    c = cfg(max_versions=100)
    judge = Judge()
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=9, tick=0.001, reward_fn=judge,
                                                               reward_per_group=True)

    async def main():
        seen = set()
        results = [await rollout.step(0, 0)]
        killer = asyncio.get_running_loop().call_later(0.01, pool.kill, 1)
        results.append(await rollout.step(1, 0))
        killer.cancel()
        for r in results:
            check_invariants(r, rollout, source, store, c, seen)
        return results

    results = asyncio.run(main())
    assert rollout.alive == [True, False]
    used = [judge.call_of(g) for r in results for g in group_rewards_of(r)[0]]
    assert len(used) == len(set(used)) and set(judge.sizes) == {c.rollout.n_samples_per_prompt}


def test_the_dynamic_filter_reads_the_group_rewards():
    """A group function that scores some groups uniformly: the filter drops exactly those."""
    c = cfg(dynamic_filter=True, max_versions=100)

    def judge(prompts, responses, answers, metadatas):
        if answers[0] == "True":  # every third prompt: all equal, no signal
            return [1.0] * len(responses)
        return [float(j % 2) for j in range(len(responses))]

    rollout, pool, source, store, engines = make_rollout_parts(c, seed=8, reward_fn=judge, reward_per_group=True)
    results = [asyncio.run(rollout.step(step, 0)) for step in range(3)]
    assert sum(len(r.dropped) for r in results) > 0
    for r in results:
        assert all(sorted(resolve(h).reward for h in g) == [0.0, 0.0, 1.0, 1.0] for g in r.groups)
        assert all({resolve(h).reward for h in g} == {1.0} for g in r.dropped_groups)


def test_without_the_flag_calls_carry_no_context():
    c = cfg(max_versions=100)
    rollout, pool, source, store, engines = make_rollout_parts(c, seed=1, abort_delay=0.003)
    sent = []
    for w in pool.workers:
        def spy(samples, step, context=(), generate=w.generate_group):
            sent.append(len(context))
            return generate(samples, step, context)
        w.generate_group = spy
    asyncio.run(rollout.step(0, 0))
    asyncio.run(rollout.step(1, 1))
    assert sent and set(sent) == {0} and pool.reward_per_group is False


def test_the_store_keeps_unrewarded_finished_samples_of_unfinished_groups_across_a_checkpoint():
    """A checkpoint taken under task.reward_per_group holds finished samples without a reward in partial
    groups; they load back as they were. A complete group must be rewarded."""
    import json

    from april_ray.rollout.store import PartialRolloutStore
    from april_ray.types import Group

    done = Sample("gs0", "g", "p", "", [3], 10, response_ids=[7] * 3, logprobs=[0.0] * 3, versions=[0] * 3,
                  state=SampleState.FINISHED)
    waiting = Sample("gs1", "g", "p", "", [9], 10, response_ids=[7], logprobs=[0.0], versions=[0],
                     state=SampleState.PARTIAL)
    store = PartialRolloutStore()
    store.put_partial([Group("g", 0, [done, waiting])])
    state = json.loads(json.dumps(store.state_dict()))
    again = PartialRolloutStore()
    again.load_state_dict(state)
    assert again.partial["g"].samples == [done, waiting]
    group = state.pop("partial")[0]
    group["samples"][1] = {**group["samples"][0], "sample_id": "gs1"}  # both finished, neither rewarded
    with pytest.raises(ValueError, match=r"store.complete\[0\]: group g has a sample without a reward"):
        again.load_state_dict(state | {"partial": [], "complete": [group]})
