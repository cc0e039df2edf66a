"""Multi-turn episodes without Ray: the embedded agent task's episode function on an engine that writes the
right transcript token by token, interrupted by aborts at every point, saved as JSON, resumed, crashed."""
import asyncio
import json

import pytest

from april_ray.rollout.engine_worker import EngineWorker
from april_ray.rollout.episode import Episode, ToolJournal
from april_ray.rollout.store import sample_from_json, sample_to_json
from april_ray.task.rewards import RewardRunner
from april_ray.task import lookup_countdown
from april_ray.task.tokenizer import build_tokenizer
from april_ray.types import FinishReason, GenerateOutput, Sample, SampleState, SamplingParams

TOK = build_tokenizer()


class TranscriptEngine:
    """Writes the right transcript of a lookup-countdown prompt, one token per tick, up to a stop id; honours
    the budget and aborts (an aborted request returns its tokens so far), as the CPU engine does."""

    def __init__(self, tick: float = 0.0005):
        self.tick, self.version, self.running, self.requests = tick, 0, {}, []

    async def generate(self, req):
        self.requests.append(req)
        text = TOK.decode(req.input_ids)
        prompt = text[: text.index(":") + 1]
        right = TOK.encode(prompt + right_response(prompt)) + [TOK.eos_token_id]
        todo = right[len(req.input_ids):]
        fut = asyncio.get_running_loop().create_future()
        self.running[req.request_id] = fut
        out: list[int] = []
        try:
            for t in todo:
                if len(out) == req.sampling.max_new_tokens:
                    return self._output(req, out, FinishReason.LENGTH)
                done, _ = await asyncio.wait([fut], timeout=self.tick)
                if done:
                    return self._output(req, out, FinishReason.ABORT)
                out.append(t)
                if t in req.sampling.stop_token_ids:
                    return self._output(req, out, FinishReason.STOP)
            return self._output(req, out, FinishReason.STOP)
        finally:
            self.running.pop(req.request_id, None)

    def _output(self, req, out, reason):
        return GenerateOutput(req.request_id, out, [-0.1] * len(out), [self.version] * len(out), reason)

    def abort_tagged(self, tag):
        futs = [fut for rid, fut in self.running.items() if rid.endswith(tag)]
        for fut in futs:
            if not fut.done():
                fut.set_result(None)
        return len(futs)

    def abort_all(self):
        return self.abort_tagged("")


def make_worker(journal=None, engine=None):
    engine = engine or TranscriptEngine()
    sp = SamplingParams(temperature=1.0, max_new_tokens=512, stop_token_ids=(TOK.eos_token_id,))
    worker = EngineWorker(engine, lambda ids: TOK.decode(ids, skip_special_tokens=True), lookup_countdown.reward, sp,
                          TOK.encode)
    worker.use_episodes(lookup_countdown.episode, journal or ToolJournal(), max_model_len=1024, tool_timeout_s=5.0)
    return engine, worker


def fresh(prompt="ab,qd,zz-2:", sid="e0p0s0", budget=512):
    return Sample(sid, "e0p0", prompt, "", TOK.encode(prompt), budget)


def tool_calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def tool_log(tmp_path, monkeypatch):
    path = tmp_path / "tools.jsonl"
    monkeypatch.setenv(lookup_countdown.TOOL_LOG, str(path))
    return path


def right_response(prompt):
    return "".join(t for t, _ in lookup_countdown.segments(prompt))


def test_an_episode_runs_its_turns_and_masks_the_environment(tool_log):
    engine, worker = make_worker()
    [meta], [s] = asyncio.run(worker.generate_group([fresh()], ("run", 0)))
    assert s.state == SampleState.FINISHED and s.reward == 1.0
    assert TOK.decode(s.response_ids, skip_special_tokens=True) == right_response("ab,qd,zz-2:")
    env = [t for t, m in zip(s.response_ids, s.loss_mask) if not m]
    assert TOK.decode(env) == "".join(lookup_countdown.answer(k, lookup_countdown.value_of(k), 2) for k in ("ab", "qd", "zz"))
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(s.versions, s.logprobs, s.loss_mask) if not m)
    assert meta.num_env_tokens == len(env) == 30 and meta.response_len == len(s.response_ids) - 30
    assert s.episode["turn"] == 4 and len(engine.requests) == 4  # three tool calls and the last turn
    assert [(c["turn"], c["key"]) for c in tool_calls(tool_log)] == [(1, "ab"), (2, "qd"), (3, "zz")]


def test_the_budget_counts_model_tokens_only(tool_log):
    prompt = "ab,qd,zz-2:"
    n_model = sum(len(TOK.encode(t)) for t, m in lookup_countdown.segments(prompt) if m)
    _, worker = make_worker()
    [_], [s] = asyncio.run(worker.generate_group([fresh(prompt, budget=n_model + 1)], ("run", 0)))
    assert s.reward == 1.0 and s.num_model_tokens == n_model + 1  # + EOS: the tool's 30 tokens are free
    _, worker = make_worker()
    [_], [short] = asyncio.run(worker.generate_group([fresh(prompt, budget=n_model - 3)], ("run", 0)))
    assert short.state == SampleState.FINISHED and short.reward == 0.0 and short.num_model_tokens == n_model - 3


@pytest.mark.parametrize("abort_after_s", [0.002, 0.01, 0.03, 0.06])
def test_an_aborted_episode_is_saved_as_json_and_goes_on_at_its_turn(tool_log, abort_after_s):
    """Aborted inside a turn at several points, saved through the store's JSON, resumed at the next step by
    a fresh worker (another process) sharing the journal: the response is exactly right, every tool call ran
    once, and the resumed episode never redid a finished turn."""
    journal = ToolJournal()
    engine, worker = make_worker(journal)

    async def abort_mid_episode():
        call = asyncio.ensure_future(worker.generate_group([fresh()], ("run", 1)))
        await asyncio.sleep(abort_after_s)
        worker.abort_all(("run", 1))
        engine.abort_all()
        return await call

    [meta], [part] = asyncio.run(abort_mid_episode())
    assert part.state == SampleState.PARTIAL and meta.state == SampleState.PARTIAL
    stored = sample_from_json(json.loads(json.dumps(sample_to_json(part))), "store")
    assert stored == part
    turn = part.episode["turn"]
    engine2, worker2 = make_worker(journal)
    [_], [done] = asyncio.run(worker2.generate_group([stored], ("run", 2)))
    assert done.reward == 1.0 and done.num_resumes == (1 if part.response_ids else 0)
    assert done.response_ids[: len(part.response_ids)] == part.response_ids  # nothing of it redone
    assert engine2.requests[0].request_id == f"e0p0s0#{turn}.1@('run', 2)"  # the same turn goes on
    calls = [(c["turn"], c["key"]) for c in tool_calls(tool_log)]
    assert calls == [(1, "ab"), (2, "qd"), (3, "zz")]


def test_a_tool_call_in_flight_when_the_step_ends_finishes_first_and_is_kept(tool_log):
    """The abort lands while the episode waits on a slow tool: the tool finishes, its answer goes into the
    trajectory, and the episode stops at its next turn's start (the step is closed); resumed, it goes on
    without calling the tool again."""
    calls = []

    async def slow_lookup(sample_id, turn, key):
        calls.append(key)
        await asyncio.sleep(0.05)
        return lookup_countdown.value_of(key)

    async def episode(ep):
        while True:
            text = await ep.generate(stop=("?",))
            if not text.endswith("?"):
                return None
            value = await ep.call_tool("lookup", slow_lookup, ep.sample.sample_id, ep.turn, "ab")
            ep.append_env(lookup_countdown.answer("ab", value, 1))

    engine, worker = make_worker()
    worker.episode_fn = episode

    async def abort_during_tool():
        call = asyncio.ensure_future(worker.generate_group([fresh("ab-1:")], ("run", 1)))
        while not calls:
            await asyncio.sleep(0.001)
        worker.abort_all(("run", 1))
        engine.abort_all()
        return await call

    [_], [part] = asyncio.run(abort_during_tool())
    assert part.state == SampleState.PARTIAL
    assert TOK.decode(part.response_ids) == " ?" + lookup_countdown.answer("ab", lookup_countdown.value_of("ab"), 1)  # the answer is kept
    assert len(engine.requests) == 1  # the closed step sent no new turn to the engine
    [_], [done] = asyncio.run(worker.generate_group([part], ("run", 2)))
    assert done.reward == 1.0 and calls == ["ab"]


def test_an_engine_crash_resends_the_episode_as_sent_and_no_returned_tool_call_runs_again(tool_log):
    """The monitor re-dispatches a crashed call's samples from the state they were sent in: the episode
    replays the lost turns, and the journal answers the tool calls that had returned."""
    journal = ToolJournal()
    engine, worker = make_worker(journal)
    sent = fresh()

    async def crash_after_first_tool():
        call = asyncio.ensure_future(worker.generate_group([sent], ("run", 1)))
        while not tool_calls(tool_log):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.005)
        call.cancel()  # the engine is gone with everything of this call
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(crash_after_first_tool())
    _, other = make_worker(journal)
    [_], [done] = asyncio.run(other.generate_group([sent], ("run", 1)))
    assert done.reward == 1.0
    assert [(c["turn"], c["key"]) for c in tool_calls(tool_log)] == [(1, "ab"), (2, "qd"), (3, "zz")]


def test_the_journal_file_survives_a_restart(tmp_path):
    path = tmp_path / "journal.jsonl"
    first = ToolJournal(path)
    asyncio.run(first.put("s/1/0/h/lookup", {"value": 12}))
    asyncio.run(first.put("s/1/0/h/lookup", {"value": 99}))  # a key is recorded once
    with open(path, "a") as f:
        f.write('["s/2/0/h/lookup", {"val')  # cut by a crash mid-write: that call never returned
    again = ToolJournal(path)
    assert asyncio.run(again.begin("s/1/0/h/lookup")) == {"value": 12}
    assert asyncio.run(again.begin("s/2/0/h/lookup")) is None


def test_an_episode_that_raises_is_not_scored_and_carries_its_error():
    async def broken(ep):
        await ep.generate(stop=("?",))
        raise KeyError("bug")

    _, worker = make_worker()
    worker.episode_fn = broken
    [meta], [s] = asyncio.run(worker.generate_group([fresh("ab-1:")], ("run", 0)))
    assert s.state == SampleState.FINISHED and worker.reward.errors == 0  # not a reward: its group is dropped
    assert "Traceback" in meta.error and meta.error.strip().endswith("KeyError: 'bug'")
    assert s.episode["error"] == meta.error


def test_episode_state_must_be_json():
    async def bad_state(ep):
        ep.state["x"] = object()
        await ep.generate(stop=("?",))

    _, worker = make_worker()
    worker.episode_fn = bad_state
    [meta], [_] = asyncio.run(worker.generate_group([fresh("ab-1:")], ("run", 0)))
    assert "episode state of e0p0s0: not JSON values" in meta.error


def test_evaluation_runs_episodes():
    _, worker = make_worker()
    prompts = ["ab-1:", "qd,zz-3:"]
    items = [(p, TOK.encode(p), right_response(p), {}) for p in prompts]
    results = asyncio.run(worker.evaluate(items, 1.0, "eval"))
    assert [r for r, _ in results] == [1.0, 1.0]
    assert [n for _, n in results] == [sum(len(TOK.encode(t)) for t, m in lookup_countdown.segments(p) if m) + 1
                                       for p in prompts]  # model tokens and EOS


def agent_monitor(episode_fn=None, reward_fn=None):
    """The real monitor, source and store over two workers running the agent task's episodes (or
    `episode_fn`): (source, store, monitor, engines)."""
    from april_ray.config import Config, RolloutConfig, SamplingConfig, StalenessConfig
    from april_ray.rollout.local import LocalPool, LocalProxy
    from april_ray.rollout.monitor import CompletionMonitor
    from april_ray.rollout.prompt_source import PromptSource
    from april_ray.rollout.store import PartialRolloutStore
    from april_ray.task.data import Example

    c = Config(rollout=RolloutConfig(rollout_batch_size=4, over_sampling_batch_size=8, n_samples_per_prompt=2,
                                     episode_fn="agent:episode"),
               sampling=SamplingConfig(max_response_len=512), staleness=StalenessConfig(max_versions=100))
    journal = ToolJournal()
    engines, workers = zip(*[make_worker(journal, TranscriptEngine(tick=0.0003)) for _ in range(2)])
    for w in workers:
        w.episode_fn = episode_fn or w.episode_fn
        if reward_fn is not None:
            w.reward = RewardRunner(reward_fn, 5.0, log=lambda *_: None, key="task.reward_fn")
    rows = lookup_countdown.generate(c.task, 200, seed=3)
    source = PromptSource([Example(i, r["prompt"], r["answer"]) for i, r in enumerate(rows)], TOK.encode, 2, 512,
                          seed=0)
    store = PartialRolloutStore(StalenessConfig(max_versions=100))
    monitor = CompletionMonitor(c.rollout, LocalPool(list(workers), [16, 16]), LocalProxy(source), LocalProxy(store),
                                c.staleness)
    return source, store, monitor, engines


def test_a_group_with_an_episode_that_raised_is_dropped_not_trained(tool_log):
    """Samples whose episode raised never reach the batch: their groups are dropped as `episode_error`, each
    error kept by sample id (groups.jsonl writes them), counted, and the step refills the batch."""
    from april_ray.rollout.local import resolve

    async def flaky(ep):
        if ep.sample.sample_id.endswith("s1") and int(ep.sample.group_id.split("p")[-1]) % 2:
            await ep.generate(stop=("?",))
            raise ValueError(f"environment broke on {ep.sample.sample_id}")
        return await lookup_countdown.episode(ep)

    source, store, monitor, _ = agent_monitor(flaky)
    r = asyncio.run(monitor.step(0, 0))
    batch = [resolve(h) for g in r.groups for h in g]
    assert len(r.groups) == 4 and all(s.reward == 1.0 and "error" not in s.episode for s in batch)
    assert r.episode_errors
    assert all(e == f"ValueError: environment broke on {sid}" for sid, e in r.episode_errors.items())
    failed_groups = {sid[:-2] for sid in r.episode_errors}
    assert {g: why for g, why in r.dropped.items()} == {g: "episode_error" for g in failed_groups}
    assert r.metrics["rollout/episode_errors"] == len(r.episode_errors) == r.metrics["rollout/groups_episode_error"]
    assert source.num_groups_taken == 4 + len(failed_groups) + len(store)


@pytest.mark.parametrize("kind", ["raises", "never_generates", "reward_text"])
def test_a_step_where_every_sample_fails_or_nothing_is_generated_stops_with_the_error(kind):
    """Every episode raises (the first traceback in full), no episode calls generate, or the reward returns
    the string "0.5" for every sample (one line naming task.reward_fn): the first step stops."""
    from april_ray.rollout.monitor import StepFailed

    async def raises(ep):
        await ep.generate(stop=("?",))
        {}["missing key"]

    async def never_generates(ep):
        return None

    messages = {
        "raises": r"(?s)every sample of the \d+ groups that finished failed; nothing to train. The first error: "
                  r"Traceback.*KeyError: 'missing key'",
        "never_generates": r"no model token was generated in the batch's 4 groups \(rollout.episode_fn: does the "
                           r"episode call",
        "reward_text": r"every sample of the \d+ groups that finished failed; nothing to train. The first error: "
                       r"task.reward_fn: ValueError\(\"returned '0.5' \(str\), not a finite real number\"\)$"}
    episode = {"raises": raises, "never_generates": never_generates}.get(kind)
    _, store, monitor, _ = agent_monitor(episode, reward_fn=(lambda *a: "0.5") if kind == "reward_text" else None)
    message = messages[kind]
    with pytest.raises(StepFailed, match=message):
        asyncio.run(monitor.step(0, 0))


def test_april_steps_of_episodes_resume_them_at_their_turn_and_lose_nothing(tool_log):
    """The real monitor, source and store over two workers running the agent task's episodes: over several
    APRIL steps, episodes are interrupted mid-trajectory and continued at later steps (counted), the batch
    carries environment tokens (counted), every returned episode is exactly right, no sample is returned
    twice, and each (sample, turn) called the tool at most once."""
    from april_ray.rollout.local import resolve

    source, store, monitor, engines = agent_monitor()

    async def run():
        out = []
        for step in range(8):
            for e in engines:
                e.version = step
            out.append(await monitor.step(step, step))
        return out

    results = asyncio.run(run())
    seen = set()
    for r in results:
        for s in (resolve(h) for g in r.groups for h in g):
            assert s.sample_id not in seen and s.reward == 1.0
            seen.add(s.sample_id)
    assert source.num_groups_taken == monitor.num_returned_groups + monitor.num_dropped_groups + len(store)
    assert sum(r.metrics["rollout/episodes_resumed"] for r in results) > 0
    assert all(r.metrics["rollout/env_tokens"] > 0 for r in results)
    calls = [(c["sample"], c["turn"]) for c in tool_calls(tool_log)]
    assert len(calls) == len(set(calls)) > 0


class ScriptEngine(TranscriptEngine):
    """Writes `response` (the model's and the environment's parts, as the episode should end up) from wherever
    the response stands, one token per call step, stopping at any stop id as the CPU engine does."""

    def __init__(self, prompt: str, response: str):
        super().__init__(tick=0.0)
        self.prompt_len, self.right = len(TOK.encode(prompt)), TOK.encode(response) + [TOK.eos_token_id]

    async def generate(self, req):
        self.requests.append(req)
        at = len(req.input_ids) - self.prompt_len
        assert req.input_ids[self.prompt_len:] == self.right[:at], "the episode's context went off the script"
        out = []
        for t in self.right[at:]:
            out.append(t)
            if t in req.sampling.stop_token_ids:
                return self._output(req, out, FinishReason.STOP)
            if len(out) == req.sampling.max_new_tokens:
                return self._output(req, out, FinishReason.LENGTH)
        return self._output(req, out, FinishReason.STOP)


def test_the_calculator_environment_answers_calls_and_never_runs_code():
    from april_ray.task import calculator

    assert calculator.calculate("2*(3+4)") == "14" and calculator.calculate("7/2") == "3.5"
    assert calculator.calculate("__import__('os').system('touch x')").startswith("error")
    assert calculator.calculate("9**9**9").startswith("error") and calculator.calculate("1/0").startswith("error")
    turns = [" I need <calc>12*(3+4)</calc>", " so <calc>84-4</calc>", " the answer is \\boxed{80}"]
    right = turns[0] + "<result>84</result>" + turns[1] + "<result>80</result>" + turns[2]
    engine = ScriptEngine("q:", right)
    sp = SamplingParams(temperature=1.0, max_new_tokens=256, stop_token_ids=(TOK.eos_token_id,))
    worker = EngineWorker(engine, lambda ids: TOK.decode(ids, skip_special_tokens=True),
                          lambda p, r, a, m=None: float(r.endswith("\\boxed{80}")), sp, TOK.encode)
    worker.use_episodes(calculator.episode, ToolJournal(), max_model_len=1024, tool_timeout_s=5.0)
    [_], [s] = asyncio.run(worker.generate_group([Sample("c0s0", "c0", "q", "80", TOK.encode("q:"), 256)], "step"))
    assert TOK.decode(s.response_ids, skip_special_tokens=True) == right
    assert len(engine.requests) > 3  # "</calc>" is several tokens: the engine also stopped at "<calc>"'s ">"
    assert s.reward == 1.0 and s.episode["state"] == {"calls": 2} and s.episode["turn"] == 3
    assert TOK.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m]) == "<result>84</result><result>80</result>"


def test_an_episode_that_returns_no_number_scores_zero_and_is_counted():
    async def says_yes(ep):
        await ep.generate(stop=("?",))
        return "yes"

    _, worker = make_worker()
    worker.episode_fn = says_yes
    [_], [s] = asyncio.run(worker.generate_group([fresh("ab-1:")], ("run", 0)))
    assert s.reward == 0.0 and worker.reward.errors == 1


async def rewarded_turns(ep):
    """The lookup episode, with 0.25 for each turn that ends in a tool call (set again, not added, when a
    resumed episode replays the code of its turn)."""
    call_tool = ep.call_tool

    async def rewarding(*args, **kwargs):
        value = await call_tool(*args, **kwargs)
        ep.reward_turn(0.25)
        ep.reward_turn(0.25)  # the same turn: replaces
        return value

    ep.call_tool = rewarding
    return await lookup_countdown.episode(ep)


@pytest.mark.parametrize("abort_after_s", [None, 0.01, 0.03])
def test_turn_rewards_survive_an_interruption_and_add_to_the_reward_in_training_only(tool_log, abort_after_s):
    journal = ToolJournal()
    engine, worker = make_worker(journal)
    worker.episode_fn = rewarded_turns
    sample = fresh()
    if abort_after_s is not None:
        async def abort_mid_episode():
            call = asyncio.ensure_future(worker.generate_group([sample], ("run", 1)))
            await asyncio.sleep(abort_after_s)
            worker.abort_all(("run", 1))
            engine.abort_all()
            return await call

        [_], [part] = asyncio.run(abort_mid_episode())
        sample = sample_from_json(json.loads(json.dumps(sample_to_json(part))), "store")
        _, worker = make_worker(journal)
        worker.episode_fn = rewarded_turns
    [meta], [done] = asyncio.run(worker.generate_group([sample], ("run", 2)))
    assert done.episode["turn_rewards"] == {"1": 0.25, "2": 0.25, "3": 0.25}  # three tool calls
    assert done.reward == meta.reward == 1.0 + 0.75  # the task's exact match, then the turns'
    [(reward, _)] = asyncio.run(worker.evaluate([("ab,qd,zz-2:", TOK.encode("ab,qd,zz-2:"), "", {})], 1.0, "eval"))
    assert reward == 1.0  # held-out accuracy scores the answer alone
    handle = Episode(worker.episodes, fresh(), ("run", 3), "")
    for bad in (float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="reward_turn of e0p0s0: .*not a finite real number"):
            handle.reward_turn(bad)
